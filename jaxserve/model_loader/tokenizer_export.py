"""The tokenizer of a checkpoint as a folder in ``save_tokenizer``'s layout, kept in
``$JAXSERVE_CACHE/tokenizers/`` for later starts. A child process writes it the first time
(``python -m jaxserve.model_loader.tokenizer_export MODEL LOAD_FORMAT FOLDER``): the engine
process reads what it needs of it (``TokenizerVocab.read``) and never imports transformers,
whose modules and the conversion of a GGUF's tokenizer leave ~0.05 GiB of its heap behind. A
later start of the same checkpoint finds the folder and starts no child.

Folder name: ``<load format>-<key>``; the key hashes the checkpoint's resolved path, the name,
size and modification time of its files (the file itself, or the files at the top of its folder
and of its ``tokenizer/`` folder), the installed transformers version and ``FORMAT``: a changed
checkpoint or library gets a folder of its own. The child writes into ``<folder>.part-*`` and
the folder appears by one rename, so a folder that exists is whole.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

FORMAT = 1  # bump when save_tokenizer's layout changes
STALE_PART_S = 600  # a part folder this old belongs to a start that was killed mid-export


def _identity(model: str, load_format: str) -> list:
    """What the folder's key hashes (the module docstring's list)."""
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = None
    head = [FORMAT, load_format, transformers]
    if load_format == "dummy":  # every dummy model borrows the default model's tokenizer
        return head
    path = pathlib.Path(model).resolve()
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for d in (path, path / "tokenizer") if d.is_dir()
                       for p in d.iterdir() if p.is_file())
    return head + [str(path)] + [(str(p.relative_to(path.parent)), p.stat().st_size,
                                  p.stat().st_mtime_ns) for p in files]


def tokenizer_folder(model: str, load_format: str) -> pathlib.Path:
    """Where the tokenizer of the checkpoint (as ``resolve_model`` gives it) is kept."""
    from .default_model import cache_dir  # (loader.py says why here)

    key = hashlib.sha256(repr(_identity(model, load_format)).encode()).hexdigest()[:32]
    return cache_dir() / "tokenizers" / f"{load_format}-{key}"


class TokenizerExport:
    """The tokenizer ``load_tokenizer_of(model, load_format)`` loads, as a folder: the kept one
    (``tokenizer_folder``), or one a child process writes, from construction on. Where the
    cache cannot be written, the child writes a temporary folder that goes with this object.

    Args:
      model, load_format: the checkpoint, as ``load_tokenizer_of`` takes them.

    Attributes:
      folder: the tokenizer's folder (whole once ``wait`` returns).
      kept: the folder was there already (no child runs).
    """

    def __init__(self, model: str, load_format: str):
        self.model = model
        self.folder = tokenizer_folder(model, load_format)
        self._child = self._part = self._temporary = None
        self.kept = self.folder.is_dir()  # from an earlier start: no child
        if self.kept:
            return
        try:
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_parts(self.folder)
            self._part = pathlib.Path(tempfile.mkdtemp(prefix=f"{self.folder.name}.part-",
                                                       dir=self.folder.parent))
            target = self._part
        except OSError:
            self._temporary = tempfile.TemporaryDirectory(prefix="jaxserve-tokenizer-",
                                                          ignore_cleanup_errors=True)
            target = self.folder = pathlib.Path(self._temporary.name)
        self._stderr = tempfile.TemporaryFile("w+")  # a file: a full pipe would stall the child
        # The child never starts an accelerator: it only reads a checkpoint's tokenizer.
        self._child = subprocess.Popen(
            [sys.executable, "-m", __name__, model, load_format, str(target)],
            env=dict(os.environ, JAX_PLATFORMS="cpu"), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=self._stderr, text=True)

    def wait(self) -> str:
        """Blocks until the folder is whole; returns it.

        Raises:
          ValueError: the child failed (or was cancelled); its last line of error output says
            why.
        """
        if self._child is None:
            return str(self.folder)
        code = self._child.wait()
        if code != 0:
            self._remove_part()
            self._stderr.seek(0)
            lines = self._stderr.read().strip().splitlines() or [f"exit status {code}"]
            raise ValueError(f"cannot load the tokenizer of {self.model!r}: {lines[-1]}")
        if self._part is not None:
            try:
                self._part.rename(self.folder)
            except OSError:  # another start of the same checkpoint kept its folder first
                self._remove_part()
            self._part = None
        return str(self.folder)

    def cancel(self) -> None:
        """Ends the child now if it still runs, and removes what it wrote of the folder."""
        if self._child is not None:
            self._child.kill()
            self._child.wait()
        self._remove_part()

    def _remove_part(self) -> None:
        if self._part is not None:
            shutil.rmtree(self._part, ignore_errors=True)
            self._part = None


def _remove_stale_parts(folder: pathlib.Path) -> None:
    """Remove part folders of ``folder`` left by starts that were killed mid-export."""
    for part in folder.parent.glob(f"{folder.name}.part-*"):
        try:
            if time.time() - part.stat().st_mtime > STALE_PART_S:
                shutil.rmtree(part, ignore_errors=True)
        except OSError:  # removed meanwhile by another start
            pass


def main(argv: list[str]) -> None:
    from jaxserve.model_loader.loader import load_tokenizer_of
    from jaxserve.tokenizer_io import save_tokenizer

    model, load_format, folder = argv
    save_tokenizer(load_tokenizer_of(model, load_format), folder)


if __name__ == "__main__":
    main(sys.argv[1:])
