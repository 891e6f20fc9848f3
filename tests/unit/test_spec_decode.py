"""Speculative decoding's parts against their definitions (docs/spec_decode.md): the config's
checks, the n-gram proposer on hand-made sequences, and the rejection sampler: greedy rows
exact, and sampled rows (temperature, top-k, top-p, penalties) emitting the target
distribution after accepted and after rejected drafts (a chi-square test)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.spec_decode.config import SpeculativeConfig, parse_speculative_config
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import sliding_window_view

from jaxserve.spec_decode.ngram_proposer import propose_on_device
from jaxserve.spec_decode.rejection_sampler import emitted_rows
from jaxserve.worker.sampler import init_state, sample_draft, sample_filtered, sample_unfiltered
from jaxserve.worker.sampling_fields import FilterMetadata, SamplingMetadata, neutral


def test_config_defaults_follow_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)


@pytest.mark.parametrize("d, method, model", [
    ({"method": "[ngram]"}, "ngram", None),
    ({"model": "ngram"}, "ngram", None),
    ({"method": "ngram", "model": "[ngram]"}, "ngram", None),
    ({"model": "/ckpt/SmolLM2-135M"}, "draft_model", "/ckpt/SmolLM2-135M"),
    ({"model": "/heads/EAGLE-LLaMA3.1-Instruct-8B"}, "eagle", "/heads/EAGLE-LLaMA3.1-Instruct-8B"),
    ({"model": "/heads/sglang-EAGLE3-Llama-3.1-8B"}, "eagle3", "/heads/sglang-EAGLE3-Llama-3.1-8B"),
])
def test_config_infers_the_method_as_vllm(d, method, model):
    c = SpeculativeConfig.from_dict({**d, "num_speculative_tokens": 2})
    assert (c.method, c.model) == (method, model)


@pytest.mark.parametrize("d, field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "medusa"),
    ({"method": "mtp", "num_speculative_tokens": 2}, "not built"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "model"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": 3}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "ngrams", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 2}, "'k'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -3},
     "^prompt_lookup_max must be an integer >= 1, got -3$"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": -3},
     "^prompt_lookup_min must be an integer >= 1, got -3$"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "4"},
     "^prompt_lookup_max must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "^disable_by_batch_size must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0},
     "^draft_tensor_parallel_size must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 0},
     "^max_model_len must be"),
    ({"method": "suffix", "num_speculative_tokens": 2}, "'suffix' is not built"),
    ({"method": "mlp_speculator", "model": "m", "num_speculative_tokens": 2},
     "'mlp_speculator' is not built"),
])
def test_config_errors_name_the_field(d, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(d)


def test_config_takes_a_large_prompt_lookup_max():
    # vLLM accepts any value; the lookup's program does not grow with it (see the lookup tests)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 1000, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 1000)


def test_disable_by_batch_size_null_is_never():
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert SpeculativeConfig.from_dict(ngram).disable_by_batch_size == 16  # jaxserve's default
    c = SpeculativeConfig.from_dict({**ngram, "disable_by_batch_size": None})
    assert c.disable_by_batch_size is None


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
DRAFT = {"method": "draft_model", "model": "m", "num_speculative_tokens": 3}


@pytest.mark.parametrize("base, extra", [
    (NGRAM, {"enforce_eager": None}), (DRAFT, {"enforce_eager": False}),
    (DRAFT, {"tensor_parallel_size": None}),
    (DRAFT, {"quantization": None, "revision": None, "code_revision": None,
             "draft_load_config": None}),
    (DRAFT, {"disable_padded_drafter_batch": False, "parallel_drafting": False}),
    (NGRAM, {"speculative_token_tree": None}),
    (DRAFT, {"speculative_token_tree": "[(0,), (0, 0), (0, 0, 0)]"}),
    (DRAFT, {"speculative_token_tree": "[(0, 0), (0,), (0, 0, 0)]"}),  # any order
    (NGRAM, {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 0,
             "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}),
    (NGRAM, {"draft_tensor_parallel_size": None, "max_model_len": None,
             "prompt_lookup_max": None, "prompt_lookup_min": None, "model": None}),
])
def test_config_accepts_vllms_fields_at_what_runs(base, extra):
    c = SpeculativeConfig.from_dict({**base, **extra})
    assert c == SpeculativeConfig.from_dict(base)


@pytest.mark.parametrize("base, extra, message", [
    (DRAFT, {"enforce_eager": True}, "^enforce_eager must be null or false .*, got true$"),
    (DRAFT, {"tensor_parallel_size": 1}, "^tensor_parallel_size must be null .*"
                                         "draft_tensor_parallel_size.*, got 1$"),
    (DRAFT, {"quantization": "fp8"}, '^quantization must be null .*, got "fp8"$'),
    (DRAFT, {"revision": "main"}, "^revision must be null"),
    (DRAFT, {"code_revision": "main"}, "^code_revision must be null"),
    (DRAFT, {"draft_load_config": {"load_format": "dummy"}}, "^draft_load_config must be null"),
    (DRAFT, {"disable_padded_drafter_batch": True}, "^disable_padded_drafter_batch must be false"),
    (DRAFT, {"disable_padded_drafter_batch": 0}, "^disable_padded_drafter_batch must be false"),
    (DRAFT, {"parallel_drafting": True}, "^parallel_drafting must be false"),
    (DRAFT, {"speculative_token_tree": "[(0,), (1,), (0, 0)]"},
     r"^speculative_token_tree must be null or '\[\(0,\), \(0, 0\), \(0, 0, 0\)\]'"),
    (DRAFT, {"speculative_token_tree": "[(0,), (0, 0)]"}, "^speculative_token_tree must be"),
    (DRAFT, {"speculative_token_tree": "not a tree"}, "^speculative_token_tree must be"),
    (DRAFT, {"speculative_token_tree": 3}, "^speculative_token_tree must be"),
    (NGRAM, {"suffix_decoding_max_tree_depth": "24"}, "^suffix_decoding_max_tree_depth must be"),
    (NGRAM, {"suffix_decoding_min_token_prob": True}, "^suffix_decoding_min_token_prob must be"),
    (NGRAM, {"target_model_config": {}}, "unknown field 'target_model_config'"),
])
def test_config_refuses_vllms_fields_at_what_does_not_run(base, extra, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict({**base, **extra})


def test_check_engine_takes_vllms_draft_tensor_parallel_rule_and_the_max_model_len():
    for tp in (None, 1, 4):
        c = SpeculativeConfig.from_dict({**NGRAM, "draft_tensor_parallel_size": tp})
        c.check_engine(4, None)
    c = SpeculativeConfig.from_dict({**NGRAM, "draft_tensor_parallel_size": 2})
    with pytest.raises(ValueError, match=r"^draft_tensor_parallel_size must be 1 or "
                                         r"--tensor-parallel-size \(4\), got 2$"):
        c.check_engine(4, None)
    c = SpeculativeConfig.from_dict({**DRAFT, "max_model_len": 512})
    c.check_engine(1, None)  # --max-model-len not known yet
    c.check_engine(1, 512)
    with pytest.raises(ValueError, match=r"^max_model_len must be --max-model-len \(1024\) or "
                                         r"null .*, got 512$"):
        c.check_engine(1, 1024)


SERVE_BAD = [
    ({**NGRAM, "prompt_lookup_max": -3}, [], "prompt_lookup_max must be an integer >= 1, got -3"),
    ({**NGRAM, "disable_by_batch_size": "none"}, [], "disable_by_batch_size must be"),
    ({**NGRAM, "draft_tensor_parallel_size": 2}, [], "draft_tensor_parallel_size must be 1 or "
                                                     "--tensor-parallel-size (1), got 2"),
    ({**NGRAM, "max_model_len": 512}, ["--max-model-len", "1024"], "max_model_len must be "
                                                                   "--max-model-len (1024)"),
    ({**NGRAM, "tensor_parallel_size": 1}, [], "tensor_parallel_size must be null"),
    ({**DRAFT, "speculative_token_tree": "[(0,), (1,)]"}, [], "speculative_token_tree must be"),
]


@pytest.mark.parametrize("spec, flags, message", SERVE_BAD)
def test_server_bad_speculative_config_is_one_line_exit_2(spec, flags, message, capsys):
    from jaxserve import serve

    assert serve.main(["--speculative-config", json.dumps(spec), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "--speculative-config" in err and message in err, err


@pytest.mark.parametrize("spec, flags", [
    ({**NGRAM, "prompt_lookup_max": 1000, "prompt_lookup_min": 2}, ["--max-model-len", "1024"]),
    ({**NGRAM, "disable_by_batch_size": None}, []),
    ({**NGRAM, "draft_tensor_parallel_size": 1, "max_model_len": 1024},
     ["--max-model-len", "1024"]),
    ({**NGRAM, "draft_tensor_parallel_size": 2}, ["--tensor-parallel-size", "2"]),
])
def test_server_parses_vllms_speculative_configs(spec, flags):
    from jaxserve import serve
    from jaxserve.engine.arg_utils import from_cli_args

    args = serve.parse_args(["--speculative-config", json.dumps(spec), *flags])
    assert from_cli_args(args).speculative_config == spec


def test_parse_rejects_bad_json():
    with pytest.raises(ValueError, match="not JSON"):
        parse_speculative_config("{method: ngram}")


def reference_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """vLLM V1's n-gram lookup, one sequence in numpy: the longest suffix of min_n..max_n
    tokens that recurs in token_ids[:-1], the up to k tokens after its first occurrence."""
    a = np.asarray(token_ids, np.int32)
    for n in range(min(max_n, len(a) - 1), min_n - 1, -1):
        hits = np.flatnonzero((sliding_window_view(a[:-1], n) == a[-n:]).all(axis=1))
        if len(hits):
            return a[hits[0] + n : hits[0] + n + k].tolist()
    return []


def ngram(token_ids: list[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """``propose_on_device`` of one sequence (junk past its length), as a list."""
    history = np.full((1, 32), 9, np.int32)
    history[0, : len(token_ids)] = token_ids
    drafts, counts = propose_on_device(jnp.asarray(history), jnp.asarray([len(token_ids)]),
                                       k, min_n, max_n)
    assert drafts[0, int(counts[0]):].tolist() == [-1] * (k - int(counts[0]))
    return drafts[0, : int(counts[0])].tolist()


def test_ngram_lookup_past_the_rows_width():
    # prompt_lookup_max above any suffix's length: the longest match of the row wins
    assert ngram([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3], 3, min_n=2, max_n=1000) == [4, 5, 9]
    assert ngram([4, 4, 4, 4], 2, min_n=1, max_n=1000) == [4]


def test_ngram_lookup_program_does_not_grow_with_prompt_lookup_max():
    """The lookup compares every window with every suffix length at once: its program (and so
    its compile time) is the same at prompt_lookup_max 4 and 1000 (the runaway start-up of an
    unrolled loop over the lengths)."""
    history, lengths = jnp.zeros((4, 2048), jnp.int32), jnp.zeros(4, jnp.int32)

    def ops(max_n):
        text = jax.jit(propose_on_device, static_argnums=(2, 3, 4)).lower(
            history, lengths, 3, 2, max_n).as_text()
        return sum(" = " in line for line in text.splitlines())

    assert ops(1000) == ops(4)


def test_ngram_lookup():
    # the longest recurring suffix wins: [2, 3] recurs after 1 and after 9; [1, 2, 3] after 1
    assert ngram([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3], 3) == [4, 5, 9]
    assert ngram([9, 2, 3, 7, 1, 2, 3, 8, 2, 3], 2) == [7, 1]  # first occurrence
    assert ngram([1, 2, 3, 4, 1, 2], 5) == [3, 4, 1, 2]  # fewer near the end
    assert ngram([1, 2, 3, 4, 5, 6, 5], 3) == []  # a 1-token suffix is below min
    assert ngram([4, 4, 4], 2) == [4]
    assert ngram([1], 3) == []
    assert ngram([], 3) == []


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=6),
       st.integers(1, 6), st.integers(1, 3), st.integers(0, 3) | st.integers(40, 100))
def test_ngram_lookup_equals_the_reference(seqs, k, min_n, extra):
    max_n = min_n + extra  # up to past the rows' width (48)
    history = np.full((len(seqs), 48), 7, np.int32)  # 7: junk past each row's length
    for r, seq in enumerate(seqs):
        history[r, : len(seq)] = seq
    lengths = np.array([len(seq) for seq in seqs], np.int32)
    drafts, counts = propose_on_device(jnp.asarray(history), jnp.asarray(lengths), k, min_n,
                                       max_n)
    for r, seq in enumerate(seqs):
        want = reference_ngram(seq, k, min_n, max_n)
        assert int(counts[r]) == len(want)
        assert drafts[r].tolist() == want + [-1] * (k - len(want))


def test_emitted_rows():
    # sequence 0: drafts 5, 6 (rows 0-2); sequence 1: no drafts (row 3); sequence 2: draft 8
    draft_ids = np.array([5, 6, -1, -1, 8, -1])
    seq_start = np.array([0, 0, 0, 3, 4, 4])
    tokens = np.array([5, 7, 1, 2, 8, 3])  # accepts 5, rejects 6; accepts 8, bonus 3
    assert emitted_rows(tokens, draft_ids, seq_start).tolist() == [1, 1, 0, 1, 1, 1]
    tokens = np.array([4, 6, 1, 2, 9, 3])  # rejects both first drafts
    assert emitted_rows(tokens, draft_ids, seq_start).tolist() == [1, 0, 0, 1, 1, 0]
    assert np.array_equal(emitted_rows(jnp.asarray(tokens), jnp.asarray(draft_ids),
                                       jnp.asarray(seq_start)),
                          emitted_rows(tokens, draft_ids, seq_start))


def test_greedy_accepts_while_argmax_equals_draft():
    logits = jnp.asarray(np.eye(6, dtype=np.float32)[[2, 4, 1, 3]] * 5)  # argmax 2, 4, 1, 3
    sm = neutral(SamplingMetadata, 4)
    tokens = np.asarray(sample_unfiltered(logits, sm, branch_free=False))
    for drafts, emitted in (([2, 4, 1], [2, 4, 1, 3]), ([2, 5, 1], [2, 4]), ([0, 4, 1], [2])):
        rows = emitted_rows(tokens, np.array(drafts + [-1]), np.zeros(4, np.int32))
        assert tokens[rows].tolist() == emitted


V, K_DRAFTS = 8, 2
LOGITS = np.array([[2.0, 1.6, 1.2, 0.9, 0.5, 0.2, -0.5, -1.0],
                   [0.3, 1.8, 1.5, 1.0, 0.8, 0.4, 0.0, -0.2],
                   [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]], np.float32)
DRAFTS = [0, 2]  # row 0's most likely token (accepted often, rejected often), then row 1's
TEMPERATURE, TOP_K, TOP_P = 0.9, 6, 0.95
PRESENCE, FREQUENCY, REPETITION = 0.4, 0.2, 1.3
OUTPUT_COUNTS = np.array([0, 2, 0, 1, 0, 0, 0, 0])
PROMPT_TOKENS = [3, 4]
ALPHA = 0.01 / 3  # three tests, one family at false-alarm rate 0.01
TV = 0.05


def target(row: int, drafts_counted: bool = True) -> np.ndarray:
    """The distribution of row ``row``'s token by the definitions of the processors (vLLM's
    penalties, temperature, top-k, then top-p), given drafts DRAFTS[:row] were accepted (and
    count as outputs, unless not ``drafts_counted``)."""
    counts = OUTPUT_COUNTS.copy()
    for d in DRAFTS[:row] if drafts_counted else ():
        counts[d] += 1
    x = LOGITS[row].astype(np.float64)
    seen = (counts > 0) | np.isin(np.arange(V), PROMPT_TOKENS)
    x = np.where(seen, np.where(x > 0, x / REPETITION, x * REPETITION), x)
    return processed(x - FREQUENCY * counts - PRESENCE * (counts > 0))


def processed(x: np.ndarray) -> np.ndarray:
    """The distribution of logits x under TEMPERATURE, TOP_K, then TOP_P."""
    x = x.astype(np.float64) / TEMPERATURE
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(V, bool)
    keep[order[:TOP_K]] = True
    p = np.where(keep, np.exp(x - x.max()), 0)
    p /= p.sum()
    ps = p[order]
    kept = (np.cumsum(ps) - ps) < TOP_P
    p2 = np.zeros(V)
    p2[order[kept]] = ps[kept]
    return p2 / p2.sum()


def trials_needed(df: int) -> int:
    """Trials for a chi-square goodness-of-fit test at false-alarm ALPHA to have power 0.9
    against every distribution at total variation TV: such a distribution's noncentrality per
    trial sum (q - p)^2 / p is at least 4 TV^2 (the mass moved is TV, out of a set and into
    its complement, whose probabilities add up to at most 1)."""
    crit = stats.chi2.ppf(1 - ALPHA, df)
    n = 100
    while stats.ncx2.sf(crit, df, n * 4 * TV**2) < 0.9:
        n += 100
    return n


def chi_square_p(samples: np.ndarray, p: np.ndarray) -> float:
    """p-value of ``samples`` (token ids) drawn from p (no token outside p's support)."""
    support = p > 0
    assert support[samples].all(), "a token outside the target's support"
    observed = np.bincount(samples, minlength=V)[support]
    return stats.chisquare(observed, len(samples) * p[support]).pvalue


# A draft model's sampled drafts (a real q): the draft's logits, a distribution far from the
# target's (TV > 0.3), so that drafts are rejected often. An EAGLE-3 head's logits are -inf
# outside its draft vocabulary (eagle.forward): there q is 0 and only the residual draws.
DRAFT_LOGITS = {
    "draft_model": np.array([0.0, 2.2, 0.3, 1.9, -0.4, 1.0, 0.2, 0.1], np.float32),
    "eagle3": np.array([-np.inf, 2.2, -np.inf, 1.9, -0.4, 1.0, 0.2, -np.inf], np.float32)}
ALPHA_Q = 0.01 / 3  # the three tests of real-q drafts, a family at false-alarm rate 0.01


@pytest.fixture(scope="module", params=list(DRAFT_LOGITS))
def draft_model_draws(request):
    """(draft logits, drafts, tokens): N trials of one verified row each, the draft d drawn by
    sample_draft from the method's DRAFT_LOGITS (trial's seed, step 0), the row drawn by
    sample_filtered against the q it returned (target LOGITS[0], no penalties)."""
    draft_logits = DRAFT_LOGITS[request.param]
    n = 12000
    sm = neutral(SamplingMetadata, n, temperature=np.full(n, TEMPERATURE, np.float32),
                 top_k=np.full(n, TOP_K, np.int32), top_p=np.full(n, TOP_P, np.float32),
                 seeds=np.arange(n, dtype=np.uint32))

    @jax.jit
    def run(draft_logits, logits, sm):
        drafts, q = sample_draft(draft_logits, sm)
        fm = neutral(FilterMetadata, n, rows=jnp.ones(n, bool), draft_ids=drafts,
                     draft_prob_rows=jnp.arange(n, dtype=jnp.int32))
        tokens = sample_filtered(logits, jnp.zeros(n, jnp.int32), sm, fm, draft_probs=q)[0]
        return drafts, tokens

    drafts, tokens = run(jnp.asarray(np.tile(draft_logits, (n, 1))),
                         jnp.asarray(np.tile(LOGITS[0], (n, 1))), sm)
    return draft_logits, np.asarray(drafts), np.asarray(tokens)


def test_draft_model_drafts_follow_q(draft_model_draws):
    draft_logits, drafts, _ = draft_model_draws
    q = processed(draft_logits)
    assert len(drafts) >= trials_needed(int((q > 0).sum()) - 1)
    assert chi_square_p(drafts, q) > ALPHA_Q


def test_draft_model_verified_token_has_the_target_distribution(draft_model_draws):
    """Accepted (x == d) or not, the emitted token follows p: speculative sampling with q."""
    draft_logits, drafts, tokens = draft_model_draws
    p, q = processed(LOGITS[0]), processed(draft_logits)
    assert np.abs(p - q).sum() / 2 > 0.3
    accept = np.minimum(1, p[drafts] / q[drafts])
    assert abs((tokens == drafts).mean() - accept.mean()) < 4 * np.sqrt(0.25 / len(drafts))
    assert chi_square_p(tokens, p) > ALPHA_Q


def test_draft_model_rejected_token_has_the_residual_distribution(draft_model_draws):
    draft_logits, drafts, tokens = draft_model_draws
    p, q = processed(LOGITS[0]), processed(draft_logits)
    rejected = tokens != drafts
    residual = np.maximum(p - q, 0)
    residual /= residual.sum()
    assert rejected.sum() >= trials_needed(int((residual > 0).sum()) - 1)
    assert chi_square_p(tokens[rejected], residual) > ALPHA_Q


@pytest.fixture(scope="module")
def draws():
    """Token rows of N trials of one sequence with drafts DRAFTS: 3 rows each, every row drawn
    with its own key (seed = the trial, step = the row), in one jitted call of the sampler."""
    n = 8000
    rows = n * (K_DRAFTS + 1)
    r = np.arange(rows) % (K_DRAFTS + 1)
    sm = neutral(SamplingMetadata, rows, temperature=np.full(rows, TEMPERATURE, np.float32),
                 top_k=np.full(rows, TOP_K, np.int32), top_p=np.full(rows, TOP_P, np.float32),
                 seeds=(np.arange(rows) // (K_DRAFTS + 1)).astype(np.uint32),
                 steps=r.astype(np.int32))
    fm = neutral(FilterMetadata, rows, rows=np.ones(rows, bool),
                 presence_penalty=np.full(rows, PRESENCE, np.float32),
                 frequency_penalty=np.full(rows, FREQUENCY, np.float32),
                 repetition_penalty=np.full(rows, REPETITION, np.float32),
                 draft_ids=np.where(r < K_DRAFTS, np.array(DRAFTS + [-1])[r], -1).astype(np.int32),
                 seq_start=(np.arange(rows) - r).astype(np.int32))
    state = init_state(1, V, 1, 1)
    state = type(state)(jnp.asarray(OUTPUT_COUNTS[None], jnp.int32),
                        state.prompt_mask.at[0, jnp.asarray(PROMPT_TOKENS)].set(True),
                        state.bias_ids, state.bias_values, state.stop_ids)
    logits = jnp.asarray(np.tile(LOGITS, (n, 1)))
    run = jax.jit(lambda lg, sm, fm, st: sample_filtered(lg, jnp.zeros(rows, jnp.int32), sm, fm,
                                                         st, None, K_DRAFTS)[0])
    tokens = np.asarray(run(logits, sm, fm, state))
    emitted = emitted_rows(tokens, np.asarray(fm.draft_ids), np.asarray(fm.seq_start))
    return tokens.reshape(n, -1), emitted.reshape(n, -1)


def test_first_token_has_the_target_distribution(draws):
    tokens, emitted = draws
    assert emitted[:, 0].all()
    assert len(tokens) >= trials_needed(int((target(0) > 0).sum()) - 1)
    assert chi_square_p(tokens[:, 0], target(0)) > ALPHA


def test_token_after_a_rejected_draft_has_the_residual_distribution(draws):
    """A rejected draft d is replaced by a draw from norm(max(p - onehot(d), 0))."""
    tokens, _ = draws
    rejected = tokens[:, 0] != DRAFTS[0]
    residual = target(0).copy()
    residual[DRAFTS[0]] = 0
    residual /= residual.sum()
    assert rejected.sum() >= trials_needed(int((residual > 0).sum()) - 1)
    assert chi_square_p(tokens[rejected, 0], residual) > ALPHA


def test_token_after_an_accepted_draft_has_the_target_distribution(draws):
    """The row after an accepted draft follows p given the draft (its penalties count it)."""
    tokens, emitted = draws
    accepted = tokens[:, 0] == DRAFTS[0]
    assert np.array_equal(accepted, emitted[:, 1])
    assert accepted.sum() >= trials_needed(int((target(1) > 0).sum()) - 1)
    assert chi_square_p(tokens[accepted, 1], target(1)) > ALPHA
    # the draft's penalty matters: without it the test would see another distribution
    assert np.abs(target(1) - target(1, drafts_counted=False)).sum() / 2 > TV


def test_penalized_rows_count_emitted_tokens_only():
    """The filtered sampler adds a penalized sequence's emitted tokens to its counts, not the
    tokens of rows after a rejected draft."""
    logits = jnp.asarray(np.eye(V, dtype=np.float32)[[1, 5, 6]] * 9)  # greedy: 1, 5, 6
    sm = neutral(SamplingMetadata, 3)
    fm = neutral(FilterMetadata, 3, rows=np.ones(3, bool), count=np.ones(3, bool),
                 presence_penalty=np.full(3, 0.1, np.float32),
                 draft_ids=np.array([1, 4, -1], np.int32))  # accepts 1, rejects 4 (draws 5)
    run = jax.jit(lambda lg, sm, fm, st: sample_filtered(lg, jnp.zeros(3, jnp.int32), sm, fm,
                                                         st, None, 2)[:2])
    tokens, state = run(logits, sm, fm, init_state(1, V, 1, 1))
    assert np.asarray(tokens).tolist() == [1, 5, 6]
    assert np.asarray(state.output_counts[0]).tolist() == [0, 1, 0, 0, 0, 1, 0, 0]


def _scheduler(**spec):
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.scheduler import Scheduler

    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 2, **spec})
    return Scheduler(KVCacheManager(64, 4, True), max_num_seqs=4, max_num_batched_tokens=32,
                     max_model_len=64, eos_token_ids=(0,), spec_config=config)


