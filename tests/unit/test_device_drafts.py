"""``device_drafts.settle_and_draft``: a step settles its previous step's drafts (the token fed,
positions, slot mapping, context lengths and sampling steps moved back by the rejected ones)
and fills its draft slots from the token history's n-gram lookup, fillers where it finds none."""

import jax.numpy as jnp
import numpy as np

from jaxserve.spec_decode.device_drafts import FILLER, NgramDrafting, settle_and_draft

V = 50
CFG = NgramDrafting(k=3, min_n=2, max_n=3, page_size=4, vocab_size=V)


def _step(history_a: list[int], prev_sampled: list[int], prev_drafts: list[int]):
    """A step of three sequences (slots 2, 0, 1; S = 4, T = 8, L = 6 rows):
    A (slot 2): its newest token fed from the previous step, whose last row (3) verified 3
      drafts, then 2 draft slots; the host counted all 3 drafts accepted, so it sent positions
      10, 11, 12 and a context of 13.
    B (slot 0): one known token at position 5.
    C (slot 1): its newest token fed from the previous step's row 4 (no drafts), then 1 draft
      slot, at positions 3, 4."""
    x = {
        "token_ids": [0, 0, 0, 17, 0, 0, 0, 0],
        "prev_rows": [3, -1, -1, -1, 4, -1, -1, -1],
        "prev_drafts": [3, 0, 0, 0, 0, 0, 0, 0],
        "draft_at": [-1, 0, 1, -1, -1, 3, -1, -1],
        "positions": [10, 11, 12, 5, 3, 4, 0, 0],
        "slot_mapping": [0] * 8,
        "query_start_loc": [0, 3, 4, 6, 6],
        "seq_lens": [13, 6, 5, 0],
        "seq_slots": [2, 0, 1, 0],
        "logits_indices": [0, 1, 2, 3, 4, 5],
        "steps": [7, 8, 9, 1, 2, 3],
        "spec_seqs": [0, 2],
    }
    x = {name: jnp.asarray(v, jnp.int32) for name, v in x.items()}
    history = np.zeros((4, 16), np.int32)
    history[2, : len(history_a)] = history_a
    history[1, :3] = [30, 31, 32]  # C: no suffix of its recurs
    block_table = jnp.asarray(np.arange(16, dtype=np.int32).reshape(4, 4) + 1)
    sampled = jnp.asarray(prev_sampled + [0] * (8 - len(prev_sampled)), jnp.int32)
    drafts = jnp.asarray(prev_drafts + [-1] * (8 - len(prev_drafts)), jnp.int32)
    return settle_and_draft(CFG, x, sampled, drafts, jnp.asarray(history), block_table)


def test_rejected_drafts_move_the_sequence_back_and_the_lookup_fills_the_slots():
    # A's previous step: drafts 5, 6, 7 at positions 7..9 after its token 4 at 6; the rows drew
    # 5 (accept), 9 (reject): it emitted 5, 9, so 9 is fed at position 8 (not 10).
    a = [4, 5, 9, 8, 7, 0, 4, 5]  # with 9 fed at 8, the suffix 4, 5, 9 recurs at 0: drafts 8, 7
    x, tokens, row_drafts, history = _step(a, [5, 9, 1, 2, 44], [5, 6, 7, -1, -1])
    np.testing.assert_array_equal(x["positions"][:6], [8, 9, 10, 5, 3, 4])
    np.testing.assert_array_equal(x["seq_lens"], [11, 6, 5, 0])
    np.testing.assert_array_equal(x["steps"], [5, 6, 7, 1, 2, 3])
    # slot 2's pages are 9..12: position p -> page block_table[2, p // 4] * 4 + p % 4
    np.testing.assert_array_equal(x["slot_mapping"][:3], [11 * 4 + 0, 11 * 4 + 1, 11 * 4 + 2])
    np.testing.assert_array_equal(x["slot_mapping"][3:6], [0, 0, 0])  # not moved: the host's
    # A: 9 fed, then the drafts after the first 4, 5, 9; C: 44 fed, a filler (no match)
    np.testing.assert_array_equal(tokens[:6], [9, 8, 7, 17, 44, FILLER])
    np.testing.assert_array_equal(row_drafts, [8, 7, -1, -1, V, -1])
    np.testing.assert_array_equal(history[2, :11], [4, 5, 9, 8, 7, 0, 4, 5, 9, 8, 7])
    np.testing.assert_array_equal(history[0, 5], 17)
    np.testing.assert_array_equal(history[1, 3:5], [44, FILLER])


def test_all_drafts_accepted_moves_nothing():
    a = [4, 5, 9, 8, 7, 0, 4, 5, 9, 8, 7]
    # drafts 5, 6, 7 all drawn, then the bonus 3: fed at position 10, as the host counted
    x, tokens, row_drafts, _ = _step(a, [5, 6, 7, 3, 44], [5, 6, 7, -1, -1])
    np.testing.assert_array_equal(x["positions"][:3], [10, 11, 12])
    np.testing.assert_array_equal(x["seq_lens"], [13, 6, 5, 0])
    np.testing.assert_array_equal(x["steps"], [7, 8, 9, 1, 2, 3])
    np.testing.assert_array_equal(x["slot_mapping"][:3], [0, 0, 0])  # the host's, kept
    assert int(tokens[0]) == 3
