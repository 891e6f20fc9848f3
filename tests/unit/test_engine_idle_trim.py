"""The engine process hands freed heap back to the OS once it goes idle after work
(``EngineCoreProc.run``, ``host_memory.release_freed``), and only then."""

import multiprocessing
import threading
import time

import pytest

from jaxserve.engine import core_proc
from jaxserve.engine import messages as M


class _Core:
    """``steps`` steps of work, then nothing to do."""

    def __init__(self, steps: int):
        self.steps = steps

    def has_unfinished_requests(self) -> bool:
        return self.steps > 0

    def step(self) -> list:
        self.steps -= 1
        return []

    def get_stats(self):
        return None


@pytest.mark.parametrize("steps,expected_trims", [(0, 0), (3, 1)])
def test_heap_handed_back_once_idle_after_work(monkeypatch, steps, expected_trims):
    trims = []
    monkeypatch.setattr(core_proc.host_memory, "release_freed", lambda: trims.append(1))
    monkeypatch.setattr(core_proc, "IDLE_TRIM_S", 0.1)
    ours, theirs = multiprocessing.Pipe()
    proc = core_proc.EngineCoreProc(_Core(steps), ours)
    runner = threading.Thread(target=proc.run)
    runner.start()
    time.sleep(0.8)  # several idle periods: the heap goes back once per stretch of work
    theirs.send_bytes(M.encode(M.Shutdown()))
    runner.join(5)
    assert not runner.is_alive()
    assert len(trims) == expected_trims
