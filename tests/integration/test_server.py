"""The real server (``python -m jaxserve.serve``, default model) over loopback.

One server per module (started once, ~30 s with a warm executable cache, a few minutes cold),
with ``--api-key`` so the 401 path is covered too. The tests run in file order; the last one
shuts the server down and checks that no process is left. The served-name test runs a tiny
checkpoint's server of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import aiohttp
import openai
import pytest

from server_utils import Server, descendants, get, wait_gone

from tests.conftest import SMALL_ENGINE, SMALL_ENGINE_FLAGS, sharegpt_prompts

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = SMALL_ENGINE["max_model_len"]
GPU_MEMORY_UTILIZATION = 0.5  # no effect on the CPU, but the allocator fraction is still reported

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = Server(*SMALL_ENGINE_FLAGS, "--api-key", API_KEY,
                 "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def aclient_factory(server):
    return lambda: openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                      max_retries=0, timeout=600)


def _headers():
    return {"Authorization": f"Bearer {API_KEY}"}


# -- basics -----------------------------------------------------------------------------------


def test_api_process_never_imports_jax(server):
    with open(f"/proc/{server.proc.pid}/maps") as f:
        maps = f.read()
    assert "jaxlib" not in maps and "xla_extension" not in maps
    # ... while the engine process (one of its children) does.
    def maps(pid):
        try:
            with open(f"/proc/{pid}/maps") as f:
                return f.read()
        except OSError:
            return ""

    assert any("jaxlib" in maps(p) for p in server.engine_pids)


def test_engine_reports_its_allocator_fraction(server):
    """The engine process sets XLA_PYTHON_CLIENT_MEM_FRACTION to --gpu-memory-utilization + 0.04
    (unless the user set it) before JAX starts, logs it, and sends it in its Ready message, which
    the API process prints in its ready line."""
    user = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    expected = float(user) if user else GPU_MEMORY_UTILIZATION + 0.04
    out = server.output()
    engine = re.search(r"\[jaxserve engine\] allocator fraction ([0-9.]+) of device memory", out)
    ready = re.search(r"ready: serving .*allocator fraction ([0-9.]+) of device memory", out)
    assert engine and ready, out[-3000:]
    assert float(engine.group(1)) == pytest.approx(expected)
    assert float(ready.group(1)) == pytest.approx(expected)


def test_health_version_models(server, client):
    assert get(f"{server.url}/health")[0] == 200
    status, body = get(f"{server.url}/version")
    assert status == 200 and "version" in json.loads(body)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_paris(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=16)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    assert r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_multi_turn_chat_with_system(client):
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "You answer in one short sentence."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "And of Italy?"}])
    assert r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"


def test_completion_and_stop_string(client):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    text = r.choices[0].text
    assert text and r.choices[0].finish_reason in ("stop", "length")
    # Stop right before the first word of that same greedy output.
    word = text.split()[min(1, len(text.split()) - 1)]
    r2 = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16,
                                   stop=[word])
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].stop_reason == word
    assert r2.choices[0].text == text[:text.index(word)]
    assert r.choices[0].stop_reason is None


def test_cache_salt_parts_the_prefix_cache(client):
    """vLLM's ``cache_salt``: a prompt is served from the prefix cache only to requests of the
    same salt (none counts as one more salt); an empty salt is a 400."""
    prompt = f"Request {time.time_ns()}: " + "tell me about rivers, lakes and seas. " * 8

    def cached(**extra) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1, extra_body={"cache_salt": ""})
    assert e.value.body["param"] == "cache_salt"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_equals_non_stream(client, kind):
    q = "Name three colours of the rainbow and describe each one briefly."
    if kind == "chat":
        kw = dict(model=MODEL, messages=[{"role": "user", "content": q}], temperature=0,
                  max_tokens=32)
        full = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(**kw, stream=True,
                                                     stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = full.choices[0].message.content
    else:
        kw = dict(model=MODEL, prompt=q, temperature=0, max_tokens=32)
        full = client.completions.create(**kw)
        chunks = list(client.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = full.choices[0].text
    assert streamed == expected
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert "\ufffd" not in streamed


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="Once upon a time", temperature=0.8, top_p=0.9, max_tokens=12,
              seed=1234, extra_body={"top_k": 50})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


# -- batching ---------------------------------------------------------------------------------


def _near_tie_check(request, prompt_ids, alone, together):
    """docs/architecture.md, "Testing numerics" for the mismatching pairs: compare token ids up to
    the first position where the reference (alone) has its two best logits within 1e-3 (from HF
    transformers, float32, same weights). Returns [(index, identical, positions compared)]."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = request.getfixturevalue("smollm_hf_folder")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    for i, (p, a, b) in enumerate(zip(prompt_ids, alone, together)):
        if a == b:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([p + a])).logits[0, len(p) - 1:len(p) - 1 + len(a)]
        top2 = torch.topk(logits, 2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        n = next((k for k in range(min(len(a), len(b))) if margins[k] < 1e-3 or a[k] != b[k]),
                 min(len(a), len(b)))
        near_tie = n < len(margins) and margins[n] < 1e-3
        out.append((i, near_tie, n))
    return out


def test_32_concurrent_streams_match_one_by_one(request, server, client, aclient_factory):
    """32 greedy streams at once give the same token ids as each request alone
    (docs/architecture.md, "Testing numerics"), and the engine batched them (num_requests_running >
    1 observed)."""
    prompts = sharegpt_prompts(32, max_chars=400, min_chars=81)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    alone, alone_text, prompt_ids = [], [], []
    for m in msgs:
        r = client.chat.completions.create(model=MODEL, messages=m, temperature=0, max_tokens=12,
                                           extra_body={"return_token_ids": True})
        alone.append(r.choices[0].token_ids)
        alone_text.append(r.choices[0].message.content)
        prompt_ids.append(r.prompt_token_ids)  # vLLM's: top level in chat

    max_running = 0
    stop_polling = threading.Event()

    def poll():
        nonlocal max_running
        while not stop_polling.is_set():
            try:
                max_running = max(max_running, server.metrics()["jaxserve:num_requests_running"])
            except OSError:
                pass
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()

    async def one(ac, m):
        stream = await ac.chat.completions.create(model=MODEL, messages=m, temperature=0,
                                                  max_tokens=12, stream=True,
                                                  extra_body={"return_token_ids": True})
        parts, ids = [], []
        async for c in stream:
            if c.choices:
                parts.append(c.choices[0].delta.content or "")
                ids += getattr(c.choices[0], "token_ids", None) or []
        return "".join(parts), ids

    async def run_all():
        ac = aclient_factory()
        try:
            return await asyncio.gather(*[one(ac, m) for m in msgs])
        finally:
            await ac.close()

    try:
        results = asyncio.run(run_all())
    finally:
        stop_polling.set()
        poller.join()
    together = [ids for _, ids in results]
    assert all(len(a) >= 1 for a in alone)
    checked = _near_tie_check(request, prompt_ids, alone, together) if alone != together else []
    real = [(i, n) for i, near_tie, n in checked if not near_tie]
    assert not real, "\n".join(f"#{i} differs at token {n}: alone={alone[i]} batched={together[i]}"
                               for i, n in real)
    if checked:
        print(f"stopped early at a near-tie on {len(checked)} of 32 prompts: {checked}")
    assert len(checked) <= 4, "near-ties on most prompts: the comparison says too little"
    # Where the ids agree, the streamed text equals the non-streamed text.
    for i, (text, ids) in enumerate(results):
        if ids == alone[i]:
            assert text == alone_text[i]
    assert max_running > 1, f"the engine never ran more than {max_running} request(s) at once"


# -- disconnects and engine stats ---------------------------------------------------------------


def _wait_idle(server, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["jaxserve:num_requests_running"] == 0 and m["jaxserve:num_requests_waiting"] == 0
                and m["jaxserve:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_disconnect_mid_stream_aborts(server):
    async def go():
        body = {"model": MODEL, "prompt": "Count from one to one thousand: one, two,",
                "max_tokens": 800, "ignore_eos": True, "temperature": 0, "stream": True}
        async with aiohttp.ClientSession(headers=_headers()) as s:
            # A streaming client that leaves after a few chunks.
            resp = await s.post(f"{server.url}/v1/completions", json=body)
            assert resp.status == 200
            n = 0
            async for line in resp.content:
                if line.startswith(b"data: "):
                    n += 1
                if n >= 3:
                    break
            m = server.metrics()
            assert m["jaxserve:num_requests_running"] >= 1
            assert m["jaxserve:kv_cache_usage_perc"] > 0
            resp.close()
            # A non-streaming client that gives up (its timeout) before the answer.
            with pytest.raises(asyncio.TimeoutError):
                await s.post(f"{server.url}/v1/completions", json={**body, "stream": False},
                             timeout=aiohttp.ClientTimeout(total=1.5))

    asyncio.run(go())
    m = _wait_idle(server)
    assert m["jaxserve:num_requests_running"] == 0
    assert m["jaxserve:num_requests_waiting"] == 0
    assert m["jaxserve:kv_cache_usage_perc"] == 0
    # The engine still serves.
    r = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY).completions.create(
        model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_metrics_names(server):
    m = server.metrics()
    for name in ("jaxserve:num_requests_running", "jaxserve:num_requests_waiting",
                 "jaxserve:kv_cache_usage_perc", "jaxserve:num_preemptions_total"):
        assert name in m
    assert m.get("jaxserve:request_success_total", 1) >= 1


# -- the served name ---------------------------------------------------------------------------


def test_a_checkpoint_is_served_under_model_as_given(tmp_path):
    """As in vLLM, ``--model PATH`` is served (and labelled in the metrics) as PATH, whatever
    the format: here an orbax folder, which records its source's name ("tiny-llama")."""
    from jaxserve.model_loader import load_checkpoint, save_orbax
    from tests.checkpoints.tiny_gguf import make_tiny_gguf

    make_tiny_gguf(tmp_path / "tiny-llama.gguf", "llama")
    path = str(save_orbax(tmp_path / "o1", load_checkpoint(str(tmp_path / "tiny-llama.gguf"))))
    srv = Server("--model", path, "--max-model-len", "128", "--max-num-seqs", "2",
                 "--max-num-batched-tokens", "16", "--kv-cache-gib", "0.01")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == [path]
        assert client.completions.create(model=path, prompt="ab", max_tokens=1).model == path
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="tiny-llama", prompt="ab", max_tokens=1)
        metrics = get(f"{srv.url}/metrics")[1]
        assert f'jaxserve:num_requests_running{{model_name="{path}"}}' in metrics
    finally:
        srv.stop()


# -- errors -----------------------------------------------------------------------------------


def _post(server, path, data, headers=None):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{server.url}{path}", data=data,
                              headers=headers if headers is not None else _headers()) as r:
                return r.status, await r.text()

    return asyncio.run(go())


def _assert_error(status, body, want_status, param="unset", contains=None):
    assert status == want_status, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in body
    if param != "unset":
        assert err["param"] == param, err
    if contains:
        assert contains in err["message"], err


@pytest.mark.parametrize("body,param", [
    ("{not json", None),
    ("[1, 2]", None),
    (json.dumps({"model": MODEL}), "prompt"),
    (json.dumps({"prompt": "hi", "max_tokens": "ten"}), "max_tokens"),
    (json.dumps({"prompt": "hi", "temperature": -0.5}), "temperature"),
    (json.dumps({"prompt": "hi", "top_p": 0}), "top_p"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}), "max_tokens"),
    (json.dumps({"prompt": "hi", "n": 129}), "n"),
    (json.dumps({"prompt": "hi", "logprobs": 21}), "logprobs"),
    (json.dumps({"prompt": "hi", "best_of": 3}), "best_of"),
    (json.dumps({"prompt": "hi", "stream": "yes"}), "stream"),
    (json.dumps({"prompt": ""}), "prompt"),
    (json.dumps({"prompt": [1, 2, 10**9]}), "prompt"),
    (json.dumps({"prompt": "word " * 2000}), "prompt"),
    (json.dumps({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}), "max_tokens"),
])
def test_completion_bad_requests_400(server, body, param):
    _assert_error(*_post(server, "/v1/completions", body), 400, param)


