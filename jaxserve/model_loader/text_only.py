"""Vision-language checkpoints served text-only: Gemma 3's ``Gemma3ForConditionalGeneration``
(Gemma-3-4B and larger) as the ``Gemma3ForCausalLM`` its language model is.

The language model's config is the nested ``text_config`` (HF fills the keys it leaves out
with ``Gemma3TextConfig``'s defaults: ``jaxserve.models.families.gemma``), with the top level's token ids,
embedding tie and quantization config; its tensors are those under ``language_model.model.``
(the published layout) or ``model.language_model.`` (transformers 5's), renamed to the causal
LM's ``model.``; the vision tower and the projector are left out.
"""

from __future__ import annotations

import dataclasses

from .checkpoint import Checkpoint, log

_LANGUAGE_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# Keys of the top-level config that hold for the language model too.
_SHARED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings",
                "quantization_config", "torch_dtype")
# Tensor-name prefixes of the language model -> the causal LM's.
_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
             ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def text_only(ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` itself, or for a vision-language architecture its language model alone."""
    causal = _LANGUAGE_MODELS.get(ckpt.architecture)
    if causal is None:
        return ckpt
    cfg = ckpt.hf_config
    config = {**cfg.get("text_config", {}), **{k: cfg[k] for k in _SHARED_KEYS if k in cfg},
              "architectures": [causal]}
    weights = ckpt.weights
    if weights is not None:
        weights = {new: w for name, w in weights.items()
                   if (new := _language_model_name(name)) is not None}
    log(f"{ckpt.architecture}: serving its language model ({causal}), text only")
    return dataclasses.replace(ckpt, hf_config=config, weights=weights)


def _language_model_name(name: str) -> str | None:
    """The causal LM's name of a language-model tensor; None for the vision parts."""
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return None
