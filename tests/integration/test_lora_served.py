"""LoRA adapters through the real server (docs/lora.md), one server for all: two adapters of
``--lora-modules`` (one in each of vLLM's forms, ``name=path`` and JSON) and the base model in
flight together, each request's teacher-forced prompt log-probabilities (completions ``echo``
with ``logprobs``) within 2e-3 of HF + PEFT's float32 ones; ``/v1/models`` lists the adapters; a
third adapter loaded at run time serves, then once unloaded its requests get vLLM's 404, which
lists the names served; a name loaded again in place (``load_inplace``) serves the new weights
to new requests while a request running on it finishes with the old ones; bad adapters get a
400 on load and a usage error at start-up, naming the adapter and why, and so does a JSON
item's base_model_name other than the served model's; a --max-loras too large for the memory
fails start-up naming the flags and the GiB."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from tests.integration.server_utils import REPO, Server, get
from tests.lora_adapters import (MAX_RANK, hf_logprobs, save_bad_adapters,
                                 tiny_llama_with_adapters)
from tests.tiny_models import TINY

try:  # the HTTP library the openai client is built on (httpx2 in its 3.x releases)
    import httpx2 as httpx
except ImportError:
    import httpx

pytestmark = pytest.mark.slow

PROMPT_LEN = 48
MAX_MODEL_LEN = 512  # room for a request that runs long enough to load an adapter meanwhile
ENGINE_FLAGS = ("--max-num-batched-tokens", "8", "--max-num-seqs", "4", "--max-model-len",
                str(MAX_MODEL_LEN), "--kv-cache-gib", "0.01")


@pytest.fixture(scope="module")
def lora(tmp_path_factory, smollm):
    """(server, base folder, adapter folders, bad adapter folders, prompt ids, HF + PEFT
    log-probabilities by adapter name, None for the base model)."""
    root = tmp_path_factory.mktemp("lora")
    model, adapters = tiny_llama_with_adapters(root, smollm.tokenizer)
    bad = save_bad_adapters(model, root)
    ids = np.random.default_rng(5).integers(3, TINY["vocab_size"], PROMPT_LEN).tolist()
    ref = hf_logprobs(model, adapters, ids)
    # Two slots for three adapters, two on the host: the LRU paths of both caches run.
    server = Server("--model", str(root / "base"), "--dtype", "float32", "--enable-lora",
                    "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", str(MAX_RANK),
                    "--lora-modules", f"sql={adapters['sql']}", json.dumps(
                        {"name": "chat", "path": str(adapters["chat"]),
                         "base_model_name": str(root / "base")}),  # vLLM's JSON form
                    *ENGINE_FLAGS, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    yield server, root / "base", adapters, bad, ids, ref
    server.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _prompt_logprobs(client, model: str, ids: list[int]) -> np.ndarray:
    out = client.completions.create(model=model, prompt=ids, max_tokens=1, echo=True,
                                    logprobs=0, temperature=0)
    return np.array(out.choices[0].logprobs.token_logprobs[1:len(ids)])


def test_models_lists_adapters_with_parent(lora):
    server, base, adapters, *_ = lora
    cards = {m.id: m for m in _client(server).models.list().data}
    base_name = next(name for name, m in cards.items() if m.parent is None)
    assert set(cards) == {base_name, "sql", "chat"}
    for name in ("sql", "chat"):
        assert cards[name].parent == base_name and cards[name].root == str(adapters[name])
    assert _client(server).models.retrieve("sql").parent == base_name


def test_adapters_and_base_in_flight_together_match_hf_peft(lora):
    server, base, adapters, _, ids, ref = lora
    client = _client(server)
    base_name = client.models.list().data[0].id
    names = [None, "sql", "chat", None, "chat", "sql"]
    with ThreadPoolExecutor(len(names)) as pool:
        served = list(pool.map(lambda n: _prompt_logprobs(client, n or base_name, ids), names))
    for name, got in zip(names, served):
        np.testing.assert_allclose(got, ref[name], atol=2e-3, rtol=0, err_msg=str(name))
    assert np.abs(ref["sql"] - ref[None]).max() > 0.1  # the adapters do change the outputs


def test_runtime_load_serves_then_unload_gives_404(lora):
    server, base, adapters, _, ids, ref = lora
    client = _client(server)
    load = httpx.post(f"{server.url}/v1/load_lora_adapter",
                      json={"lora_name": "math", "lora_path": str(adapters["math"])})
    assert load.status_code == 200 and "math" in load.text
    again = httpx.post(f"{server.url}/v1/load_lora_adapter",
                       json={"lora_name": "math", "lora_path": str(adapters["math"])})
    assert again.status_code == 400 and "already been loaded" in again.text
    empty = httpx.post(f"{server.url}/v1/load_lora_adapter",
                       json={"lora_name": "", "lora_path": str(adapters["math"])})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "lora_name"
    # Three adapters in flight over two slots: the scheduler holds one back.
    with ThreadPoolExecutor(3) as pool:
        served = dict(zip(("math", "sql", "chat"), pool.map(
            lambda n: _prompt_logprobs(client, n, ids), ("math", "sql", "chat"))))
    for name, got in served.items():
        np.testing.assert_allclose(got, ref[name], atol=2e-3, rtol=0, err_msg=name)
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter",
                      json={"lora_name": "math"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as e:
        _prompt_logprobs(client, "math", ids)
    assert e.value.body["message"] == (f"The model `math` does not exist. Served models: "
                                       f"`{base}`, `sql`, `chat`.")
    gone = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "math"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "invalid_request_error"
    assert "math" not in {m.id for m in client.models.list().data}
    status, text = get(f"{server.url}/metrics")
    assert status == 200 and 'jaxserve:lora_requests_info{max_lora="2"' in text


def test_load_inplace_serves_the_new_weights_to_new_requests_only(lora):
    """vLLM's load_inplace: a name already served takes another folder's weights (without it,
    vLLM's 400); a request running on the name then finishes with the weights it started with,
    each of its tokens' log-probabilities those of the old adapter, teacher-forced."""
    server, _, adapters, _, ids, ref = lora
    client = _client(server)

    def load(name, adapter, **fields):
        return httpx.post(f"{server.url}/v1/load_lora_adapter",
                          json={"lora_name": name, "lora_path": str(adapters[adapter]), **fields})

    try:
        assert load("swap", "math").status_code == 200
        again = load("swap", "sql")
        assert again.status_code == 400 and again.json()["error"]["message"] == (
            "The lora adapter 'swap' has already been loaded. If you want to load the adapter "
            "in place, set 'load_inplace' to True.")
        np.testing.assert_allclose(_prompt_logprobs(client, "swap", ids), ref["math"], atol=2e-3,
                                   rtol=0)
        # Its prompt and output one token short of MAX_MODEL_LEN: room to teacher-force them.
        stream = client.completions.create(
            model="swap", prompt=ids, max_tokens=MAX_MODEL_LEN - len(ids) - 1, temperature=0,
            logprobs=0, stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        chunks = [next(stream)]
        assert load("swap", "sql", load_inplace=True).status_code == 200
        _, metrics = get(f"{server.url}/metrics")
        assert 'running_lora_adapters="swap"' in metrics  # the stream runs on past the load
        chunks += list(stream)
        tokens = [t for c in chunks for t in c.choices[0].token_ids]
        got = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
        assert len(tokens) == len(got) == MAX_MODEL_LEN - len(ids) - 1
        # New requests: the new weights.
        np.testing.assert_allclose(_prompt_logprobs(client, "swap", ids), ref["sql"], atol=2e-3,
                                   rtol=0)
        assert {m.id: m.root for m in client.models.list().data}["swap"] == str(adapters["sql"])
        # The running request: the old weights for every token (teacher-forced under them).
        assert load("swap-old", "math").status_code == 200
        old = _prompt_logprobs(client, "swap-old", ids + tokens)[len(ids) - 1:]
        new = _prompt_logprobs(client, "swap", ids + tokens)[len(ids) - 1:]
        np.testing.assert_allclose(got, old, atol=2e-3, rtol=0)
        assert np.abs(np.array(got) - new).max() > 0.1
    finally:
        for name in ("swap", "swap-old"):
            httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name})


