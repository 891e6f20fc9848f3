"""The tokenizer of a checkpoint written to a folder by a child process
(``python -m jaxserve.model_loader.tokenizer_export MODEL LOAD_FORMAT FOLDER``): the engine
process reads what it needs of it (``TokenizerVocab.read``) and never imports transformers,
whose modules and the conversion of a GGUF's tokenizer leave ~0.05 GiB of its heap behind.
"""

from __future__ import annotations

import os
import subprocess
import sys


def export_tokenizer(model: str, load_format: str, folder: str) -> str:
    """Write the tokenizer ``load_tokenizer_of(model, load_format)`` loads to ``folder`` in a
    child process (``save_tokenizer``'s layout); returns ``folder``.

    Raises:
      ValueError: the child failed; its last line of error output says why.
    """
    # The child never starts an accelerator: it only reads a checkpoint's tokenizer.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", __name__, model, load_format, folder],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise ValueError(f"cannot load the tokenizer of {model!r}: {lines[-1]}")
    return folder


def main(argv: list[str]) -> None:
    from jaxserve.model_loader.loader import load_tokenizer_of
    from jaxserve.tokenizer_io import save_tokenizer

    model, load_format, folder = argv
    save_tokenizer(load_tokenizer_of(model, load_format), folder)


if __name__ == "__main__":
    main(sys.argv[1:])
