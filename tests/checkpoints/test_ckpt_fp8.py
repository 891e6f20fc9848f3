"""FP8 checkpoints (``jaxserve.models.fp8_checkpoint``): a tiny random Llama written in each
format's layout loads, and its logits match that format's float32 reference, which quantizes
the activations as the format says (the weights dequantized, ``weight * scale``); bad input is
a start-up error naming the tensor or the field.

The compressed-tensors folders are written and read back by the compressed-tensors package
itself (llm-compressor's writer path: ``apply_quantization_config``, ``ModelCompressor``;
transformers loads them on the CPU and runs the fake-quantized float32 model). No ModelOpt or
fbgemm reader runs on the CPU, so those folders follow the published layouts (ModelOpt's unified
HF export: per-tensor ``weight_scale`` and ``input_scale`` of shape [], ``hf_quant_config.json``;
transformers' ``FbgemmFp8Linear``: ``weight_scale`` [out, 1], per-token activations capped at
``activation_scale_ub``) and their reference is HF's float32 model with the weights dequantized
and the activations quantized in torch by hooks.
"""

import copy
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from jaxserve.model_loader import load_hf_folder
from jaxserve.models.registry import build_params
from tests.engine.test_model_parity import prompt_logits
from tests.integration import tp_utils

FP8_MAX = 448.0
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             tie_word_embeddings=False, initializer_range=0.2)
IDS = [int(i) for i in np.random.default_rng(0).integers(3, 256, 20)]
# Static input scales at half the calibrated range (some activations saturate), and fbgemm's
# cap below the largest tokens: a loader that ignored either would miss the reference.
STATIC_SHRINK = 0.5
FORMATS = ("ct-dynamic", "ct-static", "modelopt", "modelopt-hf-quant-config", "fbgemm")


def qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x quantized to float8_e4m3fn with ``scale`` (saturating) and back."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def linears(model) -> dict:
    return {name: m for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name != "lm_head"}


@pytest.fixture(scope="module")
def base():
    """The float32 HF model and each decoder linear's largest input magnitude on IDS."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    amax, hooks = {}, []
    for name, m in linears(model).items():
        hooks.append(m.register_forward_pre_hook(
            lambda m, args, name=name: amax.__setitem__(name, args[0].abs().max().item())))
    with torch.no_grad():
        model(torch.tensor([IDS]))
    for h in hooks:
        h.remove()
    return model, amax


def fresh_copy(model):
    out = transformers.LlamaForCausalLM(model.config)
    out.load_state_dict(model.state_dict())
    return out.eval()


def write_compressed_tensors(model, amax: dict, preset: str, folder) -> None:
    """llm-compressor's path with the scales set by hand (absmax, as its observers): the preset
    scheme on every Linear but lm_head, compressed and saved by compressed-tensors."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)

    model = fresh_copy(model)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
        ignore=["lm_head"]))
    for name, m in linears(model).items():
        w = m.weight.data.abs()
        per_channel = m.weight_scale.ndim == 2  # [out, 1]; per tensor: [1]
        m.weight_scale.data.copy_((w.amax(1, keepdim=True) if per_channel else w.amax()
                                   .reshape(1)) / FP8_MAX)
        if hasattr(m, "input_scale"):
            m.input_scale.data.fill_(STATIC_SHRINK * amax[name] / FP8_MAX)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)


def write_by_hand(model, amax: dict, fmt: str, folder) -> dict:
    """A ModelOpt or fbgemm folder (module docstring) of ``model``; returns {linear name:
    (dequantized weight, input scale or None)} for the reference."""
    model.save_pretrained(folder)  # config.json; its float tensors are replaced below
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    deq = {}
    for name, m in linears(model).items():
        w = m.weight.data
        if fmt == "fbgemm":
            scale, input_scale = w.abs().amax(1, keepdim=True) / FP8_MAX, None
        else:
            scale = w.abs().amax() / FP8_MAX  # shape []
            input_scale = torch.tensor(STATIC_SHRINK * amax[name] / FP8_MAX)
            tensors[f"{name}.input_scale"] = input_scale
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = q, scale
        deq[name] = (q.float() * scale, input_scale)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    if fmt == "fbgemm":
        cfg["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": ub(amax),
                                      "modules_to_not_convert": ["lm_head"]}
    elif fmt == "modelopt":
        cfg["quantization_config"] = {
            "quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
            "producer": {"name": "modelopt", "version": "0.29.0"},
            "config_groups": {"group_0": {
                "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float"}}}}
    else:  # the older export: config.json as the model's, the method beside it
        (folder / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.19.0"},
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                             "exclude_modules": ["lm_head"]}}))
    (folder / "config.json").write_text(json.dumps(cfg))
    return deq


