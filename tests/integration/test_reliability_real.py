"""docs/reliability.md's bounds against the real server and the default model: the reproducers
that need the real engine, and short bounded runs of scripts/fuzz_api.py and scripts/stress.py (docs/reliability.md
has the full-size runs). One server for the module; the engine is killed last.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import fuzz_api
from server_utils import Server
from tests.conftest import SMALL_ENGINE, SMALL_ENGINE_FLAGS

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = SMALL_ENGINE["max_num_seqs"]
REPO = Path(__file__).resolve().parents[2]
MAX_WAITING = 80  # with MAX_NUM_SEQS running, 96 requests admitted


@pytest.fixture(scope="module")
def server():
    srv = Server(*SMALL_ENGINE_FLAGS, "--max-waiting-requests", str(MAX_WAITING),
                 "--max-engine-restarts", "0")
    yield srv
    srv.stop()


def _scenario(server, *flags: str) -> dict:
    """scripts/stress.py run as a user runs it, in a process of its own, -> its JSON summary.
    Its own process, because its timings are the server's only when the client is idle: a full
    garbage collection of this test process, after hundreds of tests, holds it ~0.5 s."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "stress.py"), "--url", server.url,
         "--server-pid", str(server.proc.pid), *flags],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.stdout.strip(), proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bad_top_k_while_8_streams_run(server):
    """Check 2: top_k 2**31 (past int32, which would overflow in the engine step) is a 400 while 8
    streams run, and the 8 streams complete."""
    result = _scenario(server, "--scenario", "poison")
    assert result["ok"], result


def test_top_k_int32_max_runs(server):
    """The largest valid top_k reaches the engine's int32 arrays and samples (it means 'no
    top-k', as any top_k >= the vocabulary does)."""
    result = asyncio.run(fuzz_api.run_cases(server.url, [fuzz_api.Case(
        "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3, "top_k": 2**31 - 1})]))
    assert not result[0].failures and result[0].by_status == {"200": 1}, result


def test_50_mb_prompt(server):
    """Check 3: a 50 MB prompt is refused at once, without stalling the API or growing it."""
    result = _scenario(server, "--scenario", "big-prompt", "--big-prompt-mb", "50")
    assert result["ok"], result


def test_text_past_the_size_bound_is_refused_before_tokenizing(server):
    """A prompt of more bytes than max_model_len tokens could hold: 400 naming the prompt,
    before the tokenizer sees it."""
    case = fuzz_api.Case("POST", "/v1/completions", {"prompt": "word " * 100_000})
    report, _, _ = asyncio.run(fuzz_api.run_cases(server.url, [case]))
    assert report.by_status == {"400": 1} and not report.failures


def test_fuzz_short(server):
    """Check 1, bounded: 150 generated bodies (the full run has 2,000)."""
    cases = fuzz_api.generate_cases(150, seed_value=11)
    report, same, _ = asyncio.run(fuzz_api.run_cases(server.url, cases))
    assert report.bodies == 150 and not report.failures, report.failures[:5]
    assert same, "the greedy answer changed after the fuzz run"


def test_stress_short(server):
    """Check 4, bounded: 90 streams (under the 16 + 80 admitted), 20% hang up, 10% read
    slowly; nothing lost, and the server settles to no running request and no KV page held."""
    result = _scenario(server, "--num-streams", "90", "--max-tokens", "8")
    assert result["num_lost"] == 0 and result["settled"], result
    assert result["disconnected"] > 0 and result["completed"] > 0


def test_overload(server):
    """Check 5, bounded: 160 requests at once against 16 + 80 admitted."""
    result = _scenario(server, "--scenario", "overload", "--num-streams", "160",
                       "--max-tokens", "4")
    assert result["ok"] and result["refused_503"] >= 160 - MAX_NUM_SEQS - MAX_WAITING, result


def test_engine_sigkill_fails_in_flight_and_exits_3(server):
    """Check 6 with --max-engine-restarts 0 (the stub engine tests cover the restart): all
    streams in flight end with an error within 5 s, then the server exits with code 3."""
    result = _scenario(server, "--scenario", "engine-kill", "--num-streams", "16",
                       "--max-tokens", "200", "--kill-after-s", "2", "--expect-exit")
    assert result["ok"] and result["failed_with_error"] == 16, result
    assert server.proc.wait(30) == 3
