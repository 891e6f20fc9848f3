"""A random EAGLE head for a model's shapes, in the layout of the public heads
(``jaxserve/spec_decode/eagle.py``: config.json + model.safetensors), written with safetensors
and json alone. No trained head can be fetched on the measurement machines; a random one costs
what a trained one costs (its drafts are almost never accepted), e.g. for Llama-3.1-8B's shapes:

    python scripts/make_eagle_head.py --model llama-3.1-8b --method eagle3 --out eagle3-head
    python -m jaxserve.serve --model llama-3.1-8b --load-format dummy --speculative-config \\
        '{"method": "eagle3", "model": "eagle3-head", "num_speculative_tokens": 3}'

Weights are normal(0, ``--std``), norm weights 1; eagle3's draft vocabulary is a random sorted
subset of the target's (``d2t``: its offsets, ``t2d``: its mask): ``eagle.random_weights``,
what ``"model": "dummy"`` draws at start-up.
"""

import argparse
import json
import pathlib

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxserve.model_loader.dummy import load_dummy
from jaxserve.spec_decode.eagle import head_config, random_weights

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def write_head(folder: pathlib.Path, cfg: dict, weights: dict[str, np.ndarray]) -> pathlib.Path:
    """Write ``config.json`` and ``model.safetensors`` (torch metadata) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="the target: a --load-format dummy preset, a config.json or an HF folder")
    p.add_argument("--method", choices=("eagle", "eagle3"), required=True)
    p.add_argument("--out", required=True, type=pathlib.Path)
    p.add_argument("--draft-vocab-size", type=int, help="eagle3 (default min(32000, V))")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    target = load_dummy(args.model, with_tokenizer=False).hf_config
    cfg = head_config(target, args.method, args.draft_vocab_size)
    write_head(args.out, cfg, random_weights(cfg, args.method, args.std, args.seed,
                                             DTYPES[args.dtype]))
    print(args.out)


if __name__ == "__main__":
    main()
