"""``load_checkpoint``: one entry point that picks the loader for a model path or preset."""

from __future__ import annotations

import pathlib

from .checkpoint import Checkpoint
from .dummy import PRESETS, default_tokenizer, load_dummy
from .gguf_loader import is_gguf, load_gguf
from .hf_folder import is_hf_folder, load_hf_folder
from .orbax_io import MARKER, is_orbax_folder, load_orbax
from .text_only import text_only

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


def resolve_model(model: str | None, load_format: str = "auto") -> tuple[str, str]:
    """The model source and its format, checked: ``(path or dummy preset/config, format)``.
    ``model=None`` is the default model (its GGUF, fetched if missing; with ``dummy``, the
    SmolLM2 preset).

    Raises:
      ValueError: unknown ``load_format`` or a path that does not hold what that format needs.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if model is None:
        if load_format == "dummy":
            return "smollm2-135m", "dummy"
        # Imported where used, as in dummy.py and generation_config.py: the package must not
        # import it, or ``python -m jaxserve.model_loader.default_model`` runs a second copy.
        from .default_model import default_model_path

        model, load_format = str(default_model_path()), "gguf" if load_format == "auto" else load_format
    if load_format == "dummy":
        return str(model), "dummy"
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
    return str(path), load_format


def load_checkpoint(model: str | None, load_format: str = "auto", *,
                    with_tokenizer: bool = True, mesh=None) -> Checkpoint:
    """Load a checkpoint.

    Args:
      model: None for the default model (SmolLM2-135M-Instruct GGUF, fetched if missing); a
        ``.gguf`` file; an HF folder; a jaxserve orbax folder; with ``load_format="dummy"`` a
        preset name (:data:`PRESETS`) or a ``config.json`` path.
      load_format: ``auto`` (detect), ``gguf``, ``safetensors``, ``orbax`` or ``dummy``.
      with_tokenizer: False leaves ``tokenizer`` None (``load_tokenizer_of`` loads it apart).
      mesh: a tensor-parallel ``jax.sharding.Mesh``: weights are loaded per device part, never
        whole on one device: :class:`LazyTensor` objects read slice by slice (safetensors, GGUF), or
        device arrays restored already split (orbax).
    Returns:
      :class:`Checkpoint`; of a vision-language model, its language model (``text_only``).
    Raises:
      ValueError: as ``resolve_model``.
    """
    source, fmt = resolve_model(model, load_format)
    if fmt == "dummy":
        return load_dummy(source, with_tokenizer=with_tokenizer)
    if fmt == "orbax":
        return load_orbax(source, with_tokenizer=with_tokenizer, mesh=mesh)
    loader = {"gguf": load_gguf, "safetensors": load_hf_folder}[fmt]
    return text_only(loader(source, with_tokenizer=with_tokenizer, lazy=mesh is not None))


def load_tokenizer_of(model: str | None, load_format: str = "auto"):
    """The tokenizer of the checkpoint ``load_checkpoint`` would load (same arguments), alone:
    the engine loads it on a thread while the parameters are built and compiled."""
    source, fmt = resolve_model(model, load_format)
    if fmt == "dummy":
        return default_tokenizer()
    if fmt == "gguf":
        return load_gguf(source, with_weights=False).tokenizer
    from jaxserve.tokenizer_io import load_tokenizer

    return load_tokenizer(pathlib.Path(source) / "tokenizer" if fmt == "orbax" else source)
