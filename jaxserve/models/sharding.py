"""Tensor parallelism: the Megatron layout of a Llama-family model over a 1-D device mesh.

Source: Megatron-LM's column- and row-parallel linear layers, as vLLM applies them to Llama
(``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``), expressed as ``jax.sharding`` specs: the model code stays one global
program, and XLA's SPMD partitioner splits it and adds the collectives (one all-reduce after the
O projection and one after the down projection of every layer, plus the embedding's and the
logits'). Only the KV write and attention run per shard, under ``shard_map``
(``per_shard_attention``), so the Pallas kernels see one device's heads and pages.

Over ``--tensor-parallel-size N`` (mesh axis ``"tp"``):

* fused QKV ``[E, (H + 2 KV) D]`` and gate/up ``[E, 2 I]`` are column-parallel: their columns are
  laid out shard by shard (shard i holds its q heads, k heads, v heads; its gate and up
  columns), so each device's block of columns is its own slice of every projection;
* O ``[H D, E]`` and down ``[I, E]`` are row-parallel (sharded on their input rows);
* an MoE block's experts are each split as the dense MLP (``jaxserve.models.moe``): every
  device holds a column slice of every expert's gate/up and a row slice of its down;
* the embedding and an untied LM head ``[V, E]`` are sharded by vocabulary, padded to a
  multiple of N; the logits are gathered to the full vocabulary for the sampler;
* the KV page pool ``[KV, pages, page_size, D]`` is sharded by KV head. When N exceeds the KV
  heads, each KV head is replicated N / KV times (in the weights and the pool), as vLLM does, so
  every device holds one.

N must divide the query heads and the intermediate size, and N and the KV heads must divide one
another (vLLM's rule); ``check_tensor_parallel`` says which, naming the flag.
"""

from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.config import ModelConfig
from pallas_kernels.pool_layer import PoolLayer

AXIS = "tp"
FLAG = "--tensor-parallel-size"


def make_mesh(tp: int, devices: list | None = None) -> Mesh | None:
    """The 1-D mesh ``("tp",)`` over the first ``tp`` of ``devices`` (default: ``jax.devices()``,
    every process's, ordered by process, so a mesh spans hosts once jax.distributed is up);
    None for ``tp == 1``, where the engine runs unsharded on the default device.

    Raises:
      ValueError: ``tp`` exceeds the devices there are (names the flag).
    """
    devices = jax.devices() if devices is None else devices
    if tp > len(devices):
        raise ValueError(f"{FLAG} {tp} exceeds the {len(devices)} {devices[0].platform} "
                         f"device(s) JAX sees")
    return None if tp == 1 else Mesh(np.array(devices[:tp]), (AXIS,))


def mesh_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[AXIS]


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """vLLM's conditions for tensor parallelism of size ``tp``.

    Raises:
      ValueError: ``tp`` does not divide the attention heads or the intermediate size, or
        neither of ``tp`` and the KV heads divides the other; the message names the flag and the
        sizes that would work.
    """
    c = config
    ok = [n for n in range(1, c.num_heads + 1) if _divides_model(c, n)]
    why = None
    if c.num_heads % tp:
        why = f"the model's {c.num_heads} attention heads"
    elif c.intermediate_size % tp:
        why = f"the model's intermediate size {c.intermediate_size}"
    elif c.moe_intermediate_size % tp or c.shared_expert_intermediate_size % tp:
        why = (f"the model's expert intermediate sizes ({c.moe_intermediate_size}, shared "
               f"{c.shared_expert_intermediate_size})")
    elif c.num_kv_heads % tp and tp % c.num_kv_heads:
        why = (f"the model's {c.num_kv_heads} KV heads (and is not a multiple of them, which "
               f"would replicate them)")
    if why:
        raise ValueError(f"{FLAG} {tp} does not divide {why}; sizes that fit this model: "
                         f"{', '.join(map(str, ok))}")


