"""scripts/bench_serving.py's ShareGPT sampling: vLLM's benchmark filter (prompt and answer at
least 4 tokens, a prompt at most 1,024, both at most 2,048 and at most max_model_len)."""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import bench_serving  # noqa: E402


class WordTokenizer:
    """One token per word (and none for BOS): lengths that are easy to read."""

    def encode(self, text, add_special_tokens=True):
        return text.split()


def _file(tmp_path, pairs):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": p},
                                                   {"from": "gpt", "value": a}]}
                                for p, a in pairs]))
    return path


def test_vllms_filter_and_every_passing_conversation(tmp_path):
    w = lambda n: " ".join(["w"] * n)  # noqa: E731
    pairs = [(w(10), w(10)),      # kept
             (w(3), w(10)),       # prompt too short
             (w(10), w(3)),       # answer too short
             (w(1025), w(10)),    # prompt over 1,024
             (w(1024), w(1024)),  # 2,048 in all: kept
             (w(1024), w(1025)),  # over 2,048
             (w(600), w(600))]    # kept, unless max_model_len is lower
    path = _file(tmp_path, pairs)
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    every = bench_serving.sharegpt_requests(None, path, WordTokenizer(), 32768, None, rng())
    assert sorted((r.prompt_len, r.output_len) for r in every) == [(10, 10), (600, 600),
                                                                   (1024, 1024)]
    small = bench_serving.sharegpt_requests(None, path, WordTokenizer(), 1500, None, rng())
    assert sorted(r.prompt_len for r in small) == [10, 600]
    loose = bench_serving.sharegpt_requests(None, path, WordTokenizer(), 32768, None, rng(),
                                            max_prompt_len=2000, max_total_len=4096)
    assert len(loose) == 5  # only the two short ones left out
    assert len(bench_serving.sharegpt_requests(2, path, WordTokenizer(), 32768, None, rng())) == 2
    with pytest.raises(SystemExit, match="only 3 of 7"):
        bench_serving.sharegpt_requests(4, path, WordTokenizer(), 32768, None, rng())


def test_zero_prompts_means_every_one_only_for_sharegpt():
    assert bench_serving.parse_args(["--dataset-name", "sharegpt", "--num-prompts", "0"])
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--num-prompts", "0"])
