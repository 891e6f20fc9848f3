"""LoRAModelManager: the engine's adapters, on the host and in the device pool (vLLM's
``LRUCacheWorkerLoRAManager`` / ``LoRAModelManager``, in one object).

Host: up to ``--max-cpu-loras`` adapters read and laid out as pool rows (``layers.slot_rows``),
least recently used evicted first, but never one that a waiting or running request uses (the
cache then holds more for a while): every adapter a step needs is on the host, so a step never
reads a file, and an adapter whose folder went bad fails only the request that reads it. Device:
``--max-loras`` slots of the pool inside the params (``layers.add_pool``). ``activate`` gives
each adapter of a step a slot, writing the adapters that are not resident into free slots or
over the least recently used adapter that the step does not use. The scheduler never puts more
than ``--max-loras`` adapters in one step, so a step always finds its slots. Writing a slot is
one program compiled at start-up, so loading an adapter compiles nothing.
"""

from collections import OrderedDict
from collections.abc import Callable

import jax
import numpy as np

from jaxserve.engine.kv_sizing import lora_memory_problem
from jaxserve.lora.checkpoint import LoRAShapes, read_adapter
from jaxserve.lora.layers import add_pool, pool_of, slot_bytes, slot_rows, with_pool
from jaxserve.lora.request import LoRARequest
from jaxserve.models import sharding


def _write_slot(pool: list, index, rows: list) -> list:
    """``pool`` (``layers.pool_of``) with slot ``index`` (int32 scalar) set to ``rows``
    (``layers.slot_rows``)."""
    return jax.tree.map(lambda p, r: jax.lax.dynamic_update_index_in_dim(p, r, index, 0),
                        pool, rows)


class LoRAModelManager:
    """Args:
      params: the model's params with their pools (``layers.add_pool``), to compile the slot
        writer against.
      shapes: what an adapter must fit (``LoRAShapes.of`` the model config).
      layout: the tensor-parallel layout of the params.
      max_loras, max_rank, max_cpu_loras: the flags of the same names.
      mesh: the tensor-parallel mesh, or None.
    """

    def __init__(self, params: dict, shapes: LoRAShapes, layout: sharding.Layout,
                 max_loras: int, max_rank: int, max_cpu_loras: int, mesh=None):
        self.shapes, self.layout = shapes, layout
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        pool = pool_of(params)
        self.dtype = pool[0]["o_proj"][0].dtype
        self.host: OrderedDict[int, list] = OrderedDict()  # id -> slot rows, LRU first
        self.resident: OrderedDict[int, int] = OrderedDict()  # id -> pool row, LRU first
        where = jax.tree.map(lambda x: x.sharding, pool)
        row_where = jax.tree.map(
            lambda s: s if mesh is None else jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec(*s.spec[1:])), where)
        rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), pool)
        self._write = jax.jit(_write_slot, donate_argnums=(0,), out_shardings=where).lower(
            pool, jax.ShapeDtypeStruct((), np.int32), rows).compile()
        self._row_where = row_where

    def add_lora(self, lora_request: LoRARequest,
                 in_use: Callable[[], set[int]] = frozenset) -> None:
        """Have the adapter on the host (read from its folder unless it is already there),
        then evict least recently used adapters past ``max_cpu_loras``, sparing the ids that
        ``in_use()`` gives (those of the waiting and running requests).

        Raises:
          ValueError: the adapter is missing or refused (``checkpoint.read_adapter``).
        """
        i = lora_request.lora_int_id
        if i in self.host:
            self.host.move_to_end(i)
            return
        adapter = read_adapter(lora_request.lora_path, self.shapes, self.max_rank)
        self.host[i] = slot_rows(adapter, self.shapes, self.layout, self.max_rank, self.dtype)
        excess = len(self.host) - self.max_cpu_loras
        if excess > 0:
            keep = set(in_use()) | {i}
            for j in [j for j in self.host if j not in keep][:excess]:
                del self.host[j]

    def activate(self, params: dict, lora_ids: np.ndarray) -> tuple[dict, np.ndarray]:
        """Slots for a step's rows.

        Args:
          params: the params holding the pool.
          lora_ids: [n] int32, each row's adapter id (0: the base model); at most
            ``max_loras`` distinct ids besides 0.

        Returns:
          (the params with any adapter written into its slot, [n] int32 pool slots: 0 for the
          base model, 1 + the pool row otherwise).

        Raises:
          ValueError: more adapters than slots (a scheduling bug).
          KeyError: an adapter that ``add_lora`` did not read (a request that bypassed it).
        """
        wanted = [int(i) for i in np.unique(lora_ids) if i != 0]
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step with {len(wanted)} adapters; --max-loras is {self.max_loras}")
        for i in wanted:
            if i in self.resident:
                self.resident.move_to_end(i)
                continue
            used = set(self.resident.values())
            free = [r for r in range(self.max_loras) if r not in used]
            if free:
                row = free[0]
            else:  # the least recently used adapter that this step does not need
                victim = next(j for j in self.resident if j not in wanted)
                row = self.resident.pop(victim)
            self.host.move_to_end(i)
            params = self._write_rows(params, row, self.host[i])
            self.resident[i] = row
        slot_of = {0: 0, **{i: self.resident[i] + 1 for i in wanted}}
        return params, np.fromiter((slot_of[int(i)] for i in lora_ids), np.int32, len(lora_ids))

    def _write_rows(self, params: dict, row: int, rows: list) -> dict:
        rows = jax.tree.map(jax.device_put, rows, self._row_where)
        return with_pool(params, self._write(pool_of(params), np.int32(row), rows))