def _divides_model(c: ModelConfig, tp: int) -> bool:
    return (c.num_heads % tp == 0 and c.intermediate_size % tp == 0
            and c.moe_intermediate_size % tp == 0 and c.shared_expert_intermediate_size % tp == 0
            and (c.num_kv_heads % tp == 0 or tp % c.num_kv_heads == 0))


@dataclass(frozen=True)
class Layout:
    """How one model is split over ``size`` devices (``size`` 1: unsharded).

    Attributes:
      size: devices of the mesh's ``tp`` axis.
      num_kv_heads: KV heads of the built model and of the pool: the model's, or ``size`` when
        that exceeds them (each replicated ``kv_replicas`` times).
      kv_replicas: copies of each KV head.
      vocab_size: rows of the embedding and LM head: the vocabulary padded to a multiple of size.
    """

    size: int
    num_kv_heads: int
    kv_replicas: int
    vocab_size: int

    @classmethod
    def of(cls, config: ModelConfig, tp: int) -> "Layout":
        """Raises ValueError as ``check_tensor_parallel``."""
        check_tensor_parallel(config, tp)
        kv = max(config.num_kv_heads, tp)
        return cls(tp, kv, kv // config.num_kv_heads, -(-config.vocab_size // tp) * tp)

    @property
    def kv_heads_per_device(self) -> int:
        return self.num_kv_heads // self.size


# Params (llama's names, in and outside the layers) -> how each is split over the "tp" axis.
_SPECS = {
    "input_layernorm": P(), "post_attention_layernorm": P(), "q_norm": P(), "k_norm": P(),
    "pre_feedforward_layernorm": P(), "post_feedforward_layernorm": P(),
    "qkv_proj": P(None, AXIS), "qkv_bias": P(AXIS), "gate_up_proj": P(None, AXIS),
    "o_proj": P(AXIS, None), "o_bias": P(), "down_proj": P(AXIS, None),
    "embed_tokens": P(AXIS, None), "lm_head": P(AXIS, None), "norm": P(),
    # MoE blocks (``jaxserve.models.moe``): each expert split by columns as the dense MLP.
    "router": P(), "experts_gate_up": P(None, None, AXIS), "experts_down": P(None, AXIS, None),
    "shared_gate_up": P(None, AXIS), "shared_down": P(AXIS, None), "shared_expert_gate": P(),
}


def _spec(path) -> P:
    """The spec of the param leaf at ``path``: by its name, and for the fields of an FP8 weight
    (``linear.Fp8Weight``: ``[out, in]`` weight, ``[out]`` scale, scalar input scale) the plain
    ``[in, out]`` weight's spec turned to that layout (a column-parallel weight's scales split
    with its columns, a row-parallel one's replicated; the input scale replicated); for a
    ``LoRALinear`` (``jaxserve.lora.layers``) its base weight's as above, its pools'
    ``lora_pool_spec``."""
    name = next(k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey))
    spec = _SPECS[name]
    attrs = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
    if attrs[:1] == ["base"]:  # a LoRALinear's base weight splits as the weight itself
        attrs = attrs[1:]
    if attrs[:1] in (["a"], ["b"]):
        return lora_pool_spec(name)[attrs[0] == "b"]
    if attrs:
        rows, cols = spec  # of the [in, out] weight
        spec = {"weight": P(cols, rows), "scale": P(cols)}.get(attrs[-1], P())
    return spec


def lora_pool_spec(name: str) -> tuple[P, P]:
    """(a's, b's) specs of projection ``name``'s LoRA pool (``jaxserve.lora.layers``: a
    ``[L, in, K]``, b ``[L, K, out]``): split as the base ``[in, out]`` weight splits, a by its
    input rows, b by its output columns; the other replicated."""
    rows, cols = _SPECS[name]
    return P(None, rows, None), P(None, None, cols)


