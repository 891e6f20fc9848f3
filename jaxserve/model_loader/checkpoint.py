"""The one loaded-checkpoint contract every loader returns and the model code consumes."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


class LazyTensor:
    """A checkpoint tensor read from its file only when indexed (tensor-parallel loading).

    ``t[index]``, ``index`` a tuple of one ``slice`` per dimension (what
    ``jax.make_array_from_callback`` passes for each device), reads that part alone and returns
    it as a numpy array, so a device receives its slice without the whole tensor being read
    first where the format allows it (safetensors: from the file; GGUF: the rows' blocks).
    ``np.asarray(t)`` reads all of it.
    """

    def __init__(self, shape: tuple, dtype, read: Callable[[tuple], np.ndarray]):
        self.shape, self.dtype, self._read = tuple(shape), np.dtype(dtype), read

    def __getitem__(self, index: tuple) -> np.ndarray:
        return self._read(index)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self._read(tuple(slice(None) for _ in self.shape))
        return whole if dtype is None else whole.astype(dtype)


def row_slice(w, start: int, stop: int):
    """Rows ``start:stop`` of a checkpoint tensor (host array, device array or
    :class:`LazyTensor`); of a LazyTensor, another that reads only its part when indexed."""
    if not isinstance(w, LazyTensor):
        return w[start:stop]

    def read(index: tuple) -> np.ndarray:
        rows = range(start, stop)[index[0]]
        return w[(slice(rows.start, rows.stop, rows.step), *index[1:])]

    return LazyTensor((stop - start, *w.shape[1:]), w.dtype, read)


@dataclass
class Checkpoint:
    """A model checkpoint loaded into host memory, in Hugging Face terms.

    Attributes:
      name: the model's own name, e.g. ``"SmolLM2-135M-Instruct"`` (GGUF file stem without the
        quantization suffix, HF folder name, an orbax folder's source's name as converted, or
        dummy preset name). The engine serves a model under ``--model`` as given, and under
        this name only without one (the default model).
      hf_config: the content of a Hugging Face ``config.json`` (``architectures``, ``hidden_size``,
        ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
        ``num_hidden_layers``, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling``, ``vocab_size``,
        ``tie_word_embeddings``, ``max_position_embeddings``, ``bos_token_id``, ``eos_token_id``,
        ``torch_dtype``, ``attention_bias``, ...).
      weights: HF tensor name -> host array in HF/torch layout (``nn.Linear`` weight is
        ``[out_features, in_features]``, embedding ``[vocab, hidden]``, norms ``[hidden]``).
        float32, or ``ml_dtypes.bfloat16`` where a safetensors/orbax source stores bf16.
        ``lm_head.weight`` is absent when ``tie_word_embeddings`` is true. ``None`` for dummy.
        Loaded for a device mesh (``load_checkpoint(..., mesh=...)``): :class:`LazyTensor`
        values (safetensors, GGUF), or device arrays already split as the mesh needs (orbax).
      tokenizer: a ``transformers.PreTrainedTokenizerFast`` with ``chat_template`` set when the
        source has one (None when loaded ``with_tokenizer=False``).
    """

    name: str
    hf_config: dict
    weights: dict[str, np.ndarray] | None
    tokenizer: object | None  # transformers.PreTrainedTokenizerFast

    @property
    def architecture(self) -> str | None:
        """``architectures[0]``; None where the config names none (the engine then reads its
        ``model_type``: ``jaxserve.models.families.architecture``)."""
        return (self.hf_config.get("architectures") or [None])[0]


def log(msg: str) -> None:
    """One progress line on stderr."""
    print(f"[jaxserve load] {msg}", file=sys.stderr, flush=True)
