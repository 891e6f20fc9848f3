"""The engine's tokenizer comes from a folder a child process writes once and the cache keeps
(``model_loader.tokenizer_export``): llguidance's tokenizer read from that folder without
transformers equals the one built from the transformers tokenizer."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

from jaxserve.config import EngineConfig
from jaxserve.engine.core import EngineCore

import pytest

from jaxserve.model_loader import default_tokenizer
from jaxserve.model_loader.tokenizer_export import (STALE_PART_S, TokenizerExport,
                                                     tokenizer_folder)
from jaxserve.structured_output.grammar import build_ll_tokenizer
from jaxserve.tokenizer_io import TokenizerVocab, load_tokenizer, save_tokenizer


def test_folder_gives_the_tokenizers_llguidance_tokenizer():
    hf = default_tokenizer()
    folder = TokenizerExport("smollm2-135m", "dummy").wait()
    read = TokenizerVocab.read(folder)
    assert (read.size, read.eos_token_id) == (len(hf), hf.eos_token_id)
    a = build_ll_tokenizer(read, 49152, [hf.eos_token_id])
    b = build_ll_tokenizer(TokenizerVocab.of(hf), 49152, [hf.eos_token_id])
    text = 'Déjà vu: {"a": [1, 2.5e-3, null]} <|im_end|>\n\t  日本語 🙂'
    assert a.tokenize_str(text) == b.tokenize_str(text) == hf.encode(text)
    assert (a.vocab_size, a.eos_tokens) == (b.vocab_size, b.eos_tokens)
    assert [a.decode_bytes([i]) for i in range(0, 49152, 97)] == \
        [b.decode_bytes([i]) for i in range(0, 49152, 97)]
    assert load_tokenizer(folder).encode(text) == hf.encode(text)


def test_export_failure_names_the_model_and_keeps_nothing(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="cannot load the tokenizer of '.*bad.gguf': .+"):
        TokenizerExport(str(bad), "gguf").wait()
    folder = tokenizer_folder(str(bad), "gguf")
    assert not folder.exists() and not list(folder.parent.glob(folder.name + ".part-*"))


def test_a_kept_folder_is_reused_until_the_checkpoint_changes(tmp_path, monkeypatch):
    """A second start of the same checkpoint starts no child; a rewritten tokenizer file, or
    another transformers version, gets a folder of its own."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_tokenizer(default_tokenizer(), ckpt)
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"")  # the tokenizer's export reads no weights
    first = TokenizerExport(str(ckpt), "safetensors")
    assert not first.kept and first._child is not None
    folder = first.wait()
    again = TokenizerExport(str(ckpt), "safetensors")
    assert again.kept and again._child is None and again.wait() == folder
    assert [p.name for p in (tmp_path / "cache" / "tokenizers").iterdir()] == [
        pathlib.Path(folder).name]  # no part folder left
    cfg = ckpt / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "model_max_length": 77}))
    changed = tokenizer_folder(str(ckpt), "safetensors")
    assert str(changed) != folder
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.0.0")
    assert tokenizer_folder(str(ckpt), "safetensors") != changed


def test_a_stale_part_folder_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """Part folders of a start killed mid-export go with the next export; a younger one may be
    another start's, still writing."""
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    folder = tokenizer_folder(str(bad), "gguf")
    folder.parent.mkdir(parents=True)
    stale, fresh = (folder.with_name(f"{folder.name}.part-{n}") for n in ("a", "b"))
    for part in (stale, fresh):
        part.mkdir()
        (part / "tokenizer.json").write_text("{")
    old = stale.stat().st_mtime - STALE_PART_S - 1
    os.utime(stale, (old, old))
    TokenizerExport(str(bad), "gguf").cancel()
    assert not stale.exists() and fresh.exists() and not folder.exists()


def test_engine_process_modules_leave_out_transformers():
    """What the server's engine process imports to run (EngineCore and the structured
    outputs) does not pull transformers in."""
    code = ("import sys, jaxserve.engine.core, jaxserve.engine.core_proc; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_failed_start_up_ends_the_export(monkeypatch):
    """An engine whose start-up fails ends its tokenizer child at once and removes the part
    folder it wrote: left running, the child would outlive the engine."""
    exports = []

    class Recorded(TokenizerExport):
        def __init__(self, *args):
            super().__init__(*args)
            exports.append(self)

    monkeypatch.setattr("jaxserve.engine.core.TokenizerExport", Recorded)
    folder = tokenizer_folder("smollm2-135m", "dummy")
    shutil.rmtree(folder, ignore_errors=True)  # so that a child writes it
    with pytest.raises(ValueError, match="--max-model-len"):
        EngineCore(EngineConfig(model="smollm2-135m", load_format="dummy",
                                max_model_len=10**7), log=lambda line: None)
    assert len(exports) == 1 and exports[0]._child.poll() is not None
    assert not list(folder.parent.glob(folder.name + ".part-*"))
