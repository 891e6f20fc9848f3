"""Tiny random PEFT LoRA adapters on the tiny random Llama (``tiny_models``), for the LoRA tests
(docs/lora.md): ranks, alphas and target modules differ across them, one uses rsLoRA, and
every lora_B is random (PEFT initialises B to zeros, which would make an adapter a no-op)."""

import pathlib

import peft
import torch

from tests.tiny_models import save_tiny_model

# name -> PEFT LoraConfig fields
ADAPTERS = {
    "sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "chat": dict(r=8, lora_alpha=4, use_rslora=True,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj"]),
    "math": dict(r=2, lora_alpha=6, target_modules=["v_proj", "gate_proj", "up_proj",
                                                    "down_proj"]),
}
MAX_RANK = 8


def save_adapters(model, folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Each of ADAPTERS on ``model`` saved as a PEFT folder under ``folder``; name -> folder."""
    out = {}
    for i, (name, fields) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        wrapped = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **fields))
        with torch.no_grad():
            for pname, p in wrapped.named_parameters():
                if "lora_B" in pname:
                    p.copy_(0.2 * torch.randn_like(p))
        out[name] = folder / name
        wrapped.save_pretrained(out[name])
        wrapped.unload()  # the base model back, unchanged
    return out


def hf_logits(model, adapters: dict[str, pathlib.Path], ids: list[int]) -> dict:
    """name (None: the base model) -> [len(ids), V] float32 logits of ``ids`` through HF + PEFT
    in float32."""
    def run(m):
        with torch.no_grad():
            return m(torch.tensor([ids])).logits[0].numpy()

    out = {None: run(model)}
    for name, path in adapters.items():
        wrapped = peft.PeftModel.from_pretrained(model, path).eval()
        out[name] = run(wrapped)
        wrapped.unload()
    return out


def hf_logprobs(model, adapters: dict[str, pathlib.Path], ids: list[int]) -> dict:
    """name (None: the base model) -> [len(ids) - 1] float64 log-probabilities of ids[1:]
    teacher-forced through HF + PEFT in float32."""
    out = {}
    for name, logits in hf_logits(model, adapters, ids).items():
        lp = torch.log_softmax(torch.from_numpy(logits).double(), -1)
        out[name] = lp[torch.arange(len(ids) - 1), ids[1:]].numpy()
    return out


def tiny_llama_with_adapters(folder: pathlib.Path, tokenizer):
    """(HF model, name -> adapter folder) of the tiny Llama saved in ``folder / "base"``."""
    model = save_tiny_model("llama", folder / "base", tokenizer)
    return model, save_adapters(model, folder)


def save_bad_adapters(model, folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Adapters the server refuses, by why: "rank" (above MAX_RANK), "target" (the LM head),
    "shape" (made for a Llama of another hidden size), "missing" (no folder), "ia3" (PEFT's IA3,
    not LoRA), "peft_type" (LoRA tensors under a config saying IA3), "lora_bias" (PEFT's
    ``lora_bias``), "r0" (``r: 0`` in its config), "alpha" (no ``lora_alpha`` in its config)."""
    import json

    import transformers

    from tests.tiny_models import TINY

    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**TINY, "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4}))
    lora = lambda **fields: peft.LoraConfig(init_lora_weights=False, **fields)  # noqa: E731
    made = {"rank": (model, lora(r=2 * MAX_RANK, lora_alpha=8, target_modules=["q_proj"])),
            "target": (model, lora(r=2, lora_alpha=8, target_modules=["lm_head"])),
            "shape": (other, lora(r=2, lora_alpha=8, target_modules=["q_proj"])),
            "ia3": (model, peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                          feedforward_modules=["down_proj"])),
            "lora_bias": (model, lora(r=2, lora_alpha=8, target_modules=["q_proj"],
                                      lora_bias=True))}
    # A good adapter's config changed: what the change is, by why.
    edits = {"peft_type": {"peft_type": "IA3"}, "r0": {"r": 0}, "alpha": {"lora_alpha": None}}
    for why in edits:
        made[why] = (model, lora(r=2, lora_alpha=8, target_modules=["q_proj"]))
    out = {"missing": folder / "missing"}
    for why, (base, config) in made.items():
        wrapped = peft.get_peft_model(base, config)
        out[why] = folder / f"bad-{why}"
        wrapped.save_pretrained(out[why])
        wrapped.unload()
        if why in edits:
            path = out[why] / "adapter_config.json"
            fields = {**json.loads(path.read_text()), **edits[why]}
            path.write_text(json.dumps({k: v for k, v in fields.items() if v is not None}))
    return out
