"""IncrementalDetokenizer: UTF-8 safety and stop strings, on the default model's tokenizer."""

import pytest

from jaxserve.engine.detokenizer import UNKNOWN_TOKEN_TEXT, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from jaxserve.model_loader.default_model import default_model_path

    gguf = default_model_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


TEXTS = [
    "Café déjà vu, naïve façade — Ångström über Straße.",
    "Emoji: 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 done.",
    "中文测试：你好，世界！日本語のテキスト。한국어 문장.",
    "mixed: é😀中 — ok\nnew line\ttab",
]


@pytest.mark.parametrize("text", TEXTS)
def test_one_id_at_a_time_joins_to_exact_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.update([i]) for i in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == text
    assert detok.output_text == text
    # Some ids really were partial characters (the test exercises the buffering).
    if any(ord(c) > 0x7F for c in text):
        assert len(ids) >= len([p for p in pieces if p])


def test_special_tokens_skipped(tokenizer):
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.update([i]) for i in ids) + detok.flush()
    assert text == "Hi there"


def test_prompt_context_is_not_emitted(tokenizer):
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    ids = tokenizer.encode(" world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert detok.update(ids) + detok.flush() == " world"


def test_unknown_ids_get_placeholder(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("ab", add_special_tokens=False)
    out = detok.update(ids[:1]) + detok.update([10**6]) + detok.update(ids[1:]) + detok.flush()
    assert UNKNOWN_TOKEN_TEXT in out


def _feed(tokenizer, text, stop, *, chunk=1):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    pieces = []
    for k in range(0, len(ids), chunk):
        pieces.append(detok.update(ids[k:k + chunk]))
        if detok.stop_matched:
            break
    else:
        pieces.append(detok.flush())
    return detok, pieces


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_stop_string_spanning_tokens(tokenizer, chunk):
    text = "The answer is forty-two. END OF STORY and more text"
    detok, pieces = _feed(tokenizer, text, ["END OF STORY"], chunk=chunk)
    assert detok.stop_matched == "END OF STORY"
    assert "".join(pieces) == "The answer is forty-two. "
    assert detok.output_text == "The answer is forty-two. "
    # Nothing from the stop string leaked out in a delta before it was recognised.
    assert not any("END" in p for p in pieces)


def test_earliest_stop_string_wins(tokenizer):
    detok, pieces = _feed(tokenizer, "alpha beta gamma delta", ["delta", "beta"], chunk=100)
    assert detok.stop_matched == "beta"
    assert "".join(pieces) == "alpha "


def test_partial_stop_prefix_released_when_not_a_match(tokenizer):
    text = "one ST two STOP three"
    detok, pieces = _feed(tokenizer, text, ["STOP"])
    assert "".join(pieces) == "one ST two "
    assert detok.stop_matched == "STOP"


def test_no_stop_match_flush_returns_held_text(tokenizer):
    text = "ends with a prefix of the stop: STO"
    detok, pieces = _feed(tokenizer, text, ["STOP"])
    assert detok.stop_matched is None
    assert pieces[-1].endswith("STO")
    assert "".join(pieces) == text


def test_stop_string_inside_multibyte_text(tokenizer):
    text = "日本語😀の停止テキスト後"
    detok, pieces = _feed(tokenizer, text, ["停止"])
    assert "".join(pieces) == "日本語😀の"
    assert all("\ufffd" not in p for p in pieces)


def test_updates_after_stop_are_ignored(tokenizer):
    detok, _ = _feed(tokenizer, "a STOP b", ["STOP"])
    assert detok.update(tokenizer.encode(" more", add_special_tokens=False)) == ""
    assert detok.output_text == "a "
