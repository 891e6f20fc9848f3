"""The tokenizer of a checkpoint written to a folder by a child process
(``python -m jaxserve.model_loader.tokenizer_export MODEL LOAD_FORMAT FOLDER``): the engine
process reads what it needs of it (``TokenizerVocab.read``) and never imports transformers,
whose modules and the conversion of a GGUF's tokenizer leave ~0.05 GiB of its heap behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


class TokenizerExport:
    """The child process writing the tokenizer ``load_tokenizer_of(model, load_format)`` loads
    to ``folder`` (``save_tokenizer``'s layout); it runs from construction on.

    Args:
      model, load_format: the checkpoint, as ``load_tokenizer_of`` takes them.
      folder: where the tokenizer goes (made if missing).
    """

    def __init__(self, model: str, load_format: str, folder: str):
        self.model = model
        self.folder = folder
        self._stderr = tempfile.TemporaryFile("w+")  # a file: a full pipe would stall the child
        # The child never starts an accelerator: it only reads a checkpoint's tokenizer.
        self._child = subprocess.Popen(
            [sys.executable, "-m", __name__, model, load_format, folder],
            env=dict(os.environ, JAX_PLATFORMS="cpu"), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=self._stderr, text=True)

    def wait(self) -> str:
        """Blocks until the child is done; returns ``folder``.

        Raises:
          ValueError: the child failed (or was cancelled); its last line of error output says
            why.
        """
        code = self._child.wait()
        if code != 0:
            self._stderr.seek(0)
            lines = self._stderr.read().strip().splitlines() or [f"exit status {code}"]
            raise ValueError(f"cannot load the tokenizer of {self.model!r}: {lines[-1]}")
        return self.folder

    def cancel(self) -> None:
        """Ends the child now if it still runs, so that it writes nothing more to ``folder``
        (whose owner may be about to remove it: an engine whose start-up failed)."""
        self._child.kill()
        self._child.wait()


def main(argv: list[str]) -> None:
    from jaxserve.model_loader.loader import load_tokenizer_of
    from jaxserve.tokenizer_io import save_tokenizer

    model, load_format, folder = argv
    save_tokenizer(load_tokenizer_of(model, load_format), folder)


if __name__ == "__main__":
    main(sys.argv[1:])
