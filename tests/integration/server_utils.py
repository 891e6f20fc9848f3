"""Helpers for integration tests that run ``python -m jaxserve.serve`` in a subprocess."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """All live descendant pids of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` is alive (helpers such as multiprocessing's resource tracker
    exit a moment after the server); returns those still alive after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name (labels dropped): value}.

    Sample names, not family names: a counter reads ``jaxserve:num_preemptions_total``, a
    histogram gives ``..._bucket``, ``..._count``, ``..._sum``. Of a name's several label sets
    (histogram buckets, ``finished_reason``), the last one listed wins.
    """
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def in_parallel(fn, items, workers: int = 32) -> list:
    """``fn`` of each item, called from ``workers`` threads at once (requests to a server), in
    the items' order."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def _remove_file(f) -> None:
    f.close()
    os.remove(f.name)


class Server:
    """A ``python -m <module>`` subprocess on 127.0.0.1:<free port>: ``jaxserve.serve``, or
    ``stub_server`` (this folder's: the server with stub_engine's StubEngineCore)."""

    def __init__(self, *args: str, env: dict | None = None, startup_timeout: float = 1200.0,
                 module: str = "jaxserve.serve", new_session: bool = False,
                 wait_for_engine: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="jaxserve-server-", suffix=".log",
                                               delete=False, mode="w+")
        weakref.finalize(self, _remove_file, self.log)  # kept while the Server is
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (REPO, HERE, full_env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO,
            start_new_session=new_session)  # its own process group: stop(group=True)
        # /health is 503 until the engine is ready, 200 after: either means the port is open.
        self._wait_ready(startup_timeout, (200,) if wait_for_engine else (200, 503))
        if wait_for_engine:  # the ready lines follow /health's 200 by a moment
            self.wait_output(r"sampling defaults for requests that leave them out")
        self.engine_pids = descendants(self.proc.pid)

    def _wait_ready(self, timeout: float, statuses: tuple[int, ...]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if get(f"{self.url}/health", timeout=2)[0] in statuses:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def wait_output(self, pattern: str, timeout: float = 30.0) -> re.Match | None:
        """The first match of ``pattern`` in the log, waiting up to ``timeout`` s for it (None
        after)."""
        deadline = time.monotonic() + timeout
        while (m := re.search(pattern, self.output())) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return m

    def metrics(self) -> dict[str, float]:
        status, text = get(f"{self.url}/metrics")
        assert status == 200, text
        return parse_metrics(text)

    def stop(self, sig=signal.SIGINT, timeout: float = 60.0, group: bool = False) -> int | None:
        """Signal the server (``group``: its whole process group, as a terminal's Ctrl-C or
        systemd's stop does; needs ``new_session``) and wait for it; kills it (and its
        children) if it hangs."""
        pids = descendants(self.proc.pid) | self.engine_pids
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                for p in pids:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass
                return None
        return self.proc.returncode