def ub(amax: dict) -> float:
    return 0.6 * min(amax.values())


def hooked_reference(model, deq: dict, cap: float | None) -> np.ndarray:
    """Logits on IDS of ``model`` with each linear's weight dequantized and its input quantized:
    with the static input scale, else per token (the largest magnitude capped at ``cap``)."""
    model = fresh_copy(model)

    def quantize_input(m, args, input_scale):
        x = args[0]
        if input_scale is not None:
            return (qdq(x, input_scale),)
        amax = x.abs().amax(-1, keepdim=True)
        return (qdq(x, (amax if cap is None else amax.clamp(max=cap)) / FP8_MAX),)

    for name, m in linears(model).items():
        w, input_scale = deq[name]
        m.weight.data.copy_(w)
        m.register_forward_pre_hook(lambda m, a, s=input_scale: quantize_input(m, a, s))
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


@pytest.fixture(scope="module")
def folders(base, tmp_path_factory):
    """{format: (folder, reference logits on IDS)}."""
    model, amax = base
    out = {}
    for fmt in FORMATS:
        folder = tmp_path_factory.mktemp(fmt)
        if fmt.startswith("ct-"):
            write_compressed_tensors(model, amax, "FP8_DYNAMIC" if fmt == "ct-dynamic" else "FP8",
                                     folder)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=torch.float32).eval()
            with torch.no_grad():
                ref = hf(torch.tensor([IDS])).logits[0].numpy()
        else:
            deq = write_by_hand(model, amax, fmt, folder)
            ref = hooked_reference(model, deq, ub(amax) if fmt == "fbgemm" else None)
        out[fmt] = folder, ref
    return out


def our_logits(folder, quantization=None) -> np.ndarray:
    ckpt = load_hf_folder(folder, with_tokenizer=False)
    config, params = build_params(ckpt.hf_config, ckpt.weights, jnp.float32,
                                  quantization=quantization)
    return prompt_logits(config, params, IDS)


