"""StepLayout: the step's host inputs survive the trip through one int32 buffer, bit for bit
(float32 and uint32 fields included), and a field of the wrong size or dtype is refused."""

import jax
import numpy as np
import pytest

from jaxserve.worker.step_inputs import FIELDS, StepLayout


def _fields(layout: StepLayout, rng) -> dict[str, np.ndarray]:
    n = {"t": layout.tokens, "s": layout.seqs, "s+1": layout.seqs + 1,
         "l": layout.num_logits_rows, "r": layout.rows, "w": layout.writes,
         "p": layout.drafting_seqs}
    out = {}
    for name, length, dtype in FIELDS:
        if np.dtype(dtype) == np.float32:
            out[name] = rng.standard_normal(n[length]).astype(np.float32)
        else:
            info = np.iinfo(dtype)
            out[name] = rng.integers(info.min, info.max, n[length], dtype=dtype)
    return out


def test_pack_then_unpack_in_a_jit_is_the_identity():
    layout = StepLayout(tokens=16, seqs=4, rows=8, writes=5, logits_rows=6, drafting_seqs=3)
    fields = _fields(layout, np.random.default_rng(0))
    packed = layout.pack(fields)
    assert packed.shape == (layout.size,) and packed.dtype == np.int32
    # tokens, sequences, query_start_loc, logits rows (indices and 5 sampling fields), prompt
    # log-probability rows, block table writes, sequences drafting on the device
    assert layout.size == 7 * 16 + 2 * 4 + 5 + 6 * 6 + 8 + 3 * 5 + 3
    unpacked = jax.jit(layout.unpack)(packed)
    for name, value in fields.items():
        got = np.asarray(unpacked[name])
        assert got.dtype == value.dtype, name
        np.testing.assert_array_equal(got.view(np.int32), value.view(np.int32), err_msg=name)


def test_a_wrong_field_is_refused():
    layout = StepLayout(tokens=16, seqs=4, rows=8, writes=5)
    fields = _fields(layout, np.random.default_rng(1))
    with pytest.raises(ValueError, match="temperature"):
        layout.pack({**fields, "temperature": fields["temperature"].astype(np.float64)})
    with pytest.raises(ValueError, match="token_ids"):
        layout.pack({**fields, "token_ids": fields["token_ids"][:-1]})
