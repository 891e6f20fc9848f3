"""The engine's tokenizer comes from a folder a child process writes
(``model_loader.tokenizer_export``): llguidance's tokenizer read from that folder without
transformers equals the one built from the transformers tokenizer."""

import subprocess
import sys

from jaxserve.config import EngineConfig
from jaxserve.engine.core import EngineCore

import pytest

from jaxserve.model_loader import default_tokenizer
from jaxserve.model_loader.tokenizer_export import TokenizerExport
from jaxserve.structured_output.grammar import build_ll_tokenizer
from jaxserve.tokenizer_io import TokenizerVocab, load_tokenizer


def test_folder_gives_the_tokenizers_llguidance_tokenizer(tmp_path):
    hf = default_tokenizer()
    folder = TokenizerExport("smollm2-135m", "dummy", str(tmp_path)).wait()
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


def test_export_failure_names_the_model(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="cannot load the tokenizer of '.*bad.gguf': .+"):
        TokenizerExport(str(bad), "gguf", str(tmp_path / "out")).wait()


def test_engine_process_modules_leave_out_transformers():
    """What the server's engine process imports to run (EngineCore and the structured
    outputs) does not pull transformers in."""
    code = ("import sys, jaxserve.engine.core, jaxserve.engine.core_proc; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_failed_start_up_ends_the_export(tmp_path, monkeypatch):
    """An engine whose start-up fails ends its tokenizer child at once: left running, the child
    writes the folder after its owner (the API process, or the engine's temporary folder) has
    removed it."""
    exports = []

    class Recorded(TokenizerExport):
        def __init__(self, *args):
            super().__init__(*args)
            exports.append(self)

    monkeypatch.setattr("jaxserve.engine.core.TokenizerExport", Recorded)
    with pytest.raises(ValueError, match="--max-model-len"):
        EngineCore(EngineConfig(model="smollm2-135m", load_format="dummy",
                                max_model_len=10**7), log=lambda line: None,
                   tokenizer_dir=str(tmp_path / "tok"))
    assert len(exports) == 1 and exports[0]._child.poll() is not None
