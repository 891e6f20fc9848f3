"""Checkpoint loading: GGUF / HF safetensors folder / orbax / dummy -> :class:`Checkpoint`."""

from .checkpoint import Checkpoint
from .dummy import PRESETS as DUMMY_PRESETS, default_tokenizer
from .generation_config import load_generation_config
from .gguf_loader import load_gguf
from .hf_folder import load_hf_folder, save_hf_folder
from .loader import LOAD_FORMATS, detect_format, load_checkpoint, load_tokenizer_of, resolve_model
from .orbax_io import load_orbax, save_orbax

__all__ = ["Checkpoint", "DUMMY_PRESETS", "LOAD_FORMATS", "default_tokenizer", "detect_format",
           "load_checkpoint", "load_generation_config", "load_gguf", "load_hf_folder",
           "load_orbax", "load_tokenizer_of", "resolve_model", "save_hf_folder", "save_orbax"]
