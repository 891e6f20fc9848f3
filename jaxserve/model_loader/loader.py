"""``load_checkpoint``: one entry point that picks the loader for a model path or preset."""

from __future__ import annotations

import pathlib

from .checkpoint import Checkpoint
from .dummy import PRESETS, load_dummy
from .gguf_loader import is_gguf, load_gguf
from .hf_folder import is_hf_folder, load_hf_folder
from .orbax_io import MARKER, is_orbax_folder, load_orbax

LOAD_FORMATS = ("auto", "gguf", "safetensors", "orbax", "dummy")


def detect_format(path: pathlib.Path) -> str:
    """``gguf`` / ``orbax`` / ``safetensors`` for a usable path; ``ValueError`` otherwise."""
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist (expected a .gguf file, an HF folder, "
                         f"an orbax folder, or a dummy preset with load_format='dummy')")
    if is_gguf(path):
        return "gguf"
    if is_orbax_folder(path):
        return "orbax"
    if is_hf_folder(path):
        return "safetensors"
    raise ValueError(f"model path {str(path)!r} is not a GGUF file, an HF folder (config.json + "
                     f"*.safetensors) or a jaxserve orbax folder ({MARKER})")


def load_checkpoint(model: str | None, load_format: str = "auto") -> Checkpoint:
    """Load a checkpoint.

    Args:
      model: None for the default model (SmolLM2-135M-Instruct GGUF, fetched if missing); a
        ``.gguf`` file; an HF folder; a jaxserve orbax folder; with ``load_format="dummy"`` a
        preset name (:data:`PRESETS`) or a ``config.json`` path.
      load_format: ``auto`` (detect), ``gguf``, ``safetensors``, ``orbax`` or ``dummy``.
    Returns:
      :class:`Checkpoint`.
    Raises:
      ValueError: unknown ``load_format`` or a path that does not hold what that format needs.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if model is None:
        from checkpoints_tools.fetch_default import default_model_path

        if load_format == "dummy":
            return load_dummy("smollm2-135m")
        model, load_format = str(default_model_path()), "gguf" if load_format == "auto" else load_format
    if load_format == "dummy":
        return load_dummy(str(model))
    path = pathlib.Path(model).expanduser()
    if load_format == "auto":
        if not path.exists() and str(model).lower() in PRESETS:
            raise ValueError(f"{model!r} is a dummy preset: use load_format='dummy' (--load-format dummy)")
        load_format = detect_format(path)
    checks = {"gguf": (is_gguf, "a GGUF file"),
              "safetensors": (is_hf_folder, "an HF folder with config.json and *.safetensors"),
              "orbax": (is_orbax_folder, f"a jaxserve orbax folder with {MARKER}")}
    ok, expected = checks[load_format]
    if not ok(path):
        raise ValueError(f"model path {str(path)!r} is not {expected} (load_format={load_format!r})")
    return {"gguf": load_gguf, "safetensors": load_hf_folder, "orbax": load_orbax}[load_format](path)
