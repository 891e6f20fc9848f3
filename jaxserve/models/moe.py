"""Sparse mixture-of-experts MLP blocks: Mixtral, Qwen2-MoE (with its gated shared expert) and
Qwen3-MoE.

Source: HF transformers' ``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock`` and
``Qwen3MoeSparseMoeBlock`` (Shazeer et al. 2017 top-k gating; Mixtral, Jiang et al. 2024). A
token's router logits (``x @ router``) go through a float32 softmax over the experts, the k
largest probabilities pick its experts (``lax.top_k``: ties go to the lower expert index, as
``torch.topk`` on the CPU), and they are renormalized to sum to 1 where the family does so
(Mixtral always, the Qwen families with ``norm_topk_prob``). The block's output is the
probability-weighted sum of the chosen experts' SwiGLU MLPs, plus for Qwen2-MoE
``sigmoid(x @ shared_expert_gate) * shared_expert(x)``.

The experts run as two grouped GEMMs: the T x k (token, expert) pairs are sorted by expert,
each expert's rows multiply its own weights, and the results are weighted and summed back per
token; no per-expert loop, and shapes fixed by the token bucket. The grouped GEMM is XLA's
``jax.lax.ragged_dot`` or the Pallas kernel ``pallas_kernels.grouped_matmul`` (same semantics;
``Platform.moe_grouped_gemm`` picks one, ``get_grouped_gemm``).

Params of a sparse layer (X experts, E hidden, I ``moe_intermediate_size``, S
``shared_expert_intermediate_size``): ``router`` [E, X]; ``experts_gate_up`` [X, E, 2 I], each
expert's columns [gate | up] shard by shard (``llama._columns_by_shard``); ``experts_down``
[X, I, E]; Qwen2-MoE adds ``shared_gate_up`` [E, 2 S], ``shared_down`` [S, E] and
``shared_expert_gate`` [E, 1]. Under tensor parallelism each expert is split by columns as a
dense MLP is (its gate/up columns and down rows over the devices; one all-reduce after the
down projection): every device holds a slice of every expert, so the per-token routing needs no
exchange of tokens between devices. XLA splits ``ragged_dot`` over the mesh itself; a Pallas
call it cannot split, so with the Pallas GEMM the routed experts run per shard
(``sharding.per_shard_experts``).
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models import sharding
from jaxserve.models.families import ARCHITECTURES, EXPERT_NAMES
from pallas_kernels.grouped_matmul import grouped_matmul

GROUPED_GEMMS = ("ragged_dot", "pallas")


def get_grouped_gemm(name: str, interpret: bool = False) -> Callable:
    """The experts' grouped GEMM ``gemm(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]``
    (``jax.lax.ragged_dot``'s semantics) named by ``Platform.moe_grouped_gemm``: "ragged_dot"
    (XLA) or "pallas" (``pallas_kernels.grouped_matmul``; with ``interpret``, in interpret
    mode: slow, for tests off a GPU).

    Raises:
      ValueError: for a name other than ragged_dot, pallas.
    """
    if name not in GROUPED_GEMMS:
        raise ValueError(f"unknown MoE grouped GEMM {name!r} ({', '.join(GROUPED_GEMMS)})")
    if name == "ragged_dot":
        return jax.lax.ragged_dot
    return functools.partial(grouped_matmul, interpret=True) if interpret else grouped_matmul


def hf_layer_shapes(config: ModelConfig) -> dict:
    """The HF tensors of a sparse layer's MLP block (names under ``model.layers.N.``; torch
    layouts, Linear weight [out, in])."""
    c = config
    E, I, S = c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size
    block, gate, up, down = ARCHITECTURES[c.architecture].expert_names
    shapes = {f"{block}.gate.weight": (c.num_experts, E)}
    for x in range(c.num_experts):
        shapes |= {f"{block}.experts.{x}.{gate}.weight": (I, E),
                   f"{block}.experts.{x}.{up}.weight": (I, E),
                   f"{block}.experts.{x}.{down}.weight": (E, I)}
    if S:
        shapes |= {f"{block}.shared_expert.gate_proj.weight": (S, E),
                   f"{block}.shared_expert.up_proj.weight": (S, E),
                   f"{block}.shared_expert.down_proj.weight": (E, S),
                   f"{block}.shared_expert_gate.weight": (1, E)}
    return shapes


def is_sparse(t: dict) -> bool:
    """Whether a layer's HF tensors ``t`` (names under ``model.layers.N.``) hold an MoE block."""
    return any(f"{block}.gate.weight" in t for block, *_ in EXPERT_NAMES)


