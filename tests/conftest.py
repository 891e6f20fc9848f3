"""Shared fixtures: the real default model (fetched once into the default cache, shared by all
test runs) loaded once per session, and its conversion to an HF folder."""

import pathlib

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> pathlib.Path:
    from checkpoints_tools.fetch_default import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm(default_gguf):
    from jaxserve.model_loader import load_gguf

    return load_gguf(default_gguf)


@pytest.fixture(scope="session")
def smollm_hf_folder(smollm, tmp_path_factory) -> pathlib.Path:
    from jaxserve.model_loader import save_hf_folder

    return save_hf_folder(tmp_path_factory.mktemp("conv") / "SmolLM2-135M-Instruct", smollm)


# Small engine limits keep start-up compilation short on 2 CPU cores (fewer buckets).
SMALL_ENGINE = dict(max_model_len=512, max_num_batched_tokens=128, max_num_seqs=16, kv_cache_gib=0.25)

SHAREGPT = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data" / "sharegpt_1k.json"


def sharegpt_prompts(n: int, max_chars: int = 600, skip: int = 0) -> list[str]:
    """The first human turn of n ShareGPT conversations, cut to max_chars characters."""
    import json

    convs = json.loads(SHAREGPT.read_text())
    prompts = [c["conversations"][0]["value"][:max_chars] for c in convs[skip:] if c["conversations"][0]["value"].strip()]
    return prompts[:n]


@pytest.fixture(scope="session")
def smollm_llm():
    """The default model in the offline engine, shared by the engine tests."""
    from jaxserve import LLM

    return LLM(log=lambda s: None, **SMALL_ENGINE)


@pytest.fixture(scope="session")
def hf_smollm(smollm_hf_folder):
    """HF transformers' own SmolLM2 (float32, CPU) from our converted folder: the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm_hf_folder), dtype=torch.float32).eval()