def _step(s, sampled, accepted, drafts=None):
    """Schedule a step and apply its output: ``sampled`` / ``accepted`` / the draft model's
    ``drafts`` by request id."""
    from jaxserve.core.scheduler_output import ModelRunnerOutput

    out = s.schedule()
    return out, s.update(out, ModelRunnerOutput(sampled, {}, {}, accepted, drafts or {}))


def test_scheduler_takes_the_draft_models_drafts_with_lookahead_pages():
    from tests.unit.kv_fakes import make_request

    config = SpeculativeConfig.from_dict({"method": "draft_model", "model": "m",
                                          "num_speculative_tokens": 3})
    s = _scheduler()
    s.spec_config, s.drafts_on_device = config, False  # as a draft_model scheduler is built
    req = make_request("a", [5, 6, 7, 8, 9], max_tokens=10)
    s.add_request(req)
    out, _ = _step(s, {"a": 7}, {}, {"a": [1, 2, 3]})  # the prompt, then drafts after 7
    assert out.propose_drafts and not out.scheduled_spec_decode_tokens
    # 5 prompt positions, the new token's and 2 more drafts' K/V: 8 positions, 2 pages of 4
    assert len(req.block_ids) == 2
    out, _ = _step(s, {"a": 4}, {"a": [1]}, {"a": [2, 2, 2]})  # accepts 1, draws 4
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert req.num_computed_tokens == 7 and len(req.block_ids) == 3  # through position 11
    out, _ = _step(s, {"a": 9}, {})  # drafts after 4 taken; no new drafts given
    assert out.scheduled_spec_decode_tokens == {"a": [2, 2, 2]}
    out, _ = _step(s, {"a": 9}, {})
    assert not out.scheduled_spec_decode_tokens  # none proposed after the last step


