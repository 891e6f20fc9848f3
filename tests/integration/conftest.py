"""Session fixtures of the tensor-parallel tests: tiny models, prompts, and the offline greedy
outputs at every size (one fake-device subprocess), which the server tests compare against."""

import pytest

from tests.conftest import sharegpt_prompts
from tests.integration import tp_utils


@pytest.fixture(scope="session")
def tp_prompts() -> list[str]:
    return sharegpt_prompts(tp_utils.NUM_PROMPTS, max_chars=400, skip=300, min_chars=40)


@pytest.fixture(scope="session")
def tiny_tp_folders(tmp_path_factory, smollm) -> dict:
    """{"llama": folder, "qwen3": folder} (``tp_utils.TINY``)."""
    root = tmp_path_factory.mktemp("tp-models")
    return {name: tp_utils.make_tiny_folder(root, name, smollm.tokenizer) for name in tp_utils.TINY}


@pytest.fixture(scope="session")
def tiny_hf_models(tiny_tp_folders) -> dict:
    """The tiny models in HF transformers (float32, CPU): the near-tie margins' source."""
    import torch
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
            for name, folder in tiny_tp_folders.items()}


@pytest.fixture(scope="session")
def tp_offline(tiny_tp_folders, tp_prompts) -> dict:
    """``LLM`` greedy outputs of the prompts, keyed "NAME:TP": the default model at TP 1 and 3,
    each tiny model at TP 1, 2 and 4; plus the tiny Llama step's collectives."""
    models = {"default": None, **{k: str(v) for k, v in tiny_tp_folders.items()}}
    sizes = {"default": (1, 3), "llama": (1, 2, 4), "qwen3": (1, 2, 4)}
    runs = [{"model": models[name], "tp": tp} for name in models for tp in sizes[name]]
    raw = tp_utils.run_offline(runs, tp_prompts, collectives_of=models["llama"])
    out = {"collectives": raw.pop("collectives")}
    for name, path in models.items():
        for tp in sizes[name]:
            out[f"{name}:{tp}"] = raw[f"{path}:{tp}"]
    return out
