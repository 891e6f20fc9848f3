import json

import pytest

from jaxserve.model_loader import DUMMY_PRESETS, load_checkpoint


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "llama-3.2-1b", "qwen2.5-0.5b", "smollm2-135m",
                                    "qwen3-0.6b", "mistral-7b"])
def test_dummy_presets(preset, default_gguf):
    ck = load_checkpoint(preset, "dummy")
    assert ck.weights is None and ck.name == preset
    cfg = ck.hf_config
    assert cfg["architectures"][0] in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                       "MistralForCausalLM")
    assert cfg["hidden_size"] % cfg["num_attention_heads"] == 0
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert len(ck.tokenizer) == 49152 and ck.tokenizer.encode("Hello world") == [19556, 905]
    ck.hf_config["hidden_size"] = -1
    assert DUMMY_PRESETS[preset]["hidden_size"] != -1  # callers get a copy


def test_llama_8b_preset_values():
    c = DUMMY_PRESETS["llama-3.1-8b"]
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["intermediate_size"], c["vocab_size"]) == (4096, 32, 32, 8, 14336, 128256)
    assert c["rope_scaling"]["rope_type"] == "llama3"


def test_dummy_from_config_json(tmp_path):
    (tmp_path / "mymodel").mkdir()
    cfg = dict(DUMMY_PRESETS["qwen2.5-0.5b"], num_hidden_layers=2)
    (tmp_path / "mymodel" / "config.json").write_text(json.dumps(cfg))
    ck = load_checkpoint(str(tmp_path / "mymodel" / "config.json"), "dummy")
    assert ck.name == "mymodel" and ck.hf_config == cfg and ck.weights is None
    assert load_checkpoint(None, "dummy").name == "smollm2-135m"


def test_default_tokenizer_cache_is_built_from_gguf_metadata(default_gguf, tmp_path, monkeypatch):
    from jaxserve.model_loader import default_tokenizer

    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    (tmp_path / default_gguf.name).symlink_to(default_gguf)  # no fetch; metadata-only GGUF read
    tok = default_tokenizer()
    cached = tmp_path / "tokenizers" / "SmolLM2-135M-Instruct"
    assert (cached / "tokenizer.json").is_file()
    again = default_tokenizer()  # now from the cache folder
    text = "Hello 世界 2024 <|im_end|>"
    assert tok.encode(text) == again.encode(text) and again.chat_template == tok.chat_template


@pytest.mark.parametrize("make,fmt,match", [
    (lambda p: p / "missing", "auto", "does not exist"),
    (lambda p: p, "auto", "is not a GGUF file, an HF folder"),  # empty folder
    (lambda p: (p / "x.bin").write_bytes(b"nope") and p / "x.bin", "auto", "is not a GGUF file"),
    (lambda p: p, "gguf", "is not a GGUF file"),
    (lambda p: p, "orbax", "is not a jaxserve orbax folder"),
    (lambda p: (p / "config.json").write_text("{}") and p, "safetensors", "config.json and \\*.safetensors"),
    (lambda p: "no-such-preset", "dummy", "not a preset"),
    (lambda p: "llama-3.1-8b", "auto", "load_format='dummy'"),
    (lambda p: p, "pytorch", "load_format 'pytorch' is not one of"),
])
def test_bad_paths_are_one_line_value_errors(tmp_path, make, fmt, match):
    target = make(tmp_path)
    with pytest.raises(ValueError, match=match) as e:
        load_checkpoint(str(target), fmt)
    assert "\n" not in str(e.value)
    if fmt != "pytorch":
        assert str(target) in str(e.value)


def test_damaged_checkpoints_are_value_errors_naming_the_file_or_key(tmp_path):
    """What ``LLM`` and ``serve`` report for a truncated safetensors file and a config.json
    without a key the architecture needs (one loading path: load_checkpoint, then
    ModelConfig.from_hf_config in EngineCore)."""
    import numpy as np
    from safetensors.numpy import save_file

    from jaxserve import LLM

    cfg = dict(DUMMY_PRESETS["smollm2-135m"], num_hidden_layers=1)
    folder = tmp_path / "truncated"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({"a": np.zeros((64, 64), np.float32)}, str(folder / "model.safetensors"))
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    match = r"model\.safetensors: not a valid safetensors file \(.*incomplete metadata"
    with pytest.raises(ValueError, match=match):
        load_checkpoint(str(folder))
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(folder), log=lambda s: None)
    with pytest.raises(ValueError) as e:
        LLM(str(tmp_path / "config.json"), load_format="dummy", log=lambda s: None)
    assert str(e.value) == "config.json: missing required key 'hidden_size'"
