"""The engine process's steps never wait for the API process to read the pipe
(``core_proc._Sender``): with a peer that reads nothing, every step runs, and the messages then
arrive complete and in order; a peer that is gone ends the engine's loop."""

import multiprocessing
import threading

from jaxserve.engine import EngineCoreOutput
from jaxserve.engine import core_proc
from jaxserve.engine import messages as M

STEPS = 400
TOKENS = 5000  # ids of up to 3 bytes each: ~6 MB in all, past any socket buffer


class _Core:
    """``total`` steps, each with one large output."""

    def __init__(self, total: int = STEPS):
        self.total = total
        self.steps = 0
        self.done = threading.Event()

    def has_unfinished_requests(self) -> bool:
        return self.steps < self.total

    def step(self) -> list:
        self.steps += 1
        if self.steps == self.total:
            self.done.set()
        return [EngineCoreOutput(f"r{self.steps}", list(range(TOKENS)))]

    def get_stats(self):
        return None


def test_steps_go_on_while_the_api_process_reads_nothing(monkeypatch):
    monkeypatch.setattr(core_proc.host_memory, "release_freed", lambda: None)
    ours, theirs = multiprocessing.Pipe()
    core = _Core()
    runner = threading.Thread(target=core_proc.EngineCoreProc(core, ours).run, daemon=True)
    runner.start()
    try:
        assert core.done.wait(30), f"the engine stopped at step {core.steps} of {STEPS}"
        ids = []
        for _ in range(STEPS):
            msg = M.decode(theirs.recv_bytes())
            assert isinstance(msg, M.Outputs) and len(msg.outputs[0].new_token_ids) == TOKENS
            ids.append(msg.outputs[0].request_id)
        assert ids == [f"r{i}" for i in range(1, STEPS + 1)]
    finally:
        theirs.send_bytes(M.encode(M.Shutdown()))
        runner.join(10)
    assert not runner.is_alive()


def test_a_gone_api_process_ends_the_loop(monkeypatch):
    monkeypatch.setattr(core_proc.host_memory, "release_freed", lambda: None)
    ours, theirs = multiprocessing.Pipe()
    theirs.close()
    # Work that never ends: the loop must end because the peer is gone (EOF on the pipe, or a
    # failed send), not for lack of work.
    runner = threading.Thread(target=core_proc.EngineCoreProc(_Core(10**9), ours).run,
                              daemon=True)
    runner.start()
    runner.join(30)
    assert not runner.is_alive()
