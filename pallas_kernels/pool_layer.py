"""One layer of a KV pool stacked by layer, read and written in place (the CPU's layer loop,
docs/architecture.md "The layer loop").

A stacked K (or V) pool is one ``[L, KV, num_pages, page_size, D]`` array (or an FP8
``kv_quant.QuantizedPages`` of such values and ``[L, KV, num_pages, page_size]`` scales).
``PoolLayer(pool, layer)`` stands where one layer's ``[KV, num_pages, page_size, D]`` pool
would: attention reads its pages with one gather whose indices include the layer, and the KV
write scatters at ``[layer, ...]``, so only the pages touched move. Slicing the layer out
instead (``pool[layer]``) made XLA copy that layer's whole pool every layer of every step.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class PoolLayer:
    """Layer ``layer`` of a pool stacked by layer; a pytree.

    Attributes:
      pool: [L, KV, num_pages, page_size, D] array, or a QuantizedPages stacked alike.
      layer: int32 scalar, traced inside a loop over the layers.
    """

    pool: object
    layer: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """One layer's shape, [KV, num_pages, page_size, D]."""
        return tuple(self.pool.shape[1:])

    @property
    def dtype(self):
        return self.pool.dtype


jax.tree_util.register_dataclass(PoolLayer, data_fields=["pool", "layer"], meta_fields=[])


def split(pool) -> tuple[object, tuple]:
    """(storage, lead): the arrays that hold ``pool`` (a one-layer pool or a ``PoolLayer``'s
    stacked pool) and the index that leads every access to its layer: () or (layer,). An
    access ``a[(*lead, slice(None), idx...)]`` of a PoolLayer puts the advanced indices' axes
    first (NumPy's rule for advanced indices apart), before the KV heads."""
    if isinstance(pool, PoolLayer):
        return pool.pool, (pool.layer,)
    return pool, ()