def rel_errors(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_matches_its_reference(fmt, folders):
    folder, ref = folders[fmt]
    ours = our_logits(folder)
    # Same FP8 operands as the reference; only float32 rounding (and an FP8 rounding it flips
    # now and then) differs.
    assert rel_errors(ours, ref).max() < 2e-3, rel_errors(ours, ref)


def test_the_flag_may_name_the_checkpoints_method(folders):
    folder, ref = folders["fbgemm"]
    assert rel_errors(our_logits(folder, "fbgemm_fp8"), ref).max() < 2e-3


def _set(path: str, value):
    """A mutation of the hf_config setting the field at dotted ``path`` (None: delete it)."""
    def mutate(cfg, weights):
        *parents, last = path.split(".")
        d = cfg
        for key in parents:
            d = d[key]
        if value is None:
            d.pop(last, None)
        else:
            d[last] = value
    return mutate


def _tensor(name: str, value):
    def mutate(cfg, weights):
        if value is None:
            del weights[name]
        else:
            weights[name] = value
    return mutate


QC = "quantization_config"
G = f"{QC}.config_groups.group_0"
L1 = "model.layers.1."
BAD = [  # (folder, mutation, flag, the error's words)
    ("ct-dynamic", _set(f"{QC}.quant_method", "gptq"), None,
     "unsupported quantization_config.quant_method 'gptq'"),
    ("ct-dynamic", _set(f"{G}.weights.num_bits", 4), None, "group_0.weights.num_bits 4"),
    ("ct-dynamic", _set(f"{G}.weights.type", "int"), None, "group_0.weights.type 'int'"),
    ("ct-dynamic", _set(f"{G}.weights.strategy", "block"), None, "weights.strategy 'block'"),
    ("ct-dynamic", _set(f"{G}.weights.group_size", 128), None, "weights.group_size 128"),
    ("ct-dynamic", _set(f"{G}.input_activations", None), None, "group_0.input_activations None"),
    ("ct-static", _set(f"{G}.input_activations.dynamic", True), None,
     "input_activations.dynamic True"),
    ("ct-dynamic", _set(f"{QC}.kv_cache_scheme", {"num_bits": 8, "type": "float"}), None,
     "quantization_config.kv_cache_scheme"),
    ("ct-dynamic", _set(f"{QC}.format", "pack-quantized"), None,
     "quantization_config.format 'pack-quantized'"),
    ("modelopt", _set(f"{QC}.quant_algo", "NVFP4"), None, "quantization_config.quant_algo 'NVFP4'"),
    ("modelopt", _set(f"{QC}.kv_cache_scheme", "FP8"), None, "quantization_config.kv_cache_scheme"),
    ("modelopt-hf-quant-config", _set(f"{QC}.quantization.kv_cache_quant_algo", "FP8"), None,
     "hf_quant_config.json quantization.kv_cache_quant_algo 'FP8'"),
    ("fbgemm", _set(f"{QC}.activation_scale_ub", None), None, "activation_scale_ub None"),
    ("ct-dynamic", None, "fp8", "--quantization fp8 conflicts with the checkpoint's "
     "quantization_config.quant_method 'compressed-tensors'"),
    ("fbgemm", None, "modelopt", "--quantization modelopt conflicts"),
    ("ct-static", _tensor(L1 + "mlp.down_proj.weight_scale", None), None,
     "lacks tensor 'model.layers.1.mlp.down_proj.weight_scale'"),
    ("ct-static", _tensor(L1 + "self_attn.k_proj.input_scale", None), None,
     "lacks tensor 'model.layers.1.self_attn.k_proj.input_scale'"),
    ("ct-dynamic", _tensor(L1 + "self_attn.q_proj.weight_scale", np.ones((1,), np.float32)),
     None, "tensor model.layers.1.self_attn.q_proj.weight_scale has shape (1,), expected"),
    ("ct-dynamic", _tensor(L1 + "mlp.up_proj.weight", np.zeros((128, 64), np.float32)), None,
     "tensor model.layers.1.mlp.up_proj.weight has dtype float32, expected float8_e4m3fn"),
    ("modelopt", _tensor(L1 + "self_attn.k_scale", np.ones((), np.float32)), None,
     "tensor model.layers.1.self_attn.k_scale is quantization data"),
    ("ct-dynamic", _tensor(L1 + "mlp.up_proj.input_scale", np.ones((1,), np.float32)), None,
     "tensor model.layers.1.mlp.up_proj.input_scale is quantization data"),
    # Malformed fields, a NaN cap, quantized tensors of another kind.
    ("ct-dynamic", _set(QC, "fp8"), None, "unsupported quantization_config 'fp8' (a JSON object)"),
    ("ct-dynamic", _set(f"{QC}.config_groups", [1]), None, "config_groups [1] (a JSON object)"),
    ("modelopt-hf-quant-config", _set(f"{QC}.quantization", "FP8"), None,
     "hf_quant_config.json quantization 'FP8' (a JSON object)"),
    ("fbgemm", _set(f"{QC}.activation_scale_ub", float("nan")), None, "activation_scale_ub nan"),
    ("ct-dynamic", _tensor(L1 + "mlp.up_proj.weight", np.zeros((128, 64), np.int8)), None,
     "tensor model.layers.1.mlp.up_proj.weight has dtype int8"),
    ("ct-dynamic", _set(f"{QC}.sparsity_config", {"format": "sparse-24-bitmask",
                                                  "targets": ["Linear"]}), None,
     "quantization_config.sparsity_config"),
    # Decoder projections left unquantized by the format's listing (lm_head alone is fine).
    ("ct-dynamic", _set(f"{QC}.ignore", ["lm_head", "re:.*mlp.*"]), None,
     "quantization_config.ignore entry 're:.*mlp.*': it leaves model.layers.0.mlp.gate_proj"),
    ("modelopt-hf-quant-config", _set(f"{QC}.quantization.exclude_modules",
                                      ["lm_head", "*self_attn*"]), None,
     "quantization_config.exclude_modules entry '*self_attn*'"),
    ("fbgemm", _set(f"{QC}.modules_to_not_convert", ["lm_head", "layers.1.mlp.down_proj"]),
     None, "modules_to_not_convert entry 'layers.1.mlp.down_proj'"),
]


@pytest.mark.parametrize("fmt, mutate, flag, words", BAD)
def test_bad_input_is_refused_naming_it(fmt, mutate, flag, words, folders):
    ckpt = load_hf_folder(folders[fmt][0], with_tokenizer=False, lazy=True)
    cfg, weights = copy.deepcopy(ckpt.hf_config), dict(ckpt.weights)
    if mutate:
        mutate(cfg, weights)
    with pytest.raises(ValueError) as e:
        build_params(cfg, weights, jnp.float32, quantization=flag)
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("mutate", [
    _set(f"{QC}.format", "naive-quantized"),  # the same FP8 bytes (older llm-compressor)
    _set(f"{QC}.format", None),  # the group's format stands
    _set(f"{QC}.sparsity_config", {"format": "dense", "targets": []}),
    _set(f"{QC}.ignore", ["lm_head", "re:vision_tower.*", "re:.*lm_head"]),
])
def test_equivalent_compressed_tensors_configs_load(mutate, folders):
    folder, ref = folders["ct-dynamic"]
    ckpt = load_hf_folder(folder, with_tokenizer=False, lazy=True)
    cfg = copy.deepcopy(ckpt.hf_config)
    mutate(cfg, None)
    build_params(cfg, ckpt.weights, jnp.float32)


def test_a_plain_checkpoint_takes_no_checkpoint_flag(base, tmp_path):
    base[0].save_pretrained(tmp_path)
    ckpt = load_hf_folder(tmp_path, with_tokenizer=False, lazy=True)
    with pytest.raises(ValueError, match="--quantization compressed-tensors needs a checkpoint"):
        build_params(ckpt.hf_config, ckpt.weights, jnp.float32, quantization="compressed-tensors")


TP_CODE = """
import json
import jax.numpy as jnp, numpy as np
from jaxserve.model_loader import load_hf_folder
from jaxserve.models import sharding
from jaxserve.models.registry import build_params
from tests.checkpoints.test_ckpt_fp8 import IDS
from tests.engine.test_model_parity import prompt_logits
out = {}
for fmt, folder in json.loads(FOLDERS).items():
    for tp in (1, 2, 4):
        mesh = sharding.make_mesh(tp)
        ckpt = load_hf_folder(folder, with_tokenizer=False, lazy=mesh is not None)
        config, params = build_params(ckpt.hf_config, ckpt.weights, jnp.float32, mesh=mesh)
        out[f"{fmt} {tp}"] = prompt_logits(config, params, IDS, mesh).tolist()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_fp8_checkpoints_under_tensor_parallelism(folders):
    # TP 4 replicates the 2 KV heads (their rows and scales); per-tensor scales of fused parts.
    fmts = {fmt: str(folders[fmt][0]) for fmt in ("ct-static", "fbgemm")}
    out = tp_utils.run_python(f"FOLDERS = {json.dumps(fmts)!r}\n" + TP_CODE, devices=4)
    for fmt in fmts:
        one = np.array(out[f"{fmt} 1"])
        np.testing.assert_allclose(one, folders[fmt][1], rtol=2e-3, atol=2e-3 * np.abs(one).max())
        for tp in (2, 4):
            np.testing.assert_allclose(np.array(out[f"{fmt} {tp}"]), one, rtol=1e-4, atol=1e-4)