def test_scheduler_drafts_takes_accepted_and_rolls_back_rejected():
    from tests.unit.kv_fakes import make_request

    s = _scheduler()
    req = make_request("a", [5, 6, 7, 8, 9, 5, 6], max_tokens=10)
    s.add_request(req)
    out, _ = _step(s, {"a": 7}, {})  # the prompt; tokens now ... 5, 6, 7
    assert not out.scheduled_spec_decode_tokens
    out, outputs = _step(s, {"a": 3}, {"a": [8]})  # 3 slots the step fills: accepts 8, draws 3
    assert out.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    assert out.num_scheduled_tokens == {"a": 4}
    assert outputs[0].new_token_ids == [8, 3]
    assert req.num_tokens == 10 and req.num_computed_tokens == 9  # 2 drafts taken back
    # prefix caching registered the 2 full pages of computed, accepted tokens, not the drafts'
    assert req.num_registered_pages == 2
    stats = s.get_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            stats.num_accepted_tokens_per_pos) == (1, 3, 1, [1, 0, 0])


def test_scheduler_counts_only_proposed_drafts():
    from jaxserve.core.scheduler_output import ModelRunnerOutput
    from tests.unit.kv_fakes import make_request

    s = _scheduler()
    s.add_request(make_request("a", [5, 6, 7, 8], max_tokens=10))
    _step(s, {"a": 1}, {})
    out = s.schedule()  # 3 slots; the lookup filled 1 (rejected), none for the step after
    s.update(out, ModelRunnerOutput({"a": 2}, {}, {}, {}, {}, {"a": 1}))
    out = s.schedule()
    s.update(out, ModelRunnerOutput({"a": 2}, {}, {}, {}, {}, {"a": 0}))
    stats = s.get_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 1, 0)


