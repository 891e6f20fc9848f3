"""Convert checkpoints: GGUF or HF folder -> jaxserve orbax folder; GGUF -> HF folder.

    python -m checkpoints_tools.convert --input MODEL.gguf --output OUT_DIR [--to orbax|hf]
    python -m checkpoints_tools.convert --input HF_FOLDER --output OUT_DIR          # orbax
    python -m checkpoints_tools.convert --input MODEL.gguf --output OUT_DIR --to hf --num-layers 4

``--num-layers N`` keeps the model's first N decoder layers (its embedding, final norm and head
unchanged): the default model cut this way is the speculative decoding draft model where no
smaller model of its tokenizer exists (docs/spec_decode.md).

The HF folder written from a GGUF (config.json, model.safetensors in float32 with Q/K rows
un-permuted, tokenizer.json/tokenizer_config.json with the chat template) loads in HF transformers
(``AutoModelForCausalLM.from_pretrained``) as well as in jaxserve. Either output holds the input's
sampling defaults as a ``generation_config.json`` (the default model's chat defaults for its GGUF;
an HF folder's own file) where it has any.

Exit status: 0 done; 1 an input that does not load (the engine's own checks,
``jaxserve.models.registry.check_checkpoint``, run on it first, so what is written serves) or an
output that cannot be written (one line on stderr); 2 a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m checkpoints_tools.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="a .gguf file or an HF folder (config.json + *.safetensors)")
    p.add_argument("--output", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--to", choices=("orbax", "hf"), default="orbax", help="output format (default: orbax)")
    p.add_argument("--num-layers", type=int, help="keep only the first N decoder layers (a draft model)")
    return p


def first_layers(ckpt, n: int):
    """The Checkpoint of ``ckpt``'s first n decoder layers (``model.layers.{i}.*`` with i < n),
    its other weights unchanged.

    Raises:
      ValueError: n not in [1, the model's layers].
    """
    total = ckpt.hf_config["num_hidden_layers"]
    if not 1 <= n <= total:
        raise ValueError(f"must be in [1, {total}], got {n}")
    layer = re.compile(r"model\.layers\.(\d+)\.")
    weights = {k: v for k, v in ckpt.weights.items()
               if (m := layer.match(k)) is None or int(m.group(1)) < n}
    return dataclasses.replace(ckpt, name=f"{ckpt.name}-{n}-layers", weights=weights,
                               hf_config={**ckpt.hf_config, "num_hidden_layers": n})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from jaxserve.model_loader import detect_format, load_checkpoint, save_hf_folder, save_orbax
    from jaxserve.model_loader.generation_config import (GENERATION_CONFIG_FILE,
                                                         hf_generation_config,
                                                         load_generation_config)
    from jaxserve.models.fp8_checkpoint import resolve_method
    from jaxserve.models.registry import check_checkpoint

    src, out = pathlib.Path(args.input).expanduser(), pathlib.Path(args.output).expanduser()
    try:
        fmt = detect_format(src)
    except ValueError as e:
        parser.error(f"--input: {e}")
    if fmt == "orbax":
        parser.error(f"--input: {src} is already a jaxserve orbax checkpoint")
    if args.to == "hf" and fmt != "gguf":
        parser.error(f"--to hf: only a GGUF --input can be converted to an HF folder ({src} is {fmt})")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        parser.error(f"--output: {out} exists and is not an empty folder")
    t0 = time.perf_counter()
    print(f"[convert] loading {src} ({fmt})", file=sys.stderr, flush=True)
    try:
        ckpt = load_checkpoint(str(src), fmt)
        defaults = load_generation_config(str(src), fmt)
        # The engine's own checks (architecture, config, tensors), so that the output loads.
        check_checkpoint(ckpt.hf_config, ckpt.weights, resolve_method(ckpt.hf_config, None))
    except (ValueError, OSError) as e:  # a damaged, incomplete or unsupported checkpoint
        print(f"error: --input {src}: {e}", file=sys.stderr)
        return 1
    if args.num_layers is not None:
        try:
            ckpt = first_layers(ckpt, args.num_layers)
        except ValueError as e:
            parser.error(f"--num-layers: {e}")
    print(f"[convert] writing {args.to} to {out}", file=sys.stderr, flush=True)
    try:
        (save_orbax if args.to == "orbax" else save_hf_folder)(out, ckpt)
        if defaults:  # the sampling defaults go with the weights (a GGUF carries none)
            (out / GENERATION_CONFIG_FILE).write_text(
                json.dumps(hf_generation_config(defaults), indent=2) + "\n")
    except OSError as e:
        print(f"error: --output {out}: {e}", file=sys.stderr)
        return 1
    print(f"[convert] done in {time.perf_counter() - t0:.1f}s: {out}", file=sys.stderr, flush=True)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
