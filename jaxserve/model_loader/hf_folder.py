"""Hugging Face model folder <-> :class:`Checkpoint`.

Source format: a ``save_pretrained`` folder: ``config.json``, weights in one ``model.safetensors``
or shards listed by ``model.safetensors.index.json`` (``weight_map``) or any ``*.safetensors``,
tokenizer files (``tokenizer.json`` + ``tokenizer_config.json``, read by
``jaxserve.tokenizer_io.load_tokenizer``, local files only). Arrays keep the file's dtype
(float32/float16, bf16 as ``ml_dtypes.bfloat16``, F8_E4M3 as ``ml_dtypes.float8_e4m3fn``) and
torch layouts. A ModelOpt export whose config.json has no ``quantization_config`` keeps it in
``hf_quant_config.json``; that file's content becomes the ``quantization_config``
(``jaxserve.models.fp8_checkpoint`` reads both forms).
"""

from __future__ import annotations

import json
import pathlib
from functools import partial

import numpy as np

from jaxserve.tokenizer_io import load_tokenizer, save_tokenizer

from .checkpoint import Checkpoint, LazyTensor, log


def is_hf_folder(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def safetensors_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The weight files, in index order when an index exists."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    return sorted(folder.glob("*.safetensors"))


def load_hf_folder(folder: str | pathlib.Path, *, with_tokenizer: bool = True,
                   lazy: bool = False) -> Checkpoint:
    """Load config.json, all safetensors weights and (unless ``with_tokenizer`` is False) the
    tokenizer of an HF folder. ``lazy``: weights are :class:`LazyTensor` objects that read only the
    slice asked for from their file (a tensor-parallel device's part), nothing up front.

    Raises:
      ValueError: no weight files, a shard of the index missing, a file that is no valid
        safetensors file (truncated, a bad header: naming it), a dtype jaxserve does not read.
    """
    from safetensors import SafetensorError, safe_open

    folder = pathlib.Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    modelopt = folder / "hf_quant_config.json"
    if "quantization_config" not in cfg and modelopt.is_file():
        cfg["quantization_config"] = {"quant_method": "modelopt",
                                      **json.loads(modelopt.read_text())}
    files = safetensors_files(folder)
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files (expected an HF folder with config.json + *.safetensors)")
    log(f"{'indexing' if lazy else 'reading'} {len(files)} safetensors file(s) from {folder}")
    weights: dict[str, np.ndarray | LazyTensor] = {}
    for f in files:
        try:  # opening checks the header and that the file holds every tensor's bytes
            with safe_open(str(f), framework="np") as sf:
                for k in sf.keys():
                    sl = sf.get_slice(k)
                    dtype = _dtype_of(sl.get_dtype(), f, k)
                    # safetensors' numpy reader has no float8 dtypes: those read from the bytes.
                    read = (_read_slice if not sl.get_dtype().startswith("F8_") else
                            partial(_read_raw_slice, dtype, sl.get_shape()))
                    weights[k] = LazyTensor(sl.get_shape(), dtype, partial(read, str(f), k))
        except SafetensorError as e:
            raise ValueError(f"{f}: not a valid safetensors file ({e})") from None
    if not lazy:
        weights = {k: np.asarray(w) for k, w in weights.items()}
    return Checkpoint(name=folder.resolve().name, hf_config=cfg, weights=weights,
                      tokenizer=load_tokenizer(folder) if with_tokenizer else None)


def _dtype_of(safetensors_dtype: str, file, name: str) -> np.dtype:
    """safetensors' dtype names (F32, BF16, ...) -> numpy dtypes (bf16 and float8 as
    ml_dtypes'); the integer ones too, so that a checkpoint quantized otherwise is refused
    by its quantization_config, naming the field.

    Raises:
      ValueError: a dtype numpy cannot hold (F8_E8M0, ...), naming the file and the tensor.
    """
    import ml_dtypes

    names = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
             "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
             "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
             "I16": np.int16, "I8": np.int8, "U16": np.uint16, "U8": np.uint8,
             "BOOL": np.bool_}
    if safetensors_dtype not in names:
        raise ValueError(f"{file}: tensor {name} has dtype {safetensors_dtype}, which jaxserve "
                         f"does not read")
    return np.dtype(names[safetensors_dtype])


def _read_slice(file: str, name: str, index: tuple) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(file, framework="np") as sf:
        return sf.get_slice(name)[index]


def _read_raw_slice(dtype: np.dtype, shape: list, file: str, name: str,
                    index: tuple) -> np.ndarray:
    """A slice of a tensor read from its bytes: the file's 8-byte little-endian header size,
    its JSON header (``data_offsets`` from the end of the header), then the data (safetensors'
    layout, row-major)."""
    with open(file, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        start = json.loads(fh.read(size))[name]["data_offsets"][0]
    data = np.memmap(file, dtype=dtype, mode="r", offset=8 + size + start, shape=tuple(shape))
    return np.array(data[index])


def save_hf_folder(folder: str | pathlib.Path, ckpt: Checkpoint) -> pathlib.Path:
    """Write ``config.json``, ``model.safetensors`` (torch metadata, so transformers loads it)
    and the tokenizer files (``save_pretrained``) of ``ckpt`` into ``folder``."""
    from safetensors.numpy import save_file

    if ckpt.weights is None:
        raise ValueError("cannot save a checkpoint without weights (dummy) as an HF folder")
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(ckpt.hf_config, indent=2) + "\n")
    log(f"writing {folder / 'model.safetensors'}")
    save_file({k: np.ascontiguousarray(v) for k, v in ckpt.weights.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(ckpt.tokenizer, folder)
    return folder
