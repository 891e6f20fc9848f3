"""scripts/bench_scheduler.py runs against the current Scheduler (its stub model's output is a
real ModelRunnerOutput) and prints its per-step timings."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_scheduler_runs():
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "bench_scheduler.py"),
         "--num-requests", "8", "--prompt-len", "40", "--steps", "20"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "8 running requests, page 16, prefix caching on, 20 decode steps" in out.stdout
    assert out.stdout.count(" ms, p50 ") == 2