def params_from_hf(t: dict, columns_by_shard, n: int) -> dict:
    """A sparse layer's MLP params (module docstring) from its HF tensors ``t`` (in a jit; the
    family and the expert count read from the names and the router's shape);
    ``columns_by_shard(blocks, n)`` lays gate/up columns out for an n-device mesh."""
    block, gate, up, down = next(names for names in EXPERT_NAMES
                                 if f"{names[0]}.gate.weight" in t and
                                 f"{names[0]}.experts.0.{names[1]}.weight" in t)
    router = t[f"{block}.gate.weight"]

    def stacked(name):  # [X, in, out]: one stack and one transpose per projection, as per-expert
        # transposes and concatenations made XLA:GPU compile a 128-expert layer for minutes
        return jnp.stack([t[f"{block}.experts.{x}.{name}.weight"]
                          for x in range(router.shape[0])]).swapaxes(1, 2)

    p = {
        "router": router.T,
        "experts_gate_up": columns_by_shard([stacked(gate), stacked(up)], n),
        "experts_down": stacked(down),
    }
    if f"{block}.shared_expert_gate.weight" in t:
        shared = lambda name: t[f"{block}.shared_expert.{name}.weight"].T  # noqa: E731
        p |= {"shared_gate_up": columns_by_shard([shared("gate_proj"), shared("up_proj")], n),
              "shared_down": shared("down_proj"),
              "shared_expert_gate": t[f"{block}.shared_expert_gate.weight"].T}
    return p


def gated_act(gate_up: jax.Array, n: int, act: str = "silu") -> jax.Array:
    """[R, 2 I] columns [gate | up] of each of n shards -> act(gate) * up, [R, I] (the dense
    MLP's and every expert's activation): SwiGLU with ``act`` silu, GeGLU with
    gelu_pytorch_tanh (the tanh approximation of GELU)."""
    rows = gate_up.shape[0]
    g = gate_up.reshape(rows, n, 2, -1)
    gate = jax.nn.silu(g[:, :, 0]) if act == "silu" else jax.nn.gelu(g[:, :, 0], approximate=True)
    return (gate * g[:, :, 1]).reshape(rows, -1)


def route(x: jax.Array, router: jax.Array, top_k: int,
          norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Each token's ``top_k`` experts and their weights: x [T, E], router [E, X] -> (weights
    [T, k] float32, experts [T, k] int32), as the family's HF router computes them (module
    docstring)."""
    logits = jnp.dot(x, router.astype(x.dtype), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts


def routed_experts(x: jax.Array, router: jax.Array, gate_up: jax.Array, down: jax.Array, *,
                   top_k: int, norm_topk_prob: bool, n: int, act: str,
                   grouped_gemm: Callable) -> jax.Array:
    """The routed experts' part of the block: x [T, E] -> [T, E] float32, the ``top_k``
    chosen experts' outputs weighted and summed per token; gate_up [X, E, 2 I] (columns laid
    out for n shards), down [X, I, E]; ``grouped_gemm`` (``get_grouped_gemm``) runs both
    projections."""
    num_tokens, k = x.shape[0], top_k
    weights, experts = route(x, router, top_k, norm_topk_prob)
    # The T k (token, expert) pairs, sorted by expert: each expert's rows are contiguous.
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k  # the token of each sorted pair
    group_sizes = jnp.bincount(flat, length=router.shape[1]).astype(jnp.int32)
    h = grouped_gemm(x[token], gate_up, group_sizes)
    y = grouped_gemm(gated_act(h, n, act), down, group_sizes)
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[token].add(y)


def sparse_mlp(x: jax.Array, p: dict, top_k: int, norm_topk_prob: bool, n: int,
               act: str = "silu", grouped_gemm: Callable = jax.lax.ragged_dot,
               mesh=None) -> jax.Array:
    """The sparse MLP block: x [T, E] -> [T, E] in x's dtype; p a sparse layer's params, its
    gate/up columns laid out for an n-device mesh; ``top_k`` experts a token (``route``), each
    expert's activation ``act`` (``gated_act``), the expert GEMMs ``grouped_gemm``
    (``get_grouped_gemm``). ``mesh``: the tensor-parallel mesh of the params (n devices), on
    which a grouped GEMM other than ragged_dot runs per shard (module docstring); None: one
    device."""
    routed = functools.partial(routed_experts, top_k=top_k, norm_topk_prob=norm_topk_prob,
                               act=act, grouped_gemm=grouped_gemm)
    args = (x, p["router"], p["experts_gate_up"], p["experts_down"])
    if mesh is None or grouped_gemm is jax.lax.ragged_dot:
        out = routed(*args, n=n)
    else:
        out = sharding.per_shard_experts(functools.partial(routed, n=1), mesh)(*args)
    if "shared_gate_up" in p:
        shared = gated_act(x @ p["shared_gate_up"], n, act) @ p["shared_down"]
        gate = jax.nn.sigmoid(jnp.dot(x, p["shared_expert_gate"],
                                      preferred_element_type=jnp.float32))
        out = out + gate * shared.astype(jnp.float32)
    return out.astype(x.dtype)