def test_unknown_model_404_lists_at_most_20_served_names(lora):
    server, base, adapters, *_ = lora
    client = _client(server)
    extra = [f"extra{i}" for i in range(20)]
    try:
        for name in extra:
            r = httpx.post(f"{server.url}/v1/load_lora_adapter",
                           json={"lora_name": name, "lora_path": str(adapters["sql"])})
            assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="nope", prompt="hi", max_tokens=1)
        listed = ", ".join(f"`{n}`" for n in [str(base), "sql", "chat", *extra[:17]])
        assert e.value.body["message"] == (
            f"The model `nope` does not exist. Served models: {listed} and 3 more (GET "
            "/v1/models lists them all).")
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    finally:
        for name in extra:
            httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name})


@pytest.mark.parametrize("why, says", [
    ("missing", "no such folder"), ("rank", f"exceeds --max-lora-rank {MAX_RANK}"),
    ("target", "unsupported target modules ['lm_head']"), ("shape", "another base model"),
    ("ia3", "adapter_config.json: peft_type 'IA3': only LoRA adapters (peft_type 'LORA') are "
            "served"),
    ("peft_type", "adapter_config.json: peft_type 'IA3'"),
    ("lora_bias", "unsupported PEFT options ['lora_bias']"),
    ("r0", "adapter_config.json: r: Input should be greater than 0"),
    ("alpha", "adapter_config.json: lora_alpha: field required")])
