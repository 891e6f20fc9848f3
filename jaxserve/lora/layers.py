"""LoRA on the decoder's fused projections: ``LoRALinear`` (a base weight and its adapter pool,
what ``models.linear.linear`` takes), the batched delta, and an adapter's rows of the pool.

The pool. Each fused projection (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``)
holds ``a [L, in, M R]`` and ``b [L, M R, out]`` in the model's dtype, L = ``--max-loras`` slots,
R = ``--max-lora-rank``, M the HF projections fused into it (3 for q/k/v, 2 for gate/up, else
1). Slot l's block j of R columns of ``a`` is module j's ``A^T`` (rank r <= R, zero-padded), and
its block j of R rows of ``b`` holds ``s B_j^T`` (the scaling s folded in) under module j's
output columns, zeros under the others': the fused output columns come out in the base weight's
own order, shard by shard (``llama._fuse``), so a tensor-parallel split of ``b`` with its base
weight's columns (q/k/v, gate/up) or of ``a`` with its base weight's rows (o, down) gives each
device the adapter's part of its own columns or rows (``sharding``). The pool is an input of
the step like every weight, so writing an adapter into a slot compiles nothing.

The delta (``lora_delta``). Each token carries its pool slot (0: the base model, no delta;
``l`` >= 1: the adapter in row ``l - 1``). ``x @ a`` for every slot at once ([T, L, M R]),
the other slots' columns masked to zero, then one matmul with ``b`` flattened to
``[L M R, out]``: two dense GEMMs with static shapes, the masked rows adding zeros. Their cost
next to the base GEMM is about ``L M R / out`` for the first and ``L M R / in`` for the second
(8 slots of rank 16 on Llama-3.1-8B's q/k/v: ~6% and ~9%); a step whose tokens all use the base
model pays it too. This is the batched-adapter computation of Punica (Chen et al. 2023,
"Punica: Multi-Tenant LoRA Serving", SGMV) and S-LoRA (Sheng et al. 2023) done densely: no
gather, no sort, the same program on CPU and GPU. ``jax.lax.ragged_dot`` over tokens sorted by
slot, or a Pallas SGMV kernel, would skip the masked work (docs/lora.md).
"""

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.lora.checkpoint import LoRAAdapter, LoRAShapes
from jaxserve.models import sharding

# Fused projection (llama's param name) -> the HF modules it holds, in its column order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# Row-parallel projections: the input features split over the mesh (the others: the output's).
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class LoRALinear:
    """A linear weight with an adapter pool: ``linear(x, w, lora_slots)`` adds
    ``lora_delta(x, w.a, w.b, lora_slots)`` to the base projection.

    Attributes:
      base: the base weight, a plain ``[in, out]`` array (FP8 weights take no adapters:
        ``manager.create``).
      a: [L, in, M R] the slots' A blocks.
      b: [L, M R, out] the slots' scaled B blocks.
    """

    base: object
    a: jax.Array
    b: jax.Array


jax.tree_util.register_dataclass(LoRALinear, data_fields=["base", "a", "b"], meta_fields=[])


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, lora_slots: jax.Array) -> jax.Array:
    """Each token's adapter delta: x [T, in], a [L, in, K], b [L, K, out], lora_slots [T] int32
    (0: none; l: row l - 1 of the pool) -> [T, out] in x's dtype."""
    xa = jnp.einsum("ti,lik->tlk", x, a)
    xa = xa * jax.nn.one_hot(lora_slots - 1, a.shape[0], dtype=xa.dtype)[:, :, None]
    return jnp.einsum("tlk,lko->to", xa, b).astype(x.dtype)


def pool_specs(name: str, mesh) -> tuple:
    """(a's sharding, b's sharding) of projection ``name`` on ``mesh``: a row-parallel
    projection's ``a`` split by its input rows, a column-parallel one's ``b`` by its output
    columns, the other replicated."""
    spec = sharding.lora_pool_spec(name)
    return tuple(jax.sharding.NamedSharding(mesh, s) for s in spec)


