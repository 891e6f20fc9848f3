"""FP8 end to end with the default model's real weights: the offline engine with FP8 weights
(``--quantization fp8``) and the FP8 KV cache together, as a GPU serves with both, and
scripts/fp8_accuracy.py's teacher-forced NLL against float32."""

import json
import pathlib
import subprocess
import sys

import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.models.linear import Fp8Weight
from pallas_kernels.kv_quant import QuantizedPages
from scripts.sharegpt import prompt_answer_pairs
from tests.conftest import SMALL_ENGINE, sharegpt_prompts

# The FP8 engine's programs are its own (no other test compiles them): fewer token buckets and
# samplers than SMALL_ENGINE's keep their compile short; the pool is SMALL_ENGINE's size.
FP8_LIMITS = dict(max_num_batched_tokens=32, max_num_seqs=8)


def answer_nll(llm, conversations) -> float:
    """Mean NLL (nats per token) of the answers, teacher-forced, from prompt log-probabilities."""
    tok = llm.tokenizer
    seqs = []
    for user, answer in conversations:
        prompt = tok.apply_chat_template([{"role": "user", "content": user}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        full = tok.apply_chat_template([{"role": "user", "content": user},
                                        {"role": "assistant", "content": answer}],
                                       tokenize=True, return_dict=False)[:192]
        seqs.append((full, len(prompt)))
    outs = llm.generate([ids for ids, _ in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    lps = [out.prompt_logprobs[i][ids[i]].logprob
           for out, (ids, start) in zip(outs, seqs) for i in range(start, len(ids))]
    return -float(np.mean(lps))


def test_fp8_weights_and_kv_cache_in_the_engine(smollm_llm):
    llm8 = LLM(log=lambda s: None, quantization="fp8", kv_cache_dtype="fp8",
               **SMALL_ENGINE | FP8_LIMITS)
    runner = llm8.engine.runner
    assert isinstance(runner.k_cache, QuantizedPages)  # stacked by layer on the CPU
    assert all(isinstance(layer[name], Fp8Weight) for layer in runner.params["layers"]
               for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    # Same GiB: float32 rows take 4 D bytes, FP8 rows D + 4 (the scale).
    d = runner.config.head_dim
    ratio = llm8.engine.num_pages / smollm_llm.engine.num_pages
    assert abs(ratio - 4 * d / (d + 4)) < 0.01 * ratio

    outs = llm8.generate(sharegpt_prompts(8), SamplingParams(temperature=0, max_tokens=16,
                                                             ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 and o.outputs[0].text for o in outs)

    # Judged by the NLL of real answers, teacher-forced (FP8 weights move this model's logits by
    # tenths: greedy tokens part at ties far wider than float rounding's): FP8's extra over
    # float32 is small (the accuracy script measures it on 100 conversations,
    # docs/performance.md).
    conversations = prompt_answer_pairs()[:3]
    extra = answer_nll(llm8, conversations) - answer_nll(smollm_llm, conversations)
    assert abs(extra) < 0.1, extra


def test_fp8_accuracy_script(tmp_path):
    out = tmp_path / "fp8.json"
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "fp8_accuracy.py"
    subprocess.run([sys.executable, str(script), "--num-conversations", "2", "--max-len", "80",
                    "--variants", "float32,fp8-kv", "--json", str(out)], check=True, timeout=600)
    rows = json.loads(out.read_text())["variants"]
    assert set(rows) == {"float32", "fp8-kv"}
    assert all(r["conversations"] == 2 and r["tokens"] > 0 for r in rows.values())
    assert 0.5 < rows["float32"]["nll"] < 6
    assert abs(rows["fp8-kv"]["extra_nll"]) < 0.1