def test_scheduler_schedules_past_a_verify_step_in_flight():
    """Async scheduling: the next step is scheduled before the verify step's tokens are known,
    as if all its drafts were accepted (positions and pages ahead of the true ones, which the
    step settles on the device); ``update`` then takes back what was rejected."""
    from tests.unit.kv_fakes import make_request

    s = _scheduler()
    req = make_request("a", [5, 6, 7, 8, 9, 5, 6], max_tokens=12)
    s.add_request(req)
    first = s.schedule()  # the prompt: 7 positions, a token in flight
    second = s.schedule()
    assert second.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    assert req.num_computed_tokens == 11 and req.num_output_placeholders == 1 + 4
    third = s.schedule()  # 3 more slots after the 4 tokens counted in flight
    assert third.num_scheduled_tokens == {"a": 4} and req.num_computed_tokens == 15
    assert len(req.block_ids) == 4  # pages through position 14 (page size 4)
    s.update(first, _output({"a": 7}))
    s.update(second, _output({"a": 3}, {"a": [8]}))  # accepted 1 of 3: 2 taken back
    assert req.num_tokens == 10 and req.num_computed_tokens == 13
    assert req.num_output_placeholders == 4
    # max_tokens 12 with 3 outputs and up to 4 in flight: at most 12 - 7 - 1 = 4 -> k 3
    assert s.schedule().scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    s.update(third, _output({"a": 4}, {"a": [5, 6, 7]}))  # all accepted: 7 outputs
    assert req.num_tokens == 14 and req.num_output_placeholders == 4
    # 7 outputs and up to 4 in flight: 11 of 12, so one token and no drafts
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1} and not out.scheduled_spec_decode_tokens


