"""Session fixtures of the tensor-parallel tests: tiny models, prompts, and the offline greedy
outputs at every size (one fake-device subprocess), which the server tests compare against;
a small default-model server; and the official ``openai`` client over a module's ``server``,
recording every body it reads (``transport``) for the tests that validate them against
OpenAI's schema."""

import openai
import pytest

from tests.conftest import SMALL_ENGINE_FLAGS, sharegpt_prompts
from tests.integration import tp_utils
from tests.integration.server_utils import Server

try:  # the HTTP library the openai client is built on (httpx2 in its 3.x releases)
    import httpx2 as httpx
except ImportError:
    import httpx


@pytest.fixture(scope="session")
def tp_prompts() -> list[str]:
    return sharegpt_prompts(tp_utils.NUM_PROMPTS, max_chars=400, skip=300, min_chars=40)


@pytest.fixture(scope="session")
def tiny_tp_folders(tmp_path_factory, smollm) -> dict:
    """{"llama": HF folder, "qwen3_moe": HF folder, "llama-orbax": the Llama as an orbax folder}
    (``tp_utils.TINY``)."""
    from jaxserve.model_loader import load_hf_folder, save_orbax

    root = tmp_path_factory.mktemp("tp-models")
    out = {name: tp_utils.make_tiny_folder(root, name, smollm.tokenizer) for name in tp_utils.TINY}
    out["llama-orbax"] = save_orbax(root / "tiny-llama-orbax", load_hf_folder(out["llama"]))
    return out


@pytest.fixture(scope="session")
def tiny_hf_models(tiny_tp_folders) -> dict:
    """The tiny models in HF transformers (float32, CPU): the near-tie margins' source."""
    import torch
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(str(tiny_tp_folders[name]),
                                                       dtype=torch.float32).eval()
            for name in tp_utils.TINY}


@pytest.fixture(scope="session")
def tp_offline(tiny_tp_folders, tp_prompts, smollm_llm) -> dict:
    """Greedy outputs of the prompts (``prompt_ids``, ``output_ids``), keyed "NAME:TP": the
    default model (its GGUF) at TP 1 (the engine tests' ``smollm_llm``, in this process) and 3,
    each tiny model (HF folders) at TP 1 and 4, and the Llama's orbax folder at 2 with the
    Pallas kernels and n-gram speculative decoding (its drafts made in the step, on the mesh)
    (``LLM`` on fake devices; the Qwen3-MoE at 2 is served in
    test_tensor_parallel_tiny_server.py); plus the tiny Llama step's collectives at 4."""
    from jaxserve import SamplingParams

    sizes = {"default": (3,), "llama": (1, 4), "qwen3_moe": (1, 4), "llama-orbax": (2,)}
    paths = {"default": None, **{name: str(folder) for name, folder in tiny_tp_folders.items()}}
    runs = [{"model": paths[name], "tp": tp} for name in sizes for tp in sizes[name]]
    # The GPU's attention, the Pallas kernels (in interpret mode here), per shard.
    runs[runs.index({"model": paths["llama-orbax"], "tp": 2})]["flags"] = {
        "attention_backend": "pallas", "speculative_config": {
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}}
    raw = tp_utils.run_offline(runs, tp_prompts, collectives_of=paths["llama"])
    out = {"collectives": raw["collectives"]}
    out |= {f"{name}:{tp}": raw[f"{paths[name]}:{tp}"] for name in sizes for tp in sizes[name]}
    results = smollm_llm.generate(
        tp_prompts, SamplingParams(temperature=0, max_tokens=tp_utils.MAX_TOKENS), use_tqdm=False)
    out["default:1"] = {"prompt_ids": [r.prompt_token_ids for r in results],
                        "output_ids": [r.outputs[0].token_ids for r in results]}
    return out


class _Tee(httpx.SyncByteStream):
    """A response body stream that keeps a copy of what it yields."""

    def __init__(self, stream, sink: bytearray):
        self.stream, self.sink = stream, sink

    def __iter__(self):
        for chunk in self.stream:
            self.sink += chunk
            yield chunk

    def close(self):
        self.stream.close()


class RecordingTransport(httpx.HTTPTransport):
    """Records (path, status, body bytes) of every response (filled as it is read)."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, int, bytearray]] = []

    def handle_request(self, request):
        response = super().handle_request(request)
        sink = bytearray()
        self.records.append((request.url.path, response.status_code, sink))
        response.stream = _Tee(response.stream, sink)
        return response



@pytest.fixture(scope="session")
def small_server():
    """The default model's server of test_structured_outputs.py and test_tool_calling.py, one
    for both (a start-up costs tens of seconds on 2 CPU cores)."""
    srv = Server(*SMALL_ENGINE_FLAGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def transport():
    return RecordingTransport()


@pytest.fixture(scope="module")
def client(server, transport):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600,
                         http_client=httpx.Client(transport=transport, timeout=600))