@pytest.mark.parametrize("body,param", [
    (json.dumps({"messages": []}), "messages"),
    # Any role string goes to the template (vLLM's custom roles); a role must be one.
    (json.dumps({"messages": [{"role": 5, "content": "hi"}]}), "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                 "top_logprobs": 21}), "top_logprobs"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
     "tools"),
    (json.dumps({"messages": [{"role": "user", "content": "hi " * 1500}]}), "messages"),
])
def test_chat_bad_requests_400(server, body, param):
    _assert_error(*_post(server, "/v1/chat/completions", body), 400, param)


def test_unknown_fields_are_ignored_with_a_warning(server):
    status, body = _post(server, "/v1/completions",
                         json.dumps({"prompt": "hi", "max_tokens": 2, "frobnicate": 7}))
    assert status == 200, body
    assert "frobnicate" in server.output()


def test_unknown_model_404(server):
    _assert_error(*_post(server, "/v1/completions",
                         json.dumps({"model": "gpt-4", "prompt": "hi"})), 404, "model")


def test_api_key_401(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    _assert_error(*_post(server, "/v1/completions", body, headers={}), 401)
    for header in ("Bearer wrong", f"Basic {API_KEY}", API_KEY, f"Bearer {API_KEY.upper()}"):
        _assert_error(*_post(server, "/v1/completions", body,
                             headers={"Authorization": header}), 401)
    # The scheme is case-insensitive (RFC 9110), the key is not.
    assert _post(server, "/v1/completions", body,
                 headers={"Authorization": f"bearer {API_KEY}"})[0] == 200
    assert get(f"{server.url}/health")[0] == 200  # health and metrics need no key
    assert json.loads(get(f"{server.url}/ping")[1]) == {"status": "ok"}  # vLLM's, GET and POST
    assert _post(server, "/ping", "", headers={})[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope").models.list()


def test_unknown_route_404_json(server):
    status, body = get(f"{server.url}/nothing-here")
    _assert_error(status, body, 404)
    # vLLM's LoRA routes are 404 unless runtime updating is on; the answer says how to turn it on.
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        status, body = _post(server, route, json.dumps({"lora_name": "a", "lora_path": "/x"}))
        _assert_error(status, body, 404, contains="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")


# -- shutdown (last) --------------------------------------------------------------------------


def test_shutdown_ends_in_flight_requests_and_leaves_no_process(server):
    engine_pids = descendants(server.proc.pid)
    assert engine_pids
    result = {}

    def stream():
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        text, finish, error = "", None, None
        try:
            for ch in c.completions.create(model=MODEL, prompt="Tell me a long story.",
                                           max_tokens=900, stream=True,
                                           extra_body={"ignore_eos": True}):
                if ch.choices:
                    text += ch.choices[0].text
                    finish = ch.choices[0].finish_reason or finish
        except Exception as e:  # noqa: BLE001 - an error event is a valid ending
            error = e
        result.update(text=text, finish=finish, error=error)

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 60
    while server.metrics()["jaxserve:num_requests_running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    code = server.stop(signal.SIGTERM, timeout=60)
    t.join(30)
    assert not t.is_alive(), "the in-flight stream hung after shutdown"
    assert code == 0, server.output()
    assert time.monotonic() - t0 < 30
    # The in-flight request ended with its output or an error, never silently.
    assert result["finish"] is not None or result["error"] is not None, result
    assert not wait_gone(engine_pids), "engine process left behind"
    assert "Traceback" not in server.output()
