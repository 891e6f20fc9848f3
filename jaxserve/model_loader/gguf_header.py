"""A GGUF file's header (model name, HF config, tokenizer, tensor table), parsed once: per
process, and on disk for later processes.

gguf's ``GGUFReader`` builds every array field element by element in Python: seconds for a
49k-token vocabulary and its merges, and an engine asks for the file twice at start-up (the
tokenizer thread and the checkpoint load). ``read_header`` parses under a lock that the two
share, and writes what it found to ``$JAXSERVE_CACHE/gguf/<key>/``; a process that finds that
folder reads no GGUF field at all and maps the tensors' bytes straight from the file.

Cache folder: ``header.json`` (``name``, ``architecture``, ``hf_config``, ``tensors``: one entry per tensor with
its GGUF ``type`` and ``shape`` (innermost first) and the ``offset`` / ``dtype`` / ``data_shape``
of the raw view ``GGUFReader`` gives for it) and ``tokenizer/`` (``tokenizer_io.save_tokenizer``).
The key hashes the file's resolved path, size and modification time: a rewritten file is parsed
again.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
import tempfile
import threading
from dataclasses import dataclass

import numpy as np

from .checkpoint import log

FORMAT = 1  # bump when header.json's content changes


@dataclass
class GGUFTensor:
    """One tensor of the file, as ``GGUFReader``'s ``ReaderTensor`` gives it.

    Attributes:
      name: GGUF name, e.g. ``blk.0.attn_q.weight``.
      tensor_type: ``gguf.GGMLQuantizationType`` value.
      shape: GGUF dimensions, innermost first.
      data: read-only memory map of the file: the values (float/int types) or the block bytes
        (uint8, ``[rows, bytes per row]``) for quantized types.
    """

    name: str
    tensor_type: int
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass
class GGUFHeader:
    """What a load needs from the file besides the tensor bytes.

    Attributes:
      name: the model's name (file stem without the quantization suffix).
      architecture: GGUF ``general.architecture`` (``llama`` for Mistral files too).
      hf_config: HF ``config.json`` content.
      tensors: GGUF name -> :class:`GGUFTensor`.
      tokenizer_dir: a ``save_tokenizer`` folder with the file's tokenizer.
    """

    name: str
    architecture: str
    hf_config: dict
    tensors: dict[str, GGUFTensor]
    tokenizer_dir: pathlib.Path


_lock = threading.Lock()
# The latest file's header.json content and tokenizer folder, by file identity. Its tensors are
# mapped again for each caller, so that no mapping outlives the load that reads it (a kept one
# holds the pages it read: 0.09 GiB of RSS for the default model).
_parsed: dict[tuple, tuple[dict, pathlib.Path]] = {}


def read_header(path: pathlib.Path) -> GGUFHeader:
    """The header of the GGUF file ``path``: from this process's last read of the same file, from
    the cache folder, or parsed (and then cached).

    Raises:
      ValueError: a file cut short (``gguf_reader.BoundedReader``, naming the tensor past its
        end), or an unsupported architecture or tokenizer (as ``build_hf_config`` /
        ``build_tokenizer``).
    """
    path = pathlib.Path(path).resolve()
    st = path.stat()
    identity = (str(path), st.st_size, st.st_mtime_ns)
    with _lock:
        if identity not in _parsed:
            folder = _cache_root() / hashlib.sha256(repr(identity).encode()).hexdigest()[:32]
            found = _load(folder) or _parse_and_save(path, folder)
            _parsed.clear()
            _parsed[identity] = found
        saved, tokenizer_dir = _parsed[identity]
    return _mapped(path, saved, tokenizer_dir)


def _cache_root() -> pathlib.Path:
    from .default_model import cache_dir  # (loader.py says why here)

    return cache_dir() / "gguf"


def _load(folder: pathlib.Path) -> tuple[dict, pathlib.Path] | None:
    """(header.json's content, the tokenizer folder) saved in ``folder``, or None where there is
    none of this format."""
    try:
        saved = json.loads((folder / "header.json").read_text())
    except (OSError, ValueError):
        return None
    if saved.get("format") != FORMAT:
        return None
    return saved, folder / "tokenizer"


def _mapped(path: pathlib.Path, saved: dict, tokenizer_dir: pathlib.Path) -> GGUFHeader:
    """The header of ``saved`` (header.json's content) with its tensors mapped from ``path``."""
    file = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for t in saved["tensors"]:
        dtype, shape = np.dtype(t["dtype"]), tuple(t["data_shape"])
        raw = file[t["offset"]:t["offset"] + dtype.itemsize * int(np.prod(shape))]
        tensors[t["name"]] = GGUFTensor(t["name"], t["type"], tuple(t["shape"]),
                                        raw.view(dtype).reshape(shape))
    return GGUFHeader(saved["name"], saved["architecture"], saved["hf_config"], tensors,
                      tokenizer_dir)


def _parse_and_save(path: pathlib.Path, folder: pathlib.Path) -> tuple[dict, pathlib.Path]:
    """Parse the file (``gguf_reader.BoundedReader``), save its header.json and tokenizer in ``folder`` (or a
    temporary folder where the cache cannot be written); (header.json's content, the tokenizer
    folder)."""
    from gguf.quants import dequantize

    from jaxserve.tokenizer_io import save_tokenizer

    from .gguf_loader import build_hf_config, model_name, read_metadata
    from .gguf_reader import BoundedReader
    from .gguf_tokenizer import build_tokenizer

    log(f"parsing GGUF header of {path}")
    reader = BoundedReader(path)
    meta = read_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    raw = {}
    if "rope_freqs.weight" in by_name:
        t = by_name["rope_freqs.weight"]
        raw["rope_freqs.weight"] = dequantize(t.data, t.tensor_type).astype(np.float32)
    tokenizer = build_tokenizer({k: v for k, v in meta.items() if k.startswith("tokenizer.")})
    saved = {"format": FORMAT, "name": model_name(path, meta),
             "architecture": meta["general.architecture"],
             "hf_config": build_hf_config(meta, set(by_name), raw), "tensors": [
        {"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
         "offset": int(t.data_offset), "dtype": t.data.dtype.str, "data_shape": list(t.data.shape)}
        for t in reader.tensors]}
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    except OSError as e:  # a read-only cache folder: keep this process's copy only
        log(f"cannot cache the GGUF header under {folder.parent} ({e}); keeping it in a temporary folder")
        tmp = folder = pathlib.Path(tempfile.mkdtemp(prefix="jaxserve-gguf-"))
    save_tokenizer(tokenizer, tmp / "tokenizer")
    (tmp / "header.json").write_text(json.dumps(saved) + "\n")
    if tmp != folder:
        try:
            tmp.replace(folder)
        except OSError:  # another process cached it first
            shutil.rmtree(tmp, ignore_errors=True)
    return saved, folder / "tokenizer"
