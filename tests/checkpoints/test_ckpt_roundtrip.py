"""GGUF -> HF folder -> load, HF shards, orbax save/restore, and the convert CLI."""

import json
import pathlib
import shutil

import ml_dtypes
import numpy as np
import pytest

from checkpoints_tools.convert import main as convert
from jaxserve.model_loader import Checkpoint, load_checkpoint, save_hf_folder, save_orbax
from tiny_gguf import make_tiny_gguf


def _assert_same(a: Checkpoint, b: Checkpoint):
    assert a.weights.keys() == b.weights.keys()
    for k in a.weights:
        assert a.weights[k].dtype == b.weights[k].dtype, k
        np.testing.assert_array_equal(a.weights[k], b.weights[k], err_msg=k)
    assert a.hf_config == b.hf_config
    text = "Hi 世界 🤗 2024 <|im_end|>"
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    msgs = [{"role": "user", "content": "Hello"}]
    assert (a.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == b.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


def test_gguf_to_hf_folder_round_trip(smollm, smollm_hf_folder):
    files = {p.name for p in smollm_hf_folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    tcfg = json.loads((smollm_hf_folder / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "<|im_start|>" in tcfg["chat_template"]
    hf = load_checkpoint(str(smollm_hf_folder))
    assert hf.name == "SmolLM2-135M-Instruct"
    _assert_same(smollm, hf)


def _small(smollm) -> Checkpoint:
    keys = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.mlp.down_proj.weight"]
    w = {k: smollm.weights[k] for k in keys}
    w["model.layers.0.self_attn.k_proj.weight"] = smollm.weights[
        "model.layers.0.self_attn.k_proj.weight"].astype(ml_dtypes.bfloat16)
    return Checkpoint("small", dict(smollm.hf_config), w, smollm.tokenizer)


def test_hf_folder_sharded_with_index_and_bf16(smollm, tmp_path):
    from safetensors.numpy import save_file

    small = _small(smollm)
    save_hf_folder(tmp_path / "small", small)
    (tmp_path / "small" / "model.safetensors").unlink()
    names = sorted(small.weights)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for fname, keys in shards.items():
        save_file({k: small.weights[k] for k in keys}, str(tmp_path / "small" / fname), metadata={"format": "pt"})
    (tmp_path / "small" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    loaded = load_checkpoint(str(tmp_path / "small"), "safetensors")
    assert loaded.weights["model.layers.0.self_attn.k_proj.weight"].dtype == ml_dtypes.bfloat16
    _assert_same(small, loaded)
    # Without the index, a glob of *.safetensors is used.
    (tmp_path / "small" / "model.safetensors.index.json").unlink()
    _assert_same(small, load_checkpoint(str(tmp_path / "small")))


def test_orbax_round_trip(smollm, tmp_path):
    small = _small(smollm)
    save_orbax(tmp_path / "ob", small)
    loaded = load_checkpoint(str(tmp_path / "ob"))
    assert loaded.name == "small"
    _assert_same(small, loaded)
    with pytest.raises(ValueError, match="not empty"):
        save_orbax(tmp_path / "ob", small)


def _tiny_hf_folder(tmp_path) -> pathlib.Path:
    """A tiny Llama HF folder (from a tiny GGUF, tokenizer included)."""
    make_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    return save_hf_folder(tmp_path / "tiny", load_checkpoint(str(tmp_path / "tiny.gguf")))


def test_convert_cli_gguf_to_hf(tmp_path, capsys):
    hf = make_tiny_gguf(tmp_path / "tiny-llama.Q8_0.gguf", "llama")
    out = tmp_path / "hf"
    assert convert(["--input", str(tmp_path / "tiny-llama.Q8_0.gguf"), "--output", str(out), "--to", "hf"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    ck = load_checkpoint(str(out))
    assert ck.hf_config["architectures"] == ["LlamaForCausalLM"] and ck.weights.keys() == hf.keys()
    for k in hf:
        np.testing.assert_array_equal(ck.weights[k], hf[k], err_msg=k)


def test_convert_cli_hf_to_orbax(tmp_path, capsys):
    small = load_checkpoint(str(_tiny_hf_folder(tmp_path)))
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    small.weights[k_proj] = small.weights[k_proj].astype(ml_dtypes.bfloat16)
    save_hf_folder(tmp_path / "small-hf", small)
    out = tmp_path / "orbax"
    assert convert(["--input", str(tmp_path / "small-hf"), "--output", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    ob = load_checkpoint(str(out), "orbax")
    assert ob.name == "small-hf"
    _assert_same(small, ob)


@pytest.mark.parametrize("args,flag", [
    (["--input", "/no/such/model.gguf", "--output", "X"], "--input"),
    (["--input", "HF", "--output", "X", "--to", "hf"], "--to hf"),
    (["--input", "GGUF", "--output", "NONEMPTY"], "--output"),
    (["--input", "GGUF", "--output", "X", "--to", "pt"], "--to"),
    (["--output", "X"], "--input"),
])
def test_convert_cli_errors_name_the_flag(args, flag, smollm_hf_folder, default_gguf, tmp_path, capsys):
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "f").write_text("x")
    subst = {"HF": str(smollm_hf_folder), "GGUF": str(default_gguf), "X": str(tmp_path / "x"),
             "NONEMPTY": str(tmp_path / "nonempty")}
    with pytest.raises(SystemExit) as e:
        convert([subst.get(a, a) for a in args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in err and "error:" in err


def test_convert_cli_damaged_input_is_one_line(smollm_hf_folder, default_gguf, tmp_path, capsys):
    """A checkpoint that does not load, or an output that cannot be written: exit 1 with one
    line naming the flag, no traceback."""
    tiny = _tiny_hf_folder(tmp_path)
    for name, cut in (("cut-safetensors", lambda b: b[:len(b) // 2]),
                      ("random-safetensors", lambda b: np.random.default_rng(0).bytes(len(b)))):
        shutil.copytree(tiny, tmp_path / name)
        weights = tmp_path / name / "model.safetensors"
        weights.write_bytes(cut(weights.read_bytes()))
    (tmp_path / "text.gguf").write_text("not a GGUF\n")
    (tmp_path / "cut.gguf").write_bytes(default_gguf.read_bytes()[:5_000_000])
    (tmp_path / "bad-json").mkdir()
    (tmp_path / "bad-json" / "config.json").write_text("{not json")
    (tmp_path / "bad-json" / "model.safetensors").symlink_to(smollm_hf_folder / "model.safetensors")
    (tmp_path / "no-tokenizer").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "no-tokenizer" / name).symlink_to(smollm_hf_folder / name)
    (tmp_path / "a-file").write_text("x")
    cases = [(tmp_path / "text.gguf", tmp_path / "o1", "--input"),
             (tmp_path / "cut.gguf", tmp_path / "o2", "--input"),
             (tmp_path / "bad-json", tmp_path / "o3", "--input"),
             (tmp_path / "no-tokenizer", tmp_path / "o4", "--input"),
             (tmp_path / "cut-safetensors", tmp_path / "o5", "--input"),
             (tmp_path / "random-safetensors", tmp_path / "o6", "--input"),
             (smollm_hf_folder, tmp_path / "a-file" / "out", "--output")]
    for src, out, flag in cases:
        assert convert(["--input", str(src), "--output", str(out)]) == 1, src
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith(f"error: {flag} "), err
        if src.name.endswith("-safetensors"):  # safetensors' reason, naming the file
            assert f"{src / 'model.safetensors'}: not a valid safetensors file" in err, err


UP = "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("config,weights", [
    ({"architectures": ["FalconForCausalLM"]}, {}),
    ({}, {UP: None}),
    ({}, {UP: lambda w: w[:-1]}),
    ({"hidden_size": None}, {}),
], ids=["architecture", "missing-tensor", "tensor-shape", "no-hidden_size"])
def test_convert_cli_refuses_what_the_engine_does_not_load(config, weights, tmp_path, capsys):
    """An input the engine would refuse is refused by convert, with the engine's own message
    (exit 1, one line), and nothing is written. ``config``: keys to set (None: to remove);
    ``weights``: tensors to change (None: to remove)."""
    from safetensors.numpy import load_file, save_file

    from jaxserve.models.registry import build_params

    src = _tiny_hf_folder(tmp_path)
    cfg = json.loads((src / "config.json").read_text()) | config
    (src / "config.json").write_text(json.dumps(
        {k: v for k, v in cfg.items() if k not in config or v is not None}))
    tensors = load_file(src / "model.safetensors")
    tensors |= {k: change and change(tensors[k]) for k, change in weights.items()}
    save_file({k: w for k, w in tensors.items() if w is not None}, src / "model.safetensors")
    ckpt = load_checkpoint(str(src))
    with pytest.raises(ValueError) as refused:  # what serve and LLM say at start-up
        build_params(ckpt.hf_config, ckpt.weights, "float32")
    out = tmp_path / "out"
    assert convert(["--input", str(src), "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"error: --input {src}: {refused.value}"
    assert not out.exists()


def test_convert_keeps_the_default_models_sampling_defaults(default_gguf, tmp_path):
    """The default model's GGUF carries no generation config: its chat defaults go into the
    converted folder, and a copy of the GGUF elsewhere is the default model too."""
    from jaxserve.model_loader.default_model import GENERATION_CONFIG
    from jaxserve.model_loader.generation_config import load_generation_config

    copy = tmp_path / "elsewhere.gguf"
    copy.hardlink_to(default_gguf)
    assert load_generation_config(str(copy), "gguf") == GENERATION_CONFIG
    assert convert(["--input", str(copy), "--output", str(tmp_path / "hf"), "--to", "hf"]) == 0
    written = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert written == {**GENERATION_CONFIG, "do_sample": True}
    assert load_generation_config(str(tmp_path / "hf"), "safetensors") == GENERATION_CONFIG
    assert convert(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "orbax")]) == 0
    assert load_generation_config(str(tmp_path / "orbax"), "orbax") == GENERATION_CONFIG