def create(config, model_config, params: dict, quantization: str | None, mesh, log,
           device_room: int | None, host_room: int | None) -> tuple[dict, "LoRAModelManager"]:
    """``--enable-lora``: the params with their (zeroed) adapter pools (``layers.add_pool``:
    allocated before the KV pool is sized, so the sizing counts them as weights) and the
    manager of their slots.

    Args:
      config: the ResolvedConfig (``max_loras``, ``max_lora_rank``, ``max_cpu_loras``,
        ``num_hosts``).
      model_config: the model's ModelConfig.
      quantization: the params' weight format (``fp8_checkpoint.resolve_method``), or None.
      device_room, host_room: the memory the pool and the host cache may take, as
        ``kv_sizing.lora_memory_problem`` takes them.

    Raises:
      ValueError: a model or setting LoRA is not served with (mixture-of-experts layers, FP8
        weights, several hosts), or a pool and host cache too large for the memory
        (``kv_sizing.lora_memory_problem``), naming the flags.
    """
    refused = ("a mixture-of-experts model" if model_config.num_experts else
               f"FP8 weights ({quantization}; --quantization)" if quantization else
               f"--num-hosts {config.num_hosts}" if config.num_hosts > 1 else None)
    if refused:
        raise ValueError(f"--enable-lora does not support {refused}")
    dtype = params["embed_tokens"].dtype
    max_cpu_loras = config.max_cpu_loras or config.max_loras
    whole, each = slot_bytes(params, config.max_lora_rank, dtype, mesh)
    problem = lora_memory_problem(
        max_loras=config.max_loras, max_cpu_loras=max_cpu_loras,
        max_lora_rank=config.max_lora_rank, slot_bytes=whole, device_slot_bytes=each,
        num_devices=sharding.mesh_size(mesh), device_room=device_room, host_room=host_room)
    if problem:
        raise ValueError(problem)
    params = add_pool(params, config.max_loras, config.max_lora_rank, dtype, mesh)
    layout = sharding.Layout.of(model_config, sharding.mesh_size(mesh))
    manager = LoRAModelManager(params, LoRAShapes.of(model_config), layout, config.max_loras,
                               config.max_lora_rank, max_cpu_loras, mesh)
    log(f"LoRA: a device pool of {config.max_loras} adapters of rank up to "
        f"{config.max_lora_rank}, {config.max_loras * whole / 2**20:.1f} MiB"
        f"{'' if mesh is None else ' in all'}; up to {max_cpu_loras} adapters kept on the host "
        f"({max_cpu_loras * whole / 2**20:.1f} MiB)")
    return params, manager
