"""scripts/bench_serving.py against the real server (default model) over loopback:
one small run per dataset, each checked against the server's own /metrics.

One server for the module, with the small engine limits of tests/conftest.py's SMALL_ENGINE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server_utils import REPO, Server

from tests.conftest import SMALL_ENGINE, SMALL_ENGINE_FLAGS

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(REPO, "scripts", "bench_serving.py")
MAX_NUM_SEQS = SMALL_ENGINE["max_num_seqs"]
MAX_MODEL_LEN = SMALL_ENGINE["max_model_len"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The result keys the script's docstring documents.
KEYS = {
    "date", "command", "settings", "duration_s", "num_prompts", "completed", "failed",
    "first_error", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "server_generation_tokens",
    "server_prompt_tokens", "server_prefix_cache_hits", "server_prefix_cache_queries",
    "server_peak_running_waiting", "server_load_samples", "start_times_s", "input_lens",
    "output_lens", "ttfts_s", "latencies_s", "itls_s", "errors",
} | {f"{stat}_{name}_ms" for stat in ("mean", "p50", "p90", "p99")
     for name in ("ttft", "tpot", "itl", "e2el")}
PER_REQUEST = ("start_times_s", "input_lens", "output_lens", "ttfts_s", "latencies_s", "itls_s",
               "errors")


@pytest.fixture(scope="module")
def server():
    srv = Server(*SMALL_ENGINE_FLAGS)
    yield srv
    srv.stop()


def bench(server, result_dir, name: str, *args: str) -> dict:
    """Run the script with `--result-dir result_dir --result-name name` and `args`; its JSON
    result. Asserts exit 0, the table on stdout and a PNG beside the JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--base-url", server.url, "--result-dir", str(result_dir),
         "--result-name", name, *args],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)  # the table, for `pytest -s`
    assert "| output tok/s | total tok/s | TTFT p50 / p99 ms |" in proc.stdout
    assert (result_dir / f"{name}.png").read_bytes().startswith(PNG_MAGIC)
    return json.loads((result_dir / f"{name}.json").read_text())


def check_complete(result: dict, num_prompts: int) -> None:
    """All requests succeeded, every documented key is there, and the client's token counts
    equal the server's counter deltas over the timed window."""
    assert KEYS <= result.keys()
    assert result["num_prompts"] == result["completed"] == num_prompts
    assert result["failed"] == 0 and result["first_error"] is None
    assert all(len(result[k]) == num_prompts for k in PER_REQUEST)
    assert result["total_output_tokens"] == result["server_generation_tokens"] > 0
    assert result["total_input_tokens"] == result["server_prompt_tokens"] > 0
    assert result["output_throughput"] > 0 and result["p99_ttft_ms"] > 0


def test_random_keeps_requests_in_flight(server, tmp_path):
    n, output_len = 16, 16
    result = bench(server, tmp_path, "random", "--dataset-name", "random", "--num-prompts", str(n),
                   "--input-len", "32", "--output-len", str(output_len),
                   "--max-concurrency", str(MAX_NUM_SEQS), "--metrics-interval", "0.1")
    check_complete(result, n)
    assert result["settings"]["max_model_len"] == MAX_MODEL_LEN  # from /v1/models
    assert result["output_lens"] == [output_len] * n  # ignore_eos: exact lengths
    assert result["input_lens"] == [32] * n
    # The server saw the requests together, not one connection's worth at a time.
    assert result["server_peak_running_waiting"] > MAX_NUM_SEQS // 2


def test_sharegpt(server, tmp_path):
    """Real prompts and answer lengths; a client-side --max-model-len keeps the answers short,
    and no warm-up (the counters' start values come from a server that has run requests)."""
    n = 8
    result = bench(server, tmp_path, "sharegpt", "--dataset-name", "sharegpt",
                   "--num-prompts", str(n), "--max-model-len", "96", "--num-warmup", "0")
    check_complete(result, n)
    assert all(a + b <= 96 for a, b in zip(result["input_lens"], result["output_lens"]))
    assert len(set(result["output_lens"])) > 1  # the answers' own lengths, not one fixed length


def test_shared_prefix_hits_the_prefix_cache(server, tmp_path):
    n, prefix_len, input_len = 8, 64, 16
    result = bench(server, tmp_path, "shared-prefix", "--dataset-name", "shared-prefix",
                   "--num-prompts", str(n), "--prefix-len", str(prefix_len),
                   "--input-len", str(input_len), "--output-len", "8", "--request-rate", "20")
    check_complete(result, n)
    assert result["input_lens"] == [prefix_len + input_len] * n
    # The warm-up cached the prefix: every timed request finds it (whole pages of it at least).
    assert result["server_prefix_cache_hits"] >= n * (prefix_len - 16)


def test_failed_requests_are_counted_not_fatal(server, tmp_path):
    """Prompts longer than the server's max_model_len: every request gets HTTP 400; the script
    still exits 0 and reports them."""
    result = bench(server, tmp_path, "failed", "--num-prompts", "2", "--num-warmup", "0",
                   "--input-len", str(MAX_MODEL_LEN + 8), "--output-len", "4")
    assert result["completed"] == 0 and result["failed"] == 2
    assert result["first_error"].startswith("HTTP 400")
    assert result["total_output_tokens"] == result["server_generation_tokens"] == 0
    assert result["p50_ttft_ms"] is None
