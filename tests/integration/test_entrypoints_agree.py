"""The server, ``LLM`` and ``scripts/offline_batch.py`` turn the same prompt into the same token ids
and the same greedy text (they share one InputProcessor and one OutputProcessor), for the
default model and for an HF-folder Llama whose tokenizer adds a BOS; a chat prompt holds exactly
one BOS where the template writes one.

Each request runs alone in every path, with the same engine flags, so all three run the same
compiled step on the same inputs: the texts must be equal, not merely close. The server returns
its prompt ids (vLLM's ``return_token_ids``); the script's are seen through their count
(``prompt_tokens``), which a missing or doubled BOS would change."""

import json
import subprocess
import sys

import openai
import pytest
from server_utils import REPO, Server

from tests.conftest import SMALL_ENGINE, SMALL_ENGINE_FLAGS, sharegpt_prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
BOS = "<|endoftext|>"  # id 0 of the default model's vocabulary; the BOS of the test Llama
CHATML_WITH_BOS = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def bos_llama(tmp_path_factory, smollm):
    """A tiny random Llama HF folder whose tokenizer adds a BOS to every text it encodes with
    special tokens, and whose chat template writes the BOS itself (as Llama 3's does)."""
    import torch
    import transformers
    from tokenizers import processors

    from jaxserve.tokenizer_io import load_tokenizer, save_tokenizer

    folder = tmp_path_factory.mktemp("bos-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(smollm.tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, bos_token_id=0, eos_token_id=2, initializer_range=0.2)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    save_tokenizer(smollm.tokenizer, folder)
    tok = load_tokenizer(folder)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 0)])
    tok.bos_token = BOS
    tok.chat_template = CHATML_WITH_BOS
    save_tokenizer(tok, folder)
    return str(folder)


def offline_batch(tmp_path, model: str | None, line: dict) -> dict:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(line) + "\n")
    model_flags = ["--model", model] if model else []
    proc = subprocess.run(
        [sys.executable, "scripts/offline_batch.py", "--input", str(inp), "--output", str(out),
         *model_flags, *SMALL_ENGINE_FLAGS],
        capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(x) for x in out.read_text().splitlines()]
    return row


@pytest.mark.parametrize("model", ["default", "bos-llama"])
def test_server_llm_and_offline_batch_agree(model, bos_llama, tmp_path, request):
    from jaxserve import LLM, SamplingParams

    path = bos_llama if model == "bos-llama" else None
    prompt = sharegpt_prompts(1, max_chars=300, skip=40)[0]
    messages = [{"role": "user", "content": sharegpt_prompts(1, max_chars=300, skip=41)[0]}]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

    # The default model's offline engine is the engine tests' (the same limits).
    llm = (request.getfixturevalue("smollm_llm") if path is None
           else LLM(path, log=lambda s: None, **SMALL_ENGINE))
    (by_llm,) = llm.generate([prompt], sp, use_tqdm=False)
    (chat_by_llm,) = llm.chat([messages], sp, use_tqdm=False)
    tok = llm.tokenizer
    del llm

    # The tokenization rule itself: a BOS where the tokenizer adds one, never two in a chat.
    bos_id = tok.convert_tokens_to_ids(BOS)
    if model == "bos-llama":
        assert by_llm.prompt_token_ids[0] == bos_id and by_llm.prompt_token_ids[1] != bos_id
        assert by_llm.prompt_token_ids[1:] == tok.encode(prompt, add_special_tokens=False)
        assert chat_by_llm.prompt_token_ids[0] == bos_id
        assert chat_by_llm.prompt_token_ids.count(bos_id) == 1
    else:
        assert by_llm.prompt_token_ids == tok.encode(prompt, add_special_tokens=False)
        assert bos_id not in chat_by_llm.prompt_token_ids

    line = {"max_tokens": MAX_TOKENS, "temperature": 0}
    by_script = offline_batch(tmp_path, path, {**line, "prompt": prompt})
    chat_by_script = offline_batch(tmp_path, path, {**line, "messages": messages})

    server = Server(*(["--model", path] if path else []), *SMALL_ENGINE_FLAGS)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               timeout=300)
        name = client.models.list().data[0].id
        by_server = client.completions.create(
            model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True})
        chat_by_server = client.chat.completions.create(
            model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True})
    finally:
        server.stop()

    assert by_server.choices[0].prompt_token_ids == by_llm.prompt_token_ids
    assert chat_by_server.prompt_token_ids == chat_by_llm.prompt_token_ids
    assert by_script["prompt_tokens"] == len(by_llm.prompt_token_ids)
    assert chat_by_script["prompt_tokens"] == len(chat_by_llm.prompt_token_ids)
    text, chat_text = by_llm.outputs[0].text, chat_by_llm.outputs[0].text
    assert by_script["text"] == by_server.choices[0].text == text
    assert chat_by_script["text"] == chat_by_server.choices[0].message.content == chat_text
    assert len(by_llm.outputs[0].token_ids) == by_server.usage.completion_tokens
    assert by_script["completion_tokens"] == by_server.usage.completion_tokens