def test_bad_adapter_load_is_400_naming_it(lora, why, says):
    server, _, _, bad, ids, _ = lora
    r = httpx.post(f"{server.url}/v1/load_lora_adapter",
                   json={"lora_name": f"bad-{why}", "lora_path": str(bad[why])})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert str(bad[why]) in error["message"] and says in error["message"]
    assert "\n" not in error["message"] and "pydantic" not in error["message"]
    assert error["param"] == "lora_path"
    _prompt_logprobs(_client(server), "sql", ids)  # the server still serves


def test_bad_lora_modules_is_a_usage_error(lora):
    _, base, _, bad, _, _ = lora
    for why in ("missing", "rank", "target", "ia3"):
        out = subprocess.run(
            [sys.executable, "-m", "jaxserve.serve", "--model", str(base), "--enable-lora",
             "--max-lora-rank", str(MAX_RANK), "--lora-modules", f"x={bad[why]}"],
            capture_output=True, text=True, cwd=REPO, timeout=120)
        assert out.returncode == 2, out.stderr
        assert "argument --lora-modules: x=" in out.stderr and str(bad[why]) in out.stderr


def test_lora_modules_base_model_name_must_be_the_served_model(lora):
    """vLLM's JSON item's base_model_name names the adapter's parent: another name than the
    served model's is a usage error once the engine is up (the served name is known then)."""
    _, base, adapters, *_ = lora
    item = json.dumps({"name": "x", "path": str(adapters["sql"]), "base_model_name": "other"})
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.serve", "--model", str(base), "--dtype", "float32",
         "--enable-lora", "--max-lora-rank", str(MAX_RANK), "--lora-modules", item,
         *ENGINE_FLAGS, "--port", "0"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 2, out.stderr
    assert (f"error: argument --lora-modules: x={adapters['sql']}: base_model_name 'other' is "
            f"not the served model '{base}'") in out.stderr
    assert "Traceback" not in out.stderr


def test_lora_pool_too_large_for_the_memory_is_refused_at_start_up(lora):
    """--max-loras far beyond the memory: the engine refuses it before allocating, naming the
    flags and the GiB (it was killed for memory, exit -9, with no message)."""
    _, base, *_ = lora
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.serve", "--model", str(base), "--dtype", "float32",
         "--enable-lora", "--max-loras", str(10**7), *ENGINE_FLAGS, "--port", "0"],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 2, out.stderr
    assert (f"error: cannot start the engine for --model {base}: --max-loras 10000000 and "
            "--max-cpu-loras 10000000 with --max-lora-rank 16: the LoRA pool (") in out.stderr
    assert "GiB of host memory, where" in out.stderr and "Traceback" not in out.stderr
