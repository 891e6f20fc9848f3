"""Tiny random models of the newer families served through the OpenAI API: the prompt's
teacher-forced log-probabilities (completions ``echo`` with ``logprobs``) equal HF
transformers' float32 ones within 2e-3, over a prompt four times the sliding windows. Gemma 3
is served from a vision-language ``Gemma3ForConditionalGeneration`` checkpoint, text only."""

import numpy as np
import openai
import pytest
import torch
import transformers
from server_utils import Server

from tests.integration import tp_utils
from tests.tiny_models import TINY, TINY_CONFIGS, save_tiny_model

pytestmark = pytest.mark.slow

PROMPT_LEN = 200


def save_gemma3_vision_language(folder, tokenizer):
    """A tiny ``Gemma3ForConditionalGeneration`` (the tiny Gemma 3 text model, a one-layer
    SigLIP tower) saved in ``folder``; returns the HF model."""
    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=TINY_CONFIGS["gemma3"]().to_dict(),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, eos_token_id=2)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", ["gemma2", "gemma3_vision_language", "phi3", "qwen2_moe"])
def test_served_prompt_logprobs_match_hf(name, tmp_path, smollm):
    if name == "gemma3_vision_language":
        hf_model = save_gemma3_vision_language(tmp_path, smollm.tokenizer)
    else:
        hf_model = save_tiny_model(name, tmp_path, smollm.tokenizer)
    ids = np.random.default_rng(2).integers(3, TINY["vocab_size"], PROMPT_LEN).tolist()
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].double()
    ref = torch.log_softmax(logits, -1)[torch.arange(PROMPT_LEN - 1), ids[1:]].numpy()

    server = Server("--model", str(tmp_path), "--dtype", "float32", *tp_utils.TP_CLI_FLAGS)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(model=client.models.list().data[0].id, prompt=ids, max_tokens=1, echo=True,
                                        logprobs=0, temperature=0)
    finally:
        server.stop()
    served = out.choices[0].logprobs.token_logprobs[1:PROMPT_LEN]
    np.testing.assert_allclose(served, ref, atol=2e-3, rtol=0)
