"""The model's sampling defaults: what fills in the sampling fields a request leaves out
(vLLM's ``--generation-config``).

``auto`` (the default) reads the model's own ``generation_config.json`` (in an HF folder, or
an orbax folder holding one) and keeps the fields vLLM keeps: temperature, top_p, top_k,
min_p, repetition_penalty and max_new_tokens (as max_tokens); the default model, a GGUF
without one, gets the chat defaults of its model card (``default_model.GENERATION_CONFIG``).
``vllm`` uses none (SamplingParams' own defaults: temperature 1.0, no top-p / top-k). A folder
path reads that folder's ``generation_config.json``.
"""

from __future__ import annotations

import json
import pathlib

from jaxserve.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# HF generation_config.json key -> SamplingParams field.
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(hf_config: dict) -> dict:
    """The sampling defaults of an HF generation config dict, in SamplingParams' names.

    Raises:
      ValueError: a value SamplingParams refuses (the message names the field).
    """
    out = {_FIELDS[k]: v for k, v in hf_config.items() if k in _FIELDS and v is not None}
    SamplingParams(**out)  # refuse now what every request would be refused for
    return out


def hf_generation_config(defaults: dict) -> dict:
    """The ``generation_config.json`` dict of sampling defaults in SamplingParams' names (the
    inverse of ``sampling_defaults``), with ``do_sample`` so that transformers samples too."""
    hf_name = {ours: hf for hf, ours in _FIELDS.items()}
    out = {hf_name[k]: v for k, v in defaults.items()}
    if out:
        out["do_sample"] = defaults.get("temperature", 1.0) > 0
    return out


def _read(folder: pathlib.Path) -> dict:
    path = folder / GENERATION_CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def load_generation_config(source: str, fmt: str, mode: str = "auto") -> dict:
    """The sampling defaults for a model (``resolve_model``'s source and format).

    Args:
      mode: "auto", "vllm", or a folder holding a generation_config.json.

    Raises:
      ValueError: naming --generation-config, for a folder without the file or values
        SamplingParams refuses.
    """
    if mode == "vllm":
        return {}
    try:
        if mode != "auto":
            folder = pathlib.Path(mode).expanduser()
            if not (folder / GENERATION_CONFIG_FILE).is_file():
                raise ValueError(f"{mode!r} is not 'auto', 'vllm' or a folder holding "
                                 f"{GENERATION_CONFIG_FILE}")
            return sampling_defaults(_read(folder))
        if fmt in ("safetensors", "orbax"):
            return sampling_defaults(_read(pathlib.Path(source)))
        if fmt == "gguf":
            from .default_model import GENERATION_CONFIG, is_default_model  # (loader.py: why here)

            return dict(GENERATION_CONFIG) if is_default_model(source) else {}
        return {}
    except (ValueError, OSError) as e:
        raise ValueError(f"--generation-config: {e}") from None
