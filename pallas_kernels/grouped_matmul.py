"""Grouped matrix multiplication (the MoE expert GEMMs) in Pallas (Triton backend).

``grouped_matmul(lhs, rhs, group_sizes)`` computes what ``jax.lax.ragged_dot`` does: the rows
of ``lhs`` are sorted by group, group g's ``group_sizes[g]`` rows multiply ``rhs[g]``, and rows
past ``sum(group_sizes)`` come out as zeros.

Tile schedule: a small XLA computation inside the jit cuts every group's rows into row tiles
of ``block_m`` from the group's first row (a group's last tile may be short; an empty group
has none); the rows past the groups form one more pseudo-group, whose tiles write zeros. G + 1
groups of M rows in all take at most ``cdiv(M, block_m) + G`` tiles (at most one short tile a
group, and with G + 1 short tiles their remainders sum to a multiple of block_m), so the grid
is static: (tiles, cdiv(N, block_n)), with tiles past those in use doing nothing. A program
reads its tile's (group, first row, group's end row) from an int32 table, loads its rows
(masked to the group), loops over K ``block_k`` columns at a time accumulating
``pl.dot`` in float32, and stores its group's rows only (masked store) in lhs's dtype.

Sources (ideas, no code): the tile schedule of JAX's TPU ``megablox/gmm.py`` (there tiles are
aligned to block_m and shared by neighbouring groups; here a group starts its own tiles, so no
row is read by two groups' programs), and vLLM's ``fused_moe`` Triton kernel, whose
``moe_align_block_size`` pads each expert's rows to whole tiles (the same bound: rows plus
experts x (block_m - 1)) and whose tile sizes follow the batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention import MIN_TILE_ROWS

_INFO_FIELDS = 4  # per tile: group, first row, the group's end row, K steps (0: no dots)


@dataclasses.dataclass(frozen=True)
class GmmTuning:
    """Static tile and launch parameters of the grouped matmul (None = chosen from shapes).

    Attributes:
        block_m: rows per tile (power of two, >= 16: Triton's dot minimum).
        block_n: output columns per program (power of two).
        block_k: K columns per inner-loop step (power of two).
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining depth of the K loop.
    """

    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


def resolve_gmm_tuning(num_rows: int, num_groups: int, itemsize: int = 2,
                       tuning: GmmTuning | None = None) -> GmmTuning:
    """Fills the unset fields of ``tuning``; returns a complete GmmTuning.

    Defaults (not measured on a GPU yet; scripts/bench_moe.py --gmm-tuning times others):
    block_m the rows a group holds on average (M / G) as a power of two in [16, 128], as vLLM's
    fused_moe shrinks its tile at small batches (a decode step gives most experts a row or two,
    and every tile's rows past its group are wasted work); block_n 128; block_k 64 for 16-bit
    operands, 32 for float32 (twice the shared memory per element); 8 warps for a 128 x 128
    tile, else 4; 3 stages.
    """
    tuning = tuning or GmmTuning()
    per_group = pl.next_power_of_2(max(1, num_rows // max(1, num_groups)))
    block_m = pl.next_power_of_2(max(MIN_TILE_ROWS,
                                     tuning.block_m or min(128, max(MIN_TILE_ROWS, per_group))))
    block_n = pl.next_power_of_2(max(MIN_TILE_ROWS, tuning.block_n or 128))
    block_k = pl.next_power_of_2(max(MIN_TILE_ROWS, tuning.block_k or (64 if itemsize <= 2
                                                                        else 32)))
    return GmmTuning(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=tuning.num_warps or (8 if block_m * block_n >= 128 * 128 else 4),
        num_stages=tuning.num_stages or 3,
    )


def tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int,
                  num_k_steps: int) -> jax.Array:
    """The tile table, [num_tiles * _INFO_FIELDS] int32 (``num_tiles`` = cdiv(M, block_m) +
    G): for each tile in use (groups in order, then the pseudo-group of rows past the groups)
    its group, first row, the group's end row and its K steps (``num_k_steps``; 0 for the
    pseudo-group, whose rows are zeros); unused tiles have no rows. Groups reaching past
    ``num_rows`` are cut there."""
    num_groups = group_sizes.shape[0]
    num_tiles = pl.cdiv(num_rows, block_m) + num_groups
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])  # + the pseudo-group
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    per_group = (ends - starts + block_m - 1) // block_m
    last = jnp.cumsum(per_group)  # inclusive: the tiles of groups 0..g
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all: one fused kernel (the default "scan" is a loop; see flash_attention).
    g = jnp.searchsorted(last, t, side="right", method="compare_all").astype(jnp.int32)
    used = g <= num_groups
    g = jnp.minimum(g, num_groups)
    first = starts[g] + (t - (last[g] - per_group[g])) * block_m
    info = jnp.stack([
        jnp.minimum(g, num_groups - 1),  # rhs index (the pseudo-group reads none)
        jnp.where(used, first, 0),
        jnp.where(used, ends[g], 0),
        jnp.where(used & (g < num_groups), num_k_steps, 0),
    ], axis=1)
    return info.reshape(-1)


def _gmm_kernel(info_ref, lhs_ref, rhs_ref, o_ref, *, block_m: int, block_k: int,
                block_n: int, num_cols: int):
    # info_ref [num_tiles * _INFO_FIELDS] int32 (whole); lhs_ref [M, K] (whole);
    # rhs_ref [G, K, block_n] (this column block); o_ref [M, block_n] (this column block).
    base = pl.program_id(0) * _INFO_FIELDS
    group = info_ref[base]
    first = info_ref[base + 1]
    end = info_ref[base + 2]
    k_steps = info_ref[base + 3]
    depth = lhs_ref.shape[1]
    rows = first + jnp.arange(block_m, dtype=jnp.int32)
    row_mask = rows < end
    col_mask = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32) < num_cols
    offs_k = jnp.arange(block_k, dtype=jnp.int32)

    def step(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        a_mask, b_mask = row_mask[:, None], None
        if depth % block_k:  # a short last step: mask the columns past K
            k_mask = k0 + offs_k < depth
            a_mask, b_mask = a_mask & k_mask[None, :], k_mask[:, None]
        if num_cols % block_n:  # a short last column block
            b_mask = col_mask[None, :] if b_mask is None else b_mask & col_mask[None, :]
        a = plgpu.load(lhs_ref.at[pl.ds(first, block_m), pl.ds(k0, block_k)], mask=a_mask,
                       other=0.0)
        b_ref = rhs_ref.at[group, pl.ds(k0, block_k), :]
        b = b_ref[...] if b_mask is None else plgpu.load(b_ref, mask=b_mask, other=0.0)
        return acc + plgpu.dot(a, b)

    acc = lax.fori_loop(0, k_steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    mask = row_mask[:, None] & col_mask[None, :]
    plgpu.store(o_ref.at[pl.ds(first, block_m), :], acc.astype(o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   tuning: GmmTuning | None = None, interpret: bool = False) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` as a Pallas kernel (module docstring).

    Args:
        lhs: [M, K] rows sorted by group (float32 or bfloat16).
        rhs: [G, K, N] one matrix per group, lhs's dtype.
        group_sizes: [G] int32 rows of each group, in order; sum <= M (rows past M are cut).
        tuning: static tile/launch overrides; None picks from the shapes.
        interpret: run the kernel in interpret mode (CPU).

    Returns:
        [M, N] in lhs's dtype (float32 accumulation): row r of group g is lhs[r] @ rhs[g];
        rows past sum(group_sizes) are 0.

    Raises:
        ValueError: on inconsistent shapes or dtypes.
    """
    num_rows, depth = lhs.shape
    if rhs.ndim != 3 or rhs.shape[1] != depth:
        raise ValueError(f"rhs {rhs.shape} must be [G, K, N] with K = {depth} (lhs {lhs.shape})")
    num_groups, _, num_cols = rhs.shape
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"group_sizes {group_sizes.shape} must be [G] = [{num_groups}]")
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"lhs {lhs.dtype} and rhs {rhs.dtype} must have one dtype")
    t = resolve_gmm_tuning(num_rows, num_groups, jnp.dtype(lhs.dtype).itemsize, tuning)
    info = tile_schedule(group_sizes, num_rows, t.block_m, pl.cdiv(depth, t.block_k))
    num_tiles = info.shape[0] // _INFO_FIELDS
    kernel = functools.partial(_gmm_kernel, block_m=t.block_m, block_k=t.block_k,
                               block_n=t.block_n, num_cols=num_cols)
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, pl.cdiv(num_cols, t.block_n)),
        in_specs=[
            pl.BlockSpec(info.shape, lambda i, j: (0,)),
            pl.BlockSpec((num_rows, depth), lambda i, j: (0, 0)),
            pl.BlockSpec((num_groups, depth, t.block_n), lambda i, j: (0, 0, j)),
        ],
        out_specs=pl.BlockSpec((num_rows, t.block_n), lambda i, j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((num_rows, num_cols), lhs.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name=f"jaxserve_grouped_matmul_bm{t.block_m}_bn{t.block_n}_bk{t.block_k}",
    )(info, lhs, rhs)
