"""The SmolLM2 tokenizer built from GGUF metadata."""

import pytest

TEXTS = ["Hello world", "Héllo 世界 🤗 emoji 👨‍👩‍👧 and CJK: 東京タワー, 한국어", "  leading spaces\n\n\ttabs  ",
         "numbers 2024 and 3.14159", "<|im_start|>user\nHi<|im_end|>", "naïve café — “quotes”"]


def test_is_fast_tokenizer_with_specials(smollm):
    from transformers import PreTrainedTokenizerFast

    tok = smollm.tokenizer
    assert isinstance(tok, PreTrainedTokenizerFast) and len(tok) == 49152
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]


def test_hello_world_ids_no_bos(smollm):
    tok = smollm.tokenizer
    ids = tok("Hello world").input_ids
    assert ids == [19556, 905]
    assert ids == tok.backend_tokenizer.encode("Hello world", add_special_tokens=False).ids
    assert tok.encode("Hello world", add_special_tokens=True) == ids  # gpt2-type GGUF: no BOS added


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(smollm, text):
    tok = smollm.tokenizer
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_stay_whole_and_digits_split(smollm):
    tok = smollm.tokenizer
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, tok.convert_tokens_to_ids("user"), 2]
    assert tok.decode([1, 2, 0], skip_special_tokens=True) == ""
    # llama.cpp's "smollm" pre-tokenizer splits digits one by one, as SmolLM2's own tokenizer does.
    assert len(tok.encode("2024")) == 4


def test_matches_transformers_gguf_converter(smollm, default_gguf):
    """Cross-check with transformers' own GGUF tokenizer conversion (on text without digits, where
    it lacks the smollm digit split)."""
    conv = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from gguf import GGUFReader

    from jaxserve.model_loader.gguf_loader import read_metadata

    meta = read_metadata(GGUFReader(str(default_gguf)))
    ref, _ = conv.convert_gguf_tokenizer("llama", {
        "tokenizer_type": "gpt2", "pre_tokenizer_type": "smollm", "tokens": meta["tokenizer.ggml.tokens"],
        "merges": meta["tokenizer.ggml.merges"], "token_type": meta["tokenizer.ggml.token_type"]})
    for text in TEXTS:
        if not any(c.isdigit() for c in text):
            assert smollm.tokenizer.encode(text) == ref.encode(text).ids, text


def test_chat_template(smollm):
    tok = smollm.tokenizer
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert ids == tok.encode(text) and ids.count(1) == 3 and ids[0] == 1
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    assert tok.apply_chat_template(sys_msgs, tokenize=False).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_tokenizer_loads_apart_from_the_checkpoint(default_gguf, smollm, smollm_hf_folder, tmp_path):
    """load_tokenizer_of (what the engine loads on a thread) gives the tokenizer load_checkpoint
    would have attached, for every format; with_tokenizer=False attaches none."""
    from jaxserve.model_loader import load_checkpoint, load_tokenizer_of, save_orbax

    save_orbax(tmp_path / "ob", smollm)
    for model, fmt in ((str(default_gguf), "auto"), (str(smollm_hf_folder), "safetensors"),
                       (str(tmp_path / "ob"), "auto"), ("llama-3.1-8b", "dummy")):
        apart = load_tokenizer_of(model, fmt)
        assert load_checkpoint(model, fmt, with_tokenizer=False).tokenizer is None
        attached = load_checkpoint(model, fmt).tokenizer
        assert apart.get_vocab() == attached.get_vocab(), model
        assert apart.encode(TEXTS[1]) == attached.encode(TEXTS[1]), model
        assert apart.chat_template == attached.chat_template, model
