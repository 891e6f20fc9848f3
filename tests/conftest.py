"""Shared fixtures: the real default model (fetched once into the default cache, shared by all
test runs) loaded once per session, and its conversion to an HF folder."""

import pathlib

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> pathlib.Path:
    from jaxserve.model_loader.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm(default_gguf):
    from jaxserve.model_loader import load_gguf

    return load_gguf(default_gguf)


@pytest.fixture(scope="session")
def smollm_hf_folder(smollm, tmp_path_factory) -> pathlib.Path:
    from jaxserve.model_loader import save_hf_folder

    return save_hf_folder(tmp_path_factory.mktemp("conv") / "SmolLM2-135M-Instruct", smollm)


# Small engine limits keep start-up compilation short on 2 CPU cores (fewer buckets). Tests of
# the default model that need no other limits use these, in-process or as CLI flags (the API
# tests' servers too), so that one engine's compiled programs serve the others from the
# executable cache.
SMALL_ENGINE = dict(max_model_len=1024, max_num_batched_tokens=128, max_num_seqs=16,
                    kv_cache_gib=0.25)


def cli_flags(limits: dict) -> list[str]:
    """EngineConfig fields as the CLI's flags: {"max_num_seqs": 4} -> ["--max-num-seqs", "4"]."""
    return [x for k, v in limits.items() for x in (f"--{k.replace('_', '-')}", str(v))]


SMALL_ENGINE_FLAGS = cli_flags(SMALL_ENGINE)


def sharegpt_prompts(n: int, max_chars: int = 600, skip: int = 0, min_chars: int = 1) -> list[str]:
    """First human turns of the repo's ShareGPT sample (data/README.md), from conversation
    ``skip`` on, those with at least ``min_chars`` non-blank characters, cut to ``max_chars``."""
    from scripts.sharegpt import first_turns

    prompts = [t[:max_chars] for t in first_turns()[skip:] if len(t.strip()) >= min_chars]
    assert len(prompts) >= n, f"the sample has only {len(prompts)} such prompts"
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
