"""Random LoRA adapters in PEFT's folder layout for a model's shapes, written with safetensors
and json alone (``peft`` is not needed: the GPU image lacks it). For serving measurements with
many adapters (docs/lora.md). It prints ``name=folder`` per adapter, what ``--lora-modules``
takes; e.g. Llama-3.1-8B's shapes with 8 adapters of rank 16:

    python -m jaxserve.serve --model llama-3.1-8b --load-format dummy --enable-lora \\
        --max-loras 8 --max-lora-rank 16 --lora-modules $(python scripts/make_lora_adapters.py \\
        --model llama-3.1-8b --num 8 --rank 16 --out /tmp/loras)

Each adapter targets every supported projection of every layer (``lora.checkpoint``): A
uniform in +-1/sqrt(in) (PEFT's Kaiming-uniform bound), B normal with standard deviation
``--b-std`` (PEFT starts B at zeros, which would make the adapters no-ops), ``lora_alpha`` = 2 r.
"""

import argparse
import json
import pathlib

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxserve.config import ModelConfig
from jaxserve.lora.checkpoint import CONFIG_NAME, MLP_MODULES, WEIGHTS_NAME, LoRAShapes
from jaxserve.model_loader.dummy import load_dummy

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def write_adapter(folder: pathlib.Path, shapes: LoRAShapes, rank: int, b_std: float,
                  dtype, seed: int) -> None:
    """One random adapter of ``rank`` on every module of ``shapes``, PEFT's layout."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module, (n_in, n_out) in shapes.modules.items():
            prefix = (f"base_model.model.model.layers.{layer}."
                      f"{'mlp' if module in MLP_MODULES else 'self_attn'}.{module}")
            bound = 1 / np.sqrt(n_in)
            tensors[f"{prefix}.lora_A.weight"] = rng.uniform(
                -bound, bound, (rank, n_in)).astype(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (b_std * rng.standard_normal(
                (n_out, rank), np.float32)).astype(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / WEIGHTS_NAME)
    (folder / CONFIG_NAME).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "use_rslora": False,
        "target_modules": sorted(shapes.modules), "bias": "none", "lora_dropout": 0.0}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True,
                    help="a --load-format dummy preset name or a config.json path")
    ap.add_argument("--num", type=int, default=8, help="adapters to write")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--b-std", type=float, default=0.01)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--out", required=True, help="folder; adapter i goes to OUT/lora{i}")
    args = ap.parse_args()
    ckpt = load_dummy(args.model, with_tokenizer=False)
    shapes = LoRAShapes.of(ModelConfig.from_hf_config(ckpt.hf_config))
    for i in range(args.num):
        folder = pathlib.Path(args.out) / f"lora{i}"
        write_adapter(folder, shapes, args.rank, args.b_std, DTYPES[args.dtype], seed=i)
        print(f"lora{i}={folder}")


if __name__ == "__main__":
    main()
