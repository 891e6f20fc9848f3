"""Server failure paths: bad flags, an engine that cannot start, a request that crashes the engine
step, an engine process that dies, and Ctrl-C during start-up. None of them may give a traceback,
a hang, a dead server or a leftover process.

Most use ``stub_engine.StubEngineCore`` (no JAX, starts in seconds), served by stub_server.py;
the start-up failure also runs the real engine once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from server_utils import HERE, REPO, Server, descendants, free_port, get, wait_gone
from stub_engine import ADD_CRASH_ID, STEP_CRASH_ID, STEP_POISON_ID, STEP_REPEAT_ID

STUB = "stub_server"  # the server with StubEngineCore (stub_server.py)


def _run_cli(*args, env=None, timeout=120, module="jaxserve.serve"):
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([REPO, HERE])}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=REPO)


def _one_error_line(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("args,needles", [
    (["--bogus-flag"], ["--bogus-flag"]),
    (["--port", "eighty"], ["--port"]),
    (["--port", "70000"], ["--port"]),
    (["--max-model-len", "-5"], ["--max-model-len"]),
    (["--dtype", "float8"], ["--dtype"]),
    (["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization"]),
    (["--load-format", "pickle"], ["--load-format"]),
    (["--model", "/no/such/model.gguf"], ["--model", "/no/such/model.gguf"]),
])
def test_bad_flags_one_line_exit_2(args, needles):
    _one_error_line(_run_cli(*args), *needles)


def test_port_in_use_one_line_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _one_error_line(_run_cli("--port", str(port)), "--port", str(port))


def test_engine_start_error_one_line_exit_2():
    proc = _run_cli("--port", str(free_port()), module=STUB,
                    env={"STUB_START_ERROR": "cannot read weights from the file"})
    _one_error_line(proc, "--model", "cannot read weights from the file")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["not-gguf", "no-architecture"])
def test_real_engine_unusable_model_one_line_exit_2(kind, tmp_path):
    needles = []
    if kind == "not-gguf":
        bogus = tmp_path / "model.gguf"
        bogus.write_bytes(b"this is not a gguf file" * 10)
    else:  # an HF folder whose config.json says no model: refused as HF transformers does
        import numpy as np
        from safetensors.numpy import save_file

        bogus = tmp_path / "folder"
        bogus.mkdir()
        (bogus / "config.json").write_text(json.dumps({"hidden_size": 8}))
        save_file({"x": np.zeros(1, np.float32)}, str(bogus / "model.safetensors"))
        needles = ["neither 'architectures' nor 'model_type'"]
    proc = _run_cli("--port", str(free_port()), "--model", str(bogus), timeout=300)
    _one_error_line(proc, "--model", str(bogus), *needles)


def test_ctrl_c_during_start_up_leaves_no_process_or_folder(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, HERE]), "STUB_START_DELAY_S": "60",
           "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", STUB, "--port", str(free_port())],
                                stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=REPO)
    deadline = time.monotonic() + 60
    kids = set()
    while not kids and time.monotonic() < deadline:
        time.sleep(0.2)
        kids = descendants(proc.pid)
    assert kids
    # The engine has its tokenizer folder and is still starting.
    while "stub engine: tokenizer ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "Traceback" not in text
    assert not wait_gone(kids)
    assert not list((tmp_path / "tmp").iterdir())


@pytest.fixture(scope="module")
def stub_server():
    srv = Server("--max-model-len", "512", module=STUB, startup_timeout=120)
    yield srv
    srv.stop()


def _client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)


def test_stub_serves(stub_server):
    r = _client(stub_server).completions.create(model="stub-model", prompt="hi", max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_request_that_crashes_add_gets_500_and_engine_lives(stub_server):
    c = _client(stub_server)
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model="stub-model", prompt=[ADD_CRASH_ID, 5, 6], max_tokens=5)
    assert "stub add_request failure" in str(e.value)
    assert c.completions.create(model="stub-model", prompt="hi", max_tokens=3).usage.completion_tokens == 3


def test_request_that_crashes_step_gets_error_and_engine_lives(stub_server):
    c = _client(stub_server)
    with pytest.raises(openai.InternalServerError):
        c.completions.create(model="stub-model", prompt=[STEP_CRASH_ID, 5], max_tokens=5)
    # Streaming: the error arrives as an SSE error event, and the stream ends.
    with pytest.raises(openai.APIError):
        for _ in c.completions.create(model="stub-model", prompt=[STEP_CRASH_ID, 5],
                                      max_tokens=5, stream=True):
            pass
    assert c.completions.create(model="stub-model", prompt="hi", max_tokens=3).usage.completion_tokens == 3
    assert get(f"{stub_server.url}/health")[0] == 200


def test_a_failed_step_fails_only_its_requests(stub_server):
    """A stream running beside the request whose step fails goes on to its end."""
    c = _client(stub_server)
    result = {}

    def stream():
        chunks = list(c.completions.create(model="stub-model", prompt="hi", max_tokens=60,
                                           stream=True))
        result["finish"] = chunks[-1].choices[0].finish_reason

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.3)
    with pytest.raises(openai.InternalServerError, match="engine step failed"):
        c.completions.create(model="stub-model", prompt=[STEP_CRASH_ID, 5], max_tokens=5)
    t.join(30)
    assert result == {"finish": "length"}


def _wait_health(srv, status: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if get(f"{srv.url}/health")[0] == status:
            return True
        time.sleep(0.05)
    return False


def test_a_step_that_takes_the_engine_down_restarts_it():
    """A failed step after which the engine cannot go on (its KV pool went with the step), and
    three failed steps in a row: each time the live requests fail, /health says 503 while a
    new engine process starts (the stub takes a second to), and it then serves."""
    srv = Server("--max-model-len", "512", env={"STUB_START_DELAY_S": "1"}, module=STUB,
                 startup_timeout=120)
    try:
        c = _client(srv)
        for first, why in ((STEP_POISON_ID, "did not survive"), (STEP_REPEAT_ID, "3 failed steps")):
            (engine,) = _engine_pids(srv)
            with pytest.raises(openai.InternalServerError, match=why):
                c.completions.create(model="stub-model", prompt=[first, 5], max_tokens=5)
            assert _wait_health(srv, 503, 10)
            # meanwhile (the stub takes a second to start) every 503 says when to come back
            for url, body in ((f"{srv.url}/health", None), (f"{srv.url}/v1/completions", json.dumps(
                    {"model": "stub-model", "prompt": "hi", "max_tokens": 3}).encode())):
                req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
                with pytest.raises(urllib.error.HTTPError) as e:
                    urllib.request.urlopen(req, timeout=10)
                assert (e.value.code, e.value.headers["Retry-After"]) == (503, "1"), url
            assert _wait_health(srv, 200, 60)
            assert c.completions.create(model="stub-model", prompt="hi",
                                        max_tokens=3).usage.completion_tokens == 3
            assert _engine_pids(srv) != [engine]
        assert "restarting the engine" in srv.output()
    finally:
        srv.stop()


def _engine_pids(srv) -> list[int]:
    def cmdline(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    return [p for p in descendants(srv.proc.pid) if "spawn_main" in cmdline(p)]


def test_engine_death_fails_in_flight_then_restarts(stub_server):
    """The policy: in-flight requests fail at once, /metrics says the engine is down, a
    new engine process is started (--max-engine-restarts, default 3) and serves new requests."""
    c = _client(stub_server)
    result = {}

    def stream():
        try:
            for _ in c.completions.create(model="stub-model", prompt="hi", max_tokens=500,
                                          stream=True):
                pass
            result["ended"] = "normally"
        except Exception as e:  # noqa: BLE001
            result["ended"] = type(e).__name__
        result["t"] = time.monotonic()

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(1.0)
    (engine,) = _engine_pids(stub_server)
    log_before = len(stub_server.output())
    killed = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    t.join(20)
    assert not t.is_alive(), "the in-flight stream hung after the engine died"
    assert result["ended"] != "normally" and result["t"] - killed < 5
    deadline = time.monotonic() + 60
    while get(f"{stub_server.url}/health")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert get(f"{stub_server.url}/health")[0] == 200
    m = stub_server.metrics()
    assert m["jaxserve:engine_restarts_total"] == 1 and m["jaxserve:engine_alive"] == 1
    assert c.completions.create(model="stub-model", prompt="hi", max_tokens=3).usage.completion_tokens == 3
    (new_engine,) = _engine_pids(stub_server)
    assert new_engine != engine
    assert stub_server.stop(signal.SIGTERM, timeout=30) == 0
    assert "Traceback" not in stub_server.output()[log_before:]  # (earlier tests log on purpose)
    assert not wait_gone(stub_server.engine_pids | {new_engine})


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_process_group_lets_in_flight_requests_finish(sig):
    """systemd's stop (SIGTERM to every process of the service) and a terminal's Ctrl-C (SIGINT
    to the process group) reach the engine process too: it leaves the shutdown to the API
    process, so a stream in flight finishes within --shutdown-timeout, and nothing is left.
    The engine handles the signal (a no-op) rather than ignoring it: an ignored signal stays
    ignored through exec, and the processes the engine starts (pip, the tokenizer export) would
    outlive the group's stop."""
    srv = Server("--max-model-len", "512", "--shutdown-timeout", "20", module=STUB,
                 startup_timeout=120, new_session=True)
    try:
        (engine,) = _engine_pids(srv)
        with open(f"/proc/{engine}/status") as f:
            masks = {k: int(v, 16) for k, v in (line.split(":\t") for line in f)
                     if k in ("SigIgn", "SigCgt")}
        bit = 1 << (sig - 1)
        assert masks["SigCgt"] & bit and not masks["SigIgn"] & bit, masks
        result = {}

        def stream():
            for ch in _client(srv).completions.create(
                    model="stub-model", prompt="hi", max_tokens=100, stream=True,
                    stream_options={"include_usage": True}):
                if ch.choices and ch.choices[0].finish_reason:
                    result["finish"] = ch.choices[0].finish_reason
                if ch.usage:
                    result["tokens"] = ch.usage.completion_tokens

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 30
        while srv.metrics()["jaxserve:num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.stop(sig, timeout=60, group=True) == 0, srv.output()
        t.join(30)
        assert result == {"tokens": 100, "finish": "length"}, (result, srv.output())
        assert "Traceback" not in srv.output()
        assert not wait_gone(srv.engine_pids)
    finally:
        srv.stop()


def test_a_group_signal_during_start_up_ends_the_server():
    """SIGTERM to the process group while the engine loads: the server exits at once (the
    engine, which ignores SIGTERM, is killed), leaving no process behind."""
    srv = Server("--max-model-len", "512", module=STUB, startup_timeout=120, new_session=True,
                 env={"STUB_START_DELAY_S": "60"}, wait_for_engine=False)
    try:
        deadline = time.monotonic() + 30
        while not (engines := _engine_pids(srv)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engines
        t0 = time.monotonic()
        assert srv.stop(signal.SIGTERM, timeout=30, group=True) == 0, srv.output()
        assert time.monotonic() - t0 < 10
        assert not wait_gone(set(engines))
    finally:
        srv.stop()


def test_engine_death_without_restarts_exits_3():
    """--max-engine-restarts 0: in-flight requests fail, then the server exits with code 3 for
    its supervisor, leaving no process behind."""
    srv = Server("--max-model-len", "512", "--max-engine-restarts", "0", module=STUB,
                 startup_timeout=120)
    try:
        (engine,) = _engine_pids(srv)
        os.kill(engine, signal.SIGKILL)
        assert srv.proc.wait(30) == 3
        out = srv.output()
        assert "Traceback" not in out and "--max-engine-restarts 0" in out
        assert not wait_gone(srv.engine_pids)
    finally:
        srv.stop()