def param_shardings(params_like, mesh: Mesh):
    """NamedShardings of params (``jaxserve.models.llama``'s dict, one layer's dict, or the same
    of shapes), by each leaf's name."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, _spec(path)), params_like)


def hf_sharding(name: str, shape: tuple, mesh: Mesh) -> NamedSharding:
    """Where an HF tensor (torch layout, name as in a checkpoint) goes before the params are built
    from it: split the way its param is split, so each device receives only its slice (from the
    host, or restored so by orbax); replicated where its rows do not split evenly (KV heads
    fewer than the devices, a vocabulary to be padded), and the norms."""
    n = mesh.shape[AXIS]
    # Column-parallel params come from HF [out, in] weights split on out; row-parallel ones from
    # weights split on in.
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                      "up_proj.weight", "embed_tokens.weight", "lm_head.weight",
                      "q_proj.bias", "k_proj.bias", "v_proj.bias", ".w1.weight", ".w3.weight")):
        spec = P(AXIS) if shape[0] % n == 0 else P()
    elif name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
        spec = P(None, AXIS)
    else:
        spec = P()
    return NamedSharding(mesh, spec)


def kv_sharding(mesh: Mesh, stacked: bool = False) -> NamedSharding:
    """The KV pool's: ``[KV, pages, page_size, D]`` split by KV head; ``stacked``: the pool
    ``[L, KV, pages, page_size, D]`` of every layer (``pallas_kernels.pool_layer``)."""
    return NamedSharding(mesh, _kv_spec(stacked))


def _kv_spec(stacked: bool) -> P:
    return P(None, AXIS) if stacked else P(AXIS)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def gather_logits(logits: jax.Array, mesh: Mesh) -> jax.Array:
    """[S, V] logits (in a jit) computed where their LM-head rows are, split by vocabulary, then
    gathered whole onto every device for the sampler. Without the first constraint, XLA may
    gather the whole LM head instead (it did, for a [256, 64] head and 4 rows)."""
    logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(None, AXIS)))
    return jax.lax.with_sharding_constraint(logits, replicated(mesh))


def per_shard_attention(fn: Callable, mesh: Mesh) -> Callable:
    """``fn(q, k, v, k_pages, v_pages, md) -> (out, k_pages, v_pages)`` (llama's KV write and
    attention) run on each device's heads under ``shard_map``.

    Shapes (global): q [T, H, D], k and v [T, KV, D], pages [KV, pages, page_size, D] (or a
    ``PoolLayer`` of the stacked pool), out [T, H, D], split on their head axis; md
    (``llama.AttentionMetadata``) replicated. Each device sees H / N query heads over its KV / N
    heads, the same grouping as the whole model.
    """
    heads = P(None, AXIS, None)

    def run(q, k, v, k_pages, v_pages, md):
        pool = P(AXIS)
        if isinstance(k_pages, PoolLayer):  # its stacked pool split so, its layer replicated
            pool = PoolLayer(_kv_spec(True), P())
        return jax.shard_map(fn, mesh=mesh, in_specs=(heads, heads, heads, pool, pool, P()),
                             out_specs=(heads, pool, pool),
                             # The Pallas kernels' custom calls carry no varying-axis types.
                             check_vma=False)(q, k, v, k_pages, v_pages, md)

    return run


def per_shard_experts(fn: Callable, mesh: Mesh) -> Callable:
    """``fn(x, router, gate_up, down) -> [T, E] float32`` (``moe.routed_experts`` of one
    shard's experts, n = 1) run on each device's slice of every expert under ``shard_map``, the
    partial sums of the down projection added over the mesh (one psum, as the dense MLP's
    all-reduce).

    Shapes (global): x [T, E] and router [E, X] replicated, gate_up [X, E, 2 I] split on its
    columns (each device's [gate | up] slice, ``llama._columns_by_shard``), down [X, I, E] on
    its rows.
    """
    def run(*args):
        return jax.lax.psum(fn(*args), AXIS)

    return jax.shard_map(run, mesh=mesh, in_specs=(P(), P(), P(None, None, AXIS),
                                                   P(None, AXIS, None)),
                         out_specs=P(),
                         # The Pallas kernel's custom call carries no varying-axis types.
                         check_vma=False)
