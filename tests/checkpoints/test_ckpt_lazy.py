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
