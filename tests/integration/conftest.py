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
def tp_offline(tiny_tp_folders, tp_prompts, smollm_llm) -> dict:
    """Greedy outputs of the prompts (``prompt_ids``, ``output_ids``), keyed "NAME:TP": the
    default model at TP 1 (the engine tests' ``smollm_llm``, in this process) and 3, each tiny
    model at TP 1, 2 and 4 (``LLM`` on fake devices); plus the tiny Llama step's collectives."""
    from jaxserve import SamplingParams

    tiny = {name: str(folder) for name, folder in tiny_tp_folders.items()}
    runs = [{"model": None, "tp": 3}]
    runs += [{"model": path, "tp": tp} for path in tiny.values() for tp in (1, 2, 4)]
    raw = tp_utils.run_offline(runs, tp_prompts, collectives_of=tiny["llama"])
    out = {"collectives": raw["collectives"], "default:3": raw["None:3"]}
    out |= {f"{name}:{tp}": raw[f"{path}:{tp}"] for name, path in tiny.items() for tp in (1, 2, 4)}
    results = smollm_llm.generate(
        tp_prompts, SamplingParams(temperature=0, max_tokens=tp_utils.MAX_TOKENS), use_tqdm=False)
    out["default:1"] = {"prompt_ids": [r.prompt_token_ids for r in results],
                        "output_ids": [r.outputs[0].token_ids for r in results]}
    return out