def slot_bytes(params: dict, max_rank: int, dtype, mesh=None) -> tuple[int, int]:
    """Bytes of one slot of the pools ``add_pool`` would add to ``params`` (rank ``max_rank`` in
    ``dtype``): (the whole slot, which is also what an adapter's ``slot_rows`` take on the
    host; the part of it on each device of ``mesh``, as ``pool_specs`` splits it)."""
    itemsize = np.dtype(dtype).itemsize
    whole = each = 0
    for p in params["layers"]:
        for name, modules in FUSED.items():
            n_in, n_out = p[name].shape
            k = len(modules) * max_rank
            shapes = ((1, n_in, k), (1, k, n_out))
            specs = (None, None) if mesh is None else pool_specs(name, mesh)
            whole += sum(math.prod(s) for s in shapes) * itemsize
            each += sum(math.prod(s if spec is None else spec.shard_shape(s))
                        for s, spec in zip(shapes, specs)) * itemsize
    return whole, each


def add_pool(params: dict, max_loras: int, max_rank: int, dtype, mesh=None) -> dict:
    """``params`` with each decoder layer's fused projections as ``LoRALinear`` over zeroed
    pools of ``max_loras`` slots of rank ``max_rank`` in ``dtype`` (on ``mesh`` as
    ``pool_specs`` says)."""
    layers = []
    for p in params["layers"]:
        p = dict(p)
        for name, modules in FUSED.items():
            n_in, n_out = p[name].shape
            k = len(modules) * max_rank
            where = [None, None] if mesh is None else pool_specs(name, mesh)
            p[name] = LoRALinear(p[name], jnp.zeros((max_loras, n_in, k), dtype, device=where[0]),
                                 jnp.zeros((max_loras, k, n_out), dtype, device=where[1]))
        layers.append(p)
    return {**params, "layers": layers}


def pool_of(params: dict) -> list[dict]:
    """The pools of ``add_pool``'s params: per layer, projection -> (a, b)."""
    return [{name: (p[name].a, p[name].b) for name in FUSED} for p in params["layers"]]


def with_pool(params: dict, pool: list[dict]) -> dict:
    """``params`` with the pools ``pool`` (``pool_of``'s layout) in place of theirs."""
    layers = [{**p, **{name: LoRALinear(p[name].base, *pool[i][name]) for name in FUSED}}
              for i, p in enumerate(params["layers"])]
    return {**params, "layers": layers}


def slot_rows(adapter: LoRAAdapter, shapes: LoRAShapes, layout: sharding.Layout,
              max_rank: int, dtype) -> list[dict]:
    """An adapter as one slot of the pool: per layer, projection -> (a [in, M R], b [M R, out])
    host arrays in ``dtype`` (the module docstring's layout; k/v columns repeated as
    ``layout.kv_replicas`` repeats the base weight's KV heads)."""
    # llama builds the base weights' fused layout; the adapter's b takes the same steps.
    from jaxserve.models.llama import _fuse, _repeat_kv_heads

    r, R = adapter.rank, max_rank
    out = []
    for layer in range(shapes.num_layers):
        rows = {}
        for name, modules in FUSED.items():
            n_in = shapes.modules[modules[0]][0]
            a = np.zeros((n_in, len(modules) * R), np.float32)
            parts = []
            for j, module in enumerate(modules):
                b = np.zeros((shapes.modules[module][1], len(modules) * R), np.float32)
                pair = adapter.weights.get((layer, module))
                if pair is not None:
                    a[:, j * R : j * R + r] = pair[0].T
                    b[:, j * R : j * R + r] = adapter.scaling * pair[1]
                parts.append(_repeat_kv_heads(b, layout) if module in ("k_proj", "v_proj")
                             else b)
            rows[name] = (a.astype(dtype), np.asarray(_fuse(parts, layout.size), dtype))
        out.append(rows)
    return out
