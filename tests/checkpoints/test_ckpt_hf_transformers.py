"""The real proof of the GGUF conversion (dequantization, names, Q/K un-permutation, tokenizer,
chat template): HF transformers itself, loading our converted folder, knows the answer."""

import pytest

torch = pytest.importorskip("torch")


def test_transformers_predicts_paris_from_converted_folder(smollm_hf_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm_hf_folder))
    model = AutoModelForCausalLM.from_pretrained(str(smollm_hf_folder), dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt + "The capital of France is")])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert tok.decode([int(logits.argmax())]) == " Paris"
