"""jaxserve's orbax checkpoint folder <-> :class:`Checkpoint`.

Layout (our own; orbax-checkpoint ``StandardCheckpointer`` for the arrays)::

    PATH/jaxserve_checkpoint.json   marker: {"format": "jaxserve-orbax", "version": 1, "name": ...}
    PATH/config.json                HF config
    PATH/tokenizer/                 tokenizer.save_pretrained(...)
    PATH/weights/                   orbax pytree

HF names contain dots, which orbax uses as its own path separator on disk, so the flat
``{"model.layers.0.self_attn.q_proj.weight": w}`` dict is stored as the nested pytree
``{"model": {"layers": {"0": {"self_attn": {"q_proj": {"weight": w}}}}}}`` and flattened back with
dots on restore (no HF name is a prefix of another, so this is lossless).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from .checkpoint import Checkpoint, log

MARKER = "jaxserve_checkpoint.json"
FORMAT = "jaxserve-orbax"


def is_orbax_folder(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / MARKER).is_file()


def nest(flat: dict[str, np.ndarray]) -> dict:
    """``{"a.b.c": x}`` -> ``{"a": {"b": {"c": x}}}``."""
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"tensor name {key!r} clashes with another tensor name")
        if leaf in node:
            raise ValueError(f"tensor name {key!r} clashes with another tensor name")
        node[leaf] = value
    return tree


def flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """Inverse of :func:`nest`."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = np.asarray(v)
    return out


def save_orbax(path: str | pathlib.Path, ckpt: Checkpoint) -> pathlib.Path:
    """Save ``ckpt`` (weights, config, tokenizer) as a jaxserve orbax folder at ``path``
    (which must not exist or be empty)."""
    import orbax.checkpoint as ocp

    from .hf_folder import save_tokenizer

    if ckpt.weights is None:
        raise ValueError("cannot save a checkpoint without weights (dummy) as orbax")
    path = pathlib.Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path}: output folder exists and is not empty")
    path.mkdir(parents=True, exist_ok=True)
    log(f"writing orbax checkpoint {path} ({len(ckpt.weights)} tensors)")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "weights", nest(ckpt.weights))
    (path / "config.json").write_text(json.dumps(ckpt.hf_config, indent=2) + "\n")
    save_tokenizer(ckpt.tokenizer, path / "tokenizer")
    (path / MARKER).write_text(json.dumps({"format": FORMAT, "version": 1, "name": ckpt.name}) + "\n")
    return path


def load_orbax(path: str | pathlib.Path) -> Checkpoint:
    """Restore a folder written by :func:`save_orbax`; weights come back as numpy arrays with
    the dtypes they were saved with."""
    import orbax.checkpoint as ocp

    from .hf_folder import load_tokenizer

    path = pathlib.Path(path).absolute()
    marker = json.loads((path / MARKER).read_text())
    if marker.get("format") != FORMAT:
        raise ValueError(f"{path}: {MARKER} does not describe a {FORMAT} checkpoint")
    log(f"restoring orbax checkpoint {path}")
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(path / "weights")
    return Checkpoint(name=marker.get("name") or path.name,
                      hf_config=json.loads((path / "config.json").read_text()),
                      weights=flatten(tree), tokenizer=load_tokenizer(path / "tokenizer"))
