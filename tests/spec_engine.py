"""The speculative decoding tests' engine (offline and served alike, so the second start loads
its programs from the executable cache) and their requests."""

import json
import pathlib

SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
               "prompt_lookup_min": 2}
# Small, to compile few programs; a pool of 19 usable pages (0.72 MB each) for 4 sequences of
# ~100 tokens (7 pages) each, so that the batch preempts.
SPEC_ENGINE = dict(max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4,
                   kv_cache_gib=0.014)
SPEC_ENGINE_FLAGS = [x for k, v in SPEC_ENGINE.items()
                     for x in (f"--{k.replace('_', '-')}", str(v))] + [
    "--speculative-config", json.dumps(SPEC_CONFIG)]


def spec_prompts() -> list[str]:
    """The input-grounded requests of data/spec_decode_prompts.json (repeat, correct,
    summarise a paragraph)."""
    path = pathlib.Path(__file__).parents[1] / "data" / "spec_decode_prompts.json"
    return [r["prompt"] for r in json.loads(path.read_text())]


def top2_margin(position_logprobs: dict) -> float:
    """Gap between the two most likely tokens at a position (a logprobs=2 output): logit gaps
    equal log-probability gaps, so this is the near-tie rule's quantity."""
    best = sorted((lp.logprob for lp in position_logprobs.values()), reverse=True)
    return best[0] - best[1]
