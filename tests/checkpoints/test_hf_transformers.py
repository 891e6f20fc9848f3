"""The real proof of the GGUF conversion (dequantization, names, Q/K un-permutation, tokenizer,
chat template): HF transformers itself, loading our converted folder, answers correctly."""

import pytest

torch = pytest.importorskip("torch")


def test_transformers_generates_from_converted_folder(smollm_hf_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm_hf_folder))
    model = AutoModelForCausalLM.from_pretrained(str(smollm_hf_folder), dtype=torch.float32)
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
