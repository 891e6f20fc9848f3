"""Lower the Pallas kernels for the cuda platform on CPU (docs/architecture.md, "CPU and GPU").

This catches Pallas-to-Triton errors (block shapes, power-of-two sizes, unsupported ops) in CI;
Triton-to-PTX errors (shared memory, registers) show only on a GPU (test_attention_gpu.py,
test_grouped_matmul_gpu.py).
The shapes include the tiles the GPU defaults pick for the benchmark workloads.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxserve.config import ModelConfig
from jaxserve.model_loader.dummy import PRESETS, load_dummy
from pallas_kernels import kv_write, pool_head_dim
from pallas_kernels.flash_attention import PrefillTuning, attention
from pallas_kernels.grouped_matmul import GmmTuning, grouped_matmul
from pallas_kernels.kv_quant import QuantizedPages
from pallas_kernels.paged_attention import DecodeTuning, paged_attention


def _export_cuda(fn, *avals):
    exported = jax.export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*avals)
    text = exported.mlir_module()
    assert "__gpu$xla.gpu.triton" in text
    return text


def _avals(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, page_size, pages_per_seq,
           dtype, num_pages=64):
    s = jax.ShapeDtypeStruct
    pool = s((num_kv_heads, num_pages, page_size, head_dim), dtype)
    return dict(
        q=s((num_tokens, num_heads, head_dim), dtype), k=pool, v=pool,
        qsl=s((num_seqs + 1,), jnp.int32), seq_lens=s((num_seqs,), jnp.int32),
        bt=s((num_seqs, pages_per_seq), jnp.int32))


@pytest.mark.parametrize("group,head_dim,page_size,dtype,tuning", [
    (3, 64, 16, jnp.bfloat16, None),
    (4, 128, 16, jnp.bfloat16, DecodeTuning(num_splits=4)),
    (8, 128, 64, jnp.float32, None),
    (1, 64, 32, jnp.float32, DecodeTuning(block_k=32, num_splits=2, num_warps=8, num_stages=3)),
])
def test_paged_attention_lowers_for_cuda(group, head_dim, page_size, dtype, tuning):
    a = _avals(8, 8, 2 * group, 2, head_dim, page_size, 16, dtype)
    _export_cuda(lambda q, k, v, bt, sl: paged_attention(q, k, v, bt, sl, tuning=tuning),
                 jax.ShapeDtypeStruct((8, 2 * group, head_dim), dtype), a["k"], a["v"],
                 a["bt"], a["seq_lens"])


@pytest.mark.parametrize("group,head_dim,page_size,dtype,split,tuning", [
    (3, 64, 16, jnp.bfloat16, True, None),
    (4, 128, 16, jnp.bfloat16, True, PrefillTuning(block_q=128, block_k=64, num_warps=8)),
    (4, 128, 16, jnp.float32, False, None),
    (8, 64, 64, jnp.bfloat16, True, PrefillTuning(block_q=32, block_k=128, num_stages=3)),
])
def test_attention_lowers_for_cuda(group, head_dim, page_size, dtype, split, tuning):
    a = _avals(64, 8, 2 * group, 2, head_dim, page_size, 16, dtype)
    _export_cuda(
        lambda *args: attention(*args, split_decode=split, prefill_tuning=tuning),
        a["q"], a["k"], a["v"], a["qsl"], a["seq_lens"], a["bt"])


@pytest.mark.parametrize("split", [True, False])
def test_fp8_pool_lowers_for_cuda(split):
    """Both kernels over an FP8 pool (8-bit values widened to bfloat16 in the kernel)."""
    a = _avals(64, 8, 8, 2, 128, 16, 16, jnp.bfloat16)
    s = jax.ShapeDtypeStruct
    pool = QuantizedPages(s((2, 64, 16, 128), jnp.uint8), s((2, 64, 16), jnp.float32))
    text = _export_cuda(
        lambda q, k, v, *md: attention(q, k, v, *md, split_decode=split),
        a["q"], pool, pool, a["qsl"], a["seq_lens"], a["bt"])
    assert "ui8" in text


def _pool_8b(fp8: bool):
    s = jax.ShapeDtypeStruct
    if fp8:
        return QuantizedPages(s((8, 64, 16, 128), jnp.uint8), s((8, 64, 16), jnp.float32))
    return s((8, 64, 16, 128), jnp.bfloat16)


@pytest.mark.parametrize("max_q,fp8", [(5, False), (9, True), (1, False)])
def test_multi_token_decode_lowers_for_cuda(max_q, fp8):
    """Verified drafts through the decode kernel (``max_decode_q``; 1 is plain decode), the
    8B head layout."""
    a, pool = _avals(64, 8, 32, 8, 128, 16, 16, jnp.bfloat16), _pool_8b(fp8)
    _export_cuda(lambda q, k, v, *md: attention(q, k, v, *md, max_decode_q=max_q),
                 a["q"], pool, pool, a["qsl"], a["seq_lens"], a["bt"])


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_only_lowers_for_cuda(fp8):
    a, pool = _avals(16, 8, 32, 8, 128, 16, 16, jnp.bfloat16), _pool_8b(fp8)
    _export_cuda(lambda q, k, v, *md: attention(q, k, v, *md, decode_only=True),
                 a["q"], pool, pool, a["qsl"], a["seq_lens"], a["bt"])


MOE_SHAPES = ["qwen3-30b-a3b", "mixtral-8x7b"]  # presets of jaxserve.model_loader.dummy


def moe_gemm_avals(shape: str, num_tokens: int, projection: str, dtype=jnp.bfloat16):
    """(lhs, rhs, group_sizes) avals of one expert GEMM of ``moe.sparse_mlp`` for the preset
    ``shape``: the T k sorted rows through gate_up [X, E, 2 I] or down [X, I, E]."""
    c = ModelConfig.from_hf_config(PRESETS[shape])
    E, I, X = c.hidden_size, c.moe_intermediate_size, c.num_experts
    K, N = (E, 2 * I) if projection == "gate_up" else (I, E)
    s = jax.ShapeDtypeStruct
    return (s((num_tokens * c.num_experts_per_tok, K), dtype), s((X, K, N), dtype),
            s((X,), jnp.int32))


@pytest.mark.parametrize("projection", ["gate_up", "down"])
@pytest.mark.parametrize("num_tokens", [16, 256, 2048])
@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_grouped_matmul_lowers_for_cuda(shape, num_tokens, projection):
    _export_cuda(grouped_matmul, *moe_gemm_avals(shape, num_tokens, projection))


def test_grouped_matmul_float32_short_blocks_lower_for_cuda():
    """float32 operands, and K and N that are not multiples of the tile (masked loads)."""
    s = jax.ShapeDtypeStruct
    _export_cuda(lambda a, b, g: grouped_matmul(a, b, g, tuning=GmmTuning(block_n=32)),
                 s((50, 24), jnp.float32), s((5, 24, 40), jnp.float32), s((5,), jnp.int32))


@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("shape", sorted(PRESETS))
def test_every_preset_attention_lowers_for_cuda(shape, decode_only):
    """The attention of every dummy preset as its layers call it: its query and KV heads, the
    pool's head width (``pool_head_dim``: Phi-3-mini's heads of 96 in a pool of 128), each
    distinct sliding window, the softmax scale and the score cap."""
    c = ModelConfig.from_hf_config(load_dummy(shape, with_tokenizer=False).hf_config)
    width = pool_head_dim(attention, c.head_dim)
    a = _avals(16 if decode_only else 64, 8, c.num_heads, c.num_kv_heads, width, 16, 16,
               jnp.bfloat16)
    for window in sorted(set(c.layer_windows), key=str):
        _export_cuda(
            lambda *args: attention(
                *args, sliding_window=window, logits_soft_cap=c.attn_logit_softcapping,
                sm_scale=c.head_dim ** -0.5 if c.attn_scale is None else c.attn_scale,
                decode_only=decode_only),
            a["q"], a["k"], a["v"], a["qsl"], a["seq_lens"], a["bt"])


@pytest.mark.parametrize("num_tokens", [1, 7, 256, 8192])
@pytest.mark.parametrize("fp8", [False, True])
def test_kv_write_lowers_for_cuda(num_tokens, fp8):
    s = jax.ShapeDtypeStruct
    shape = (8, 1000, 16, 128)
    pool = (QuantizedPages(s(shape, jnp.uint8), s(shape[:-1], jnp.float32)) if fp8
            else s(shape, jnp.bfloat16))
    x = s((num_tokens, 8, 128), jnp.bfloat16)
    _export_cuda(kv_write.write_kv, pool, pool, x, x, s((num_tokens,), jnp.int32))