def _output(sampled, accepted=None):
    from jaxserve.core.scheduler_output import ModelRunnerOutput

    return ModelRunnerOutput(sampled, {}, {}, accepted or {}, {})


def test_scheduler_gives_no_drafts_short_of_min_tokens():
    from tests.unit.kv_fakes import make_request

    s = _scheduler()
    s.add_request(make_request("a", [1, 2, 3, 1, 2], max_tokens=10, min_tokens=3))
    _step(s, {"a": 3}, {})
    out, _ = _step(s, {"a": 4}, {})  # 1 output, min_tokens 3
    out, _ = _step(s, {"a": 5}, {})  # 2 outputs
    assert not out.scheduled_spec_decode_tokens
    out, _ = _step(s, {"a": 6}, {})  # 3 outputs
    assert out.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}


def test_scheduler_caps_drafts_and_stops_inside_them():
    from tests.unit.kv_fakes import make_request

    s = _scheduler()
    # max_tokens 3: after the first output, at most 3 - 1 - 1 = 1 draft
    req = make_request("a", [1, 2, 3, 1, 2], max_tokens=3)
    s.add_request(req)
    _step(s, {"a": 3}, {})
    out, outputs = _step(s, {"a": 9}, {"a": [1]})
    assert out.scheduled_spec_decode_tokens == {"a": [-1]}
    assert outputs[0].new_token_ids == [1, 9] and outputs[0].finish_reason == "length"
    # a stop token among the accepted drafts ends the request there
    s = _scheduler()
    req = make_request("b", [1, 2, 3, 4, 1, 2], max_tokens=10, stop_token_ids=[4])
    s.add_request(req)
    _step(s, {"b": 3}, {})
    out, outputs = _step(s, {"b": 2}, {"b": [4, 1]})
    assert out.scheduled_spec_decode_tokens == {"b": [-1, -1, -1]}
    assert outputs[0].new_token_ids == [4] and outputs[0].finish_reason == "stop"
    assert not s.has_unfinished_requests()


def test_scheduler_turns_speculation_off_by_batch_size():
    from tests.unit.kv_fakes import make_request

    s = _scheduler(disable_by_batch_size=1)
    for rid in "ab":
        s.add_request(make_request(rid, [1, 2, 3, 1, 2], max_tokens=10))
    assert not s.speculates()
    _step(s, {"a": 3, "b": 3}, {})
    out, _ = _step(s, {"a": 4, "b": 4}, {})
    assert not out.scheduled_spec_decode_tokens


def test_scheduler_speculates_at_any_batch_size_with_null_disable_by_batch_size():
    from tests.unit.kv_fakes import make_request

    s = _scheduler(disable_by_batch_size=None)
    for rid in "abcdef":  # more than max_num_seqs: some wait
        s.add_request(make_request(rid, [1, 2, 3, 1, 2], max_tokens=10))
    assert s.speculates()
