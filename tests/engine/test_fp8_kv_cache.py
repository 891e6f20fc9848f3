"""--kv-cache-dtype fp8 end to end with the default model's real weights: the offline engine,
and scripts/fp8_kv_accuracy.py's comparison against the unquantized pool."""

import json
import pathlib
import subprocess
import sys

from jaxserve import LLM, SamplingParams
from pallas_kernels.kv_quant import QuantizedPages
from tests.conftest import SMALL_ENGINE, sharegpt_prompts
from tests.greedy import hf_greedy_margins

# FP8 moves this model's logits by ~0.2 on average (fp8_kv_accuracy.py; the first token, whose
# context is only the prompt, moves less than later ones), so a first token whose two best
# logits are further apart than this must stay the same (5 of these 8 prompts; the one that
# flips has a margin of 0.012).
CLEAR_MARGIN = 0.3


# The FP8 pool's programs are its own (no other test compiles them): fewer token buckets and
# samplers than SMALL_ENGINE's keep their compile short; the pool is SMALL_ENGINE's size.
FP8_LIMITS = dict(max_num_batched_tokens=32, max_num_seqs=8)


def test_fp8_kv_cache_in_the_engine(smollm_llm, hf_smollm):
    llm8 = LLM(log=lambda s: None, kv_cache_dtype="fp8", **SMALL_ENGINE | FP8_LIMITS)
    runner = llm8.engine.runner
    assert isinstance(runner.k_cache[0], QuantizedPages)
    # Same GiB: float32 rows take 4 D bytes, FP8 rows D + 4 (the scale).
    d = runner.config.head_dim
    ratio = llm8.engine.num_pages / smollm_llm.engine.num_pages
    assert abs(ratio - 4 * d / (d + 4)) < 0.01 * ratio

    prompts = sharegpt_prompts(8)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = llm8.generate(prompts, sp, use_tqdm=False)
    ref = smollm_llm.generate(prompts, sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in ours)
    clear = 0
    for o, r in zip(ours, ref):
        margin = hf_greedy_margins(hf_smollm, r.prompt_token_ids, r.outputs[0].token_ids[:1])[0]
        if margin > CLEAR_MARGIN:
            clear += 1
            assert o.outputs[0].token_ids[0] == r.outputs[0].token_ids[0], (margin, o, r)
    assert clear >= 3, f"only {clear} of {len(prompts)} prompts have a clear first token"


def test_fp8_accuracy_script(tmp_path):
    out = tmp_path / "fp8.json"
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "fp8_kv_accuracy.py"
    subprocess.run([sys.executable, str(script), "--num-prompts", "2", "--max-tokens", "4",
                    "--max-prompt-tokens", "120", "--json", str(out)], check=True, timeout=600)
    summary = json.loads(out.read_text())["summary"]
    assert summary["prompts"] == 2
    assert 0 < summary["mean_abs_logit_diff"] < 0.5
    assert summary["max_abs_logit_diff"] < 4
