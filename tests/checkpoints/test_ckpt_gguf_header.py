"""The GGUF header cache: a later process reads no GGUF field and gets the same checkpoint and
tokenizer; a rewritten file is parsed again; a file cut short fails naming what lies past its
end."""

import numpy as np
import pytest
from test_ckpt_tokenizer import TEXTS
from tiny_gguf import make_tiny_gguf

from jaxserve.model_loader import gguf_header, gguf_reader, load_gguf


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache folder and no header parsed in this process yet."""
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_header, "_parsed", {})
    return tmp_path / "cache"


def _new_process(monkeypatch):
    """Forget this process's headers and make any GGUF field parse fail, as a later process that
    must find everything in the cache folder."""

    def no_parse(*a, **k):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_header, "_parsed", {})
    monkeypatch.setattr(gguf_reader, "BoundedReader", no_parse)


def test_cached_header_gives_the_same_checkpoint(fresh_cache, tmp_path, monkeypatch):
    path = tmp_path / "tiny-llama-F32.gguf"
    make_tiny_gguf(path, "llama")
    first = load_gguf(path)
    assert len(list((fresh_cache / "gguf").iterdir())) == 1
    _new_process(monkeypatch)
    again = load_gguf(path)
    assert (again.name, again.hf_config) == (first.name, first.hf_config)
    assert again.weights.keys() == first.weights.keys()
    for k, w in first.weights.items():
        np.testing.assert_array_equal(again.weights[k], w, err_msg=k)
    assert again.tokenizer.get_vocab() == first.tokenizer.get_vocab()


def test_cached_tokenizer_encodes_as_the_built_one(fresh_cache, default_gguf, monkeypatch):
    """The tokenizer saved in the cache folder and loaded back encodes, decodes and templates as
    the one built from the GGUF metadata."""
    from gguf import GGUFReader

    from jaxserve.model_loader.gguf_loader import read_metadata
    from jaxserve.model_loader.gguf_tokenizer import build_tokenizer

    meta = read_metadata(GGUFReader(str(default_gguf)))
    built = build_tokenizer({k: v for k, v in meta.items() if k.startswith("tokenizer.")})
    load_gguf(default_gguf, with_weights=False)
    _new_process(monkeypatch)
    cached = load_gguf(default_gguf, with_weights=False).tokenizer
    for text in [*TEXTS, "<|im_start|>user<|im_end|><|endoftext|>", "2024"]:
        assert cached.encode(text) == built.encode(text), text
        ids = built.encode(text)
        assert cached.decode(ids, skip_special_tokens=True) == built.decode(ids, skip_special_tokens=True)
    assert cached.all_special_ids == built.all_special_ids and len(cached) == len(built)
    msgs = [{"role": "user", "content": "Hi"}]
    assert (cached.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == built.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


def test_rewritten_file_is_parsed_again(fresh_cache, tmp_path):
    path = tmp_path / "tiny.gguf"
    make_tiny_gguf(path, "llama")
    assert load_gguf(path, with_weights=False).hf_config["model_type"] == "llama"
    make_tiny_gguf(path, "qwen3")
    assert load_gguf(path, with_weights=False).hf_config["model_type"] == "qwen3"


def test_threads_share_one_parse(fresh_cache, tmp_path, monkeypatch):
    """The engine's tokenizer thread and its checkpoint load ask for the file at once: one parse."""
    import threading

    path = tmp_path / "tiny.gguf"
    make_tiny_gguf(path, "llama")
    parses = []
    real = gguf_reader.BoundedReader

    def counted(*a, **k):
        parses.append(1)
        return real(*a, **k)

    monkeypatch.setattr(gguf_reader, "BoundedReader", counted)
    threads = [threading.Thread(target=gguf_header.read_header, args=(path,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(parses) == 1


def test_truncated_file_names_what_lies_past_its_end(fresh_cache, tmp_path):
    """gguf's own reader fails on a cut file with numpy's reshape or view errors; the loader
    names the tensor (or the header) that the file no longer holds, and the bytes it needs."""
    from gguf import GGUFReader

    whole = tmp_path / "tiny-llama.gguf"
    make_tiny_gguf(whole, "llama")
    last = max(GGUFReader(str(whole)).tensors, key=lambda t: t.data_offset)
    end = last.data_offset + last.n_bytes
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:end - 1])  # the last tensor's last byte gone
    with pytest.raises(ValueError) as e:
        load_gguf(cut)
    assert str(e.value) == (f"GGUF file {cut} is truncated: tensor {last.name!r} needs bytes "
                            f"{last.data_offset}..{end}, the file has {end - 1}")
    cut.write_bytes(data[:100])  # inside the header's key/value metadata
    with pytest.raises(ValueError, match=r"is truncated: its header needs bytes \d+\.\.\d+, "
                                         r"the file has 100$"):
        load_gguf(cut)
