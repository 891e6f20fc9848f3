"""Lazy checkpoint tensors (tensor-parallel loading, docs/parallelism.md): any device's slice of
a GGUF or safetensors tensor, read alone, equals that slice of the tensor loaded whole, the GGUF's
un-permuted Q/K rows included."""

import numpy as np
import pytest

from jaxserve.model_loader import load_gguf, load_hf_folder

NAMES = ["model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
         "model.layers.3.self_attn.o_proj.weight", "model.layers.3.mlp.down_proj.weight",
         "model.embed_tokens.weight", "model.norm.weight"]


def assert_slices_equal(lazy: dict, eager: dict, parts: int = 3) -> None:
    for name in NAMES:
        w, t = eager[name], lazy[name]
        assert t.shape == w.shape and t.dtype == w.dtype, name
        for axis in range(w.ndim):  # rows (column-parallel splits) and columns (row-parallel)
            n = w.shape[axis] // parts
            for i in range(parts):
                index = tuple(slice(i * n, (i + 1) * n) if a == axis else slice(None)
                              for a in range(w.ndim))
                np.testing.assert_array_equal(t[index], w[index], err_msg=f"{name} {index}")
        np.testing.assert_array_equal(np.asarray(t), w, err_msg=name)


@pytest.mark.slow
def test_gguf_lazy_slices_equal_the_whole(default_gguf, smollm):
    lazy = load_gguf(default_gguf, with_tokenizer=False, lazy=True).weights
    assert lazy.keys() == smollm.weights.keys()
    assert_slices_equal(lazy, smollm.weights)  # 3 parts: whole heads of the 9 Q and 3 K heads


def test_safetensors_lazy_slices_equal_the_whole(smollm_hf_folder):
    eager = load_hf_folder(smollm_hf_folder, with_tokenizer=False).weights
    lazy = load_hf_folder(smollm_hf_folder, with_tokenizer=False, lazy=True).weights
    assert lazy.keys() == eager.keys()
    assert_slices_equal(lazy, eager)


def test_row_slice_of_a_lazy_tensor_reads_only_its_rows():
    """Phi-3's fused projections are split into row blocks without reading them
    (``row_slice``): every index of a block reads the parent's matching part alone."""
    from jaxserve.model_loader.checkpoint import LazyTensor, row_slice

    w = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    reads = []
    parent = LazyTensor(w.shape, w.dtype, lambda index: reads.append(index) or w[index])
    block = row_slice(parent, 3, 8)
    assert block.shape == (5, 6) and not reads
    for index in [(slice(None), slice(None)), (slice(1, 4), slice(2, 6)), (slice(0, 5, 2), slice(None))]:
        np.testing.assert_array_equal(block[index], w[3:8][index])
    assert all(r[0].start >= 3 and r[0].stop <= 8 for r in reads)
    np.testing.assert_array_equal(row_slice(w, 3, 8), w[3:8])
