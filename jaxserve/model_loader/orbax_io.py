"""jaxserve's orbax checkpoint folder <-> :class:`Checkpoint`.

Layout (our own; orbax-checkpoint ``StandardCheckpointer`` for the arrays)::

    PATH/jaxserve_checkpoint.json   marker: {"format": "jaxserve-orbax", "version": 1, "name": ...}
    PATH/config.json                HF config
    PATH/tokenizer/                 tokenizer.save_pretrained(...)
    PATH/weights/                   orbax pytree

HF names contain dots, which orbax uses as its own path separator on disk, so the flat
``{"model.layers.0.self_attn.q_proj.weight": w}`` dict is stored as the nested pytree
``{"model": {"layers": {"0": {"self_attn": {"q_proj": {"weight": w}}}}}}``
(``flax.traverse_util.unflatten_dict(..., sep=".")``) and flattened back with dots on restore
(no HF name is a prefix of another, so this is lossless).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from .checkpoint import Checkpoint, log

MARKER = "jaxserve_checkpoint.json"
FORMAT = "jaxserve-orbax"


def is_orbax_folder(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / MARKER).is_file()


def save_orbax(path: str | pathlib.Path, ckpt: Checkpoint) -> pathlib.Path:
    """Save ``ckpt`` (weights, config, tokenizer) as a jaxserve orbax folder at ``path``
    (which must not exist or be empty)."""
    import orbax.checkpoint as ocp

    from jaxserve.tokenizer_io import save_tokenizer

    if ckpt.weights is None:
        raise ValueError("cannot save a checkpoint without weights (dummy) as orbax")
    path = pathlib.Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path}: output folder exists and is not empty")
    path.mkdir(parents=True, exist_ok=True)
    log(f"writing orbax checkpoint {path} ({len(ckpt.weights)} tensors)")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "weights", unflatten_dict(ckpt.weights, sep="."))
    (path / "config.json").write_text(json.dumps(ckpt.hf_config, indent=2) + "\n")
    save_tokenizer(ckpt.tokenizer, path / "tokenizer")
    (path / MARKER).write_text(json.dumps({"format": FORMAT, "version": 1, "name": ckpt.name}) + "\n")
    return path


def load_orbax(path: str | pathlib.Path, *, with_tokenizer: bool = True,
               mesh=None) -> Checkpoint:
    """Restore a folder written by :func:`save_orbax`; weights come back as numpy arrays with
    the dtypes they were saved with (the tokenizer None if ``with_tokenizer`` is False).

    ``mesh`` (a tensor-parallel ``jax.sharding.Mesh``): each weight is restored straight into
    the split the model needs on it (``jaxserve.models.sharding.hf_sharding``), so every device
    reads only its part and no device holds the whole model.
    """
    import orbax.checkpoint as ocp

    from jaxserve.tokenizer_io import load_tokenizer

    path = pathlib.Path(path).absolute()
    marker = json.loads((path / MARKER).read_text())
    if marker.get("format") != FORMAT:
        raise ValueError(f"{path}: {MARKER} does not describe a {FORMAT} checkpoint")
    log(f"restoring orbax checkpoint {path}" + ("" if mesh is None else
                                               f" split over {mesh.size} devices"))
    with ocp.StandardCheckpointer() as ckptr:
        if mesh is None:
            tree = ckptr.restore(path / "weights")
        else:
            tree = ckptr.restore(path / "weights", _restore_targets(ckptr, path / "weights", mesh))
    weights = {name: w if mesh is not None else np.asarray(w)
               for name, w in flatten_dict(tree, sep=".").items()}
    return Checkpoint(name=marker.get("name") or path.name,
                      hf_config=json.loads((path / "config.json").read_text()),
                      weights=weights,
                      tokenizer=load_tokenizer(path / "tokenizer") if with_tokenizer else None)


def _restore_targets(ckptr, weights_dir: pathlib.Path, mesh) -> dict:
    """The saved tree as ``jax.ShapeDtypeStruct`` values carrying each tensor's target sharding."""
    import jax

    from jaxserve.models.sharding import hf_sharding

    saved = flatten_dict(ckptr.metadata(weights_dir).item_metadata.tree, sep=".")
    return unflatten_dict({
        name: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=hf_sharding(name, m.shape, mesh))
        for name, m in saved.items()}, sep=".")
