"""The engine process: EngineCore behind the pipe (docs/architecture.md, "Processes").

``run_engine_core(config, conn)`` is the target of the ``spawn``-context process that
``EngineCoreClient`` starts. It builds the EngineCore (the only place JAX is imported), sends
``Ready``, then loops:

* no unfinished requests -> block on the pipe for the next message;
* otherwise drain every pending message (adds, aborts), then run one ``EngineCore.step()`` and
  send its outputs with fresh scheduler stats.

Messages go out through a thread of their own (``_Sender``; vLLM V1's engine core sends from an
output thread too): a step never waits for the API process to read the pipe. When the API
process is busy (a burst of streams, thousands of connections arriving), steps go on and its
requests' deltas pile up, to be merged into fewer, larger updates (``AsyncLLM.outputs``); a
blocking send tied the device's pace to the API process's event loop, and the engine stalled
with a full pipe.

A request that the core rejects gets an ``Error`` for that request only; a step that raises gets
an ``Error`` for the requests that were live (they are aborted) and the loop goes on: the engine
never dies of a bad request. A step cannot tell which of its requests broke it, so no request
value may be able to: every ``add`` is checked here before the core sees it (SamplingParams'
bounds run when the frame is decoded; ``check_engine_request`` adds the prompt's length and
every token id against the model's vocabulary), so a bad value fails its own request, not the
step. ``Shutdown`` and the API process going away (EOF on the pipe, or the parent process
dying) end the process cleanly. SIGINT and SIGTERM do nothing here (a handler that does
nothing, not SIG_IGN: ``_leave_to_the_api_process``): the API process coordinates
the shutdown (in-flight requests get ``--shutdown-timeout`` to finish), and a signal sent to the
whole process group (Ctrl-C, systemd's and supervisord's stop) reaches both processes at once.
The API process ends an engine that does not exit with SIGKILL; it starts the engine with both
signals ignored, so that one arriving while the engine imports does not interrupt it.
"""

from __future__ import annotations

import gc
import os
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from jaxserve import host_memory
from jaxserve.config import EngineConfig
from jaxserve.engine import EngineCoreRequest, child_request_id
from jaxserve.engine import messages as M
from jaxserve.engine.input_processor import check_sampling_token_ids, check_token_ids
from jaxserve.exceptions import ValidationError


def _log(msg: str) -> None:
    print(f"[jaxserve engine] {msg}", file=sys.stderr, flush=True)


def _watch_parent(parent_pid: int) -> None:
    """Exit if the API process dies without closing the pipe (e.g. during a long start-up)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _describe(e: BaseException) -> str:
    text = str(e).strip()
    if isinstance(e, (ValueError, FileNotFoundError, NotADirectoryError)) and text:
        return text.splitlines()[0] if len(text) > 2000 else text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class _Exit(Exception):
    pass


# Failed steps in a row after which the engine process exits to be started again: a failure
# that recurs whatever the batch is not one request's doing.
MAX_FAILED_STEPS = 3

# Seconds without a message after the last step before the engine hands freed heap back: long
# enough that a steady trickle of requests never waits on it.
IDLE_TRIM_S = 1.0


def check_engine_request(req: EngineCoreRequest, vocab_size: int, max_model_len: int) -> None:
    """What the model runner's arrays need of a request. Raises ValidationError on the field."""
    n = len(req.prompt_token_ids)
    if not 0 < n < max_model_len:
        raise ValidationError(f"prompt: {n} tokens; a prompt needs 1 to {max_model_len - 1}",
                              parameter="prompt")
    check_token_ids(req.prompt_token_ids, vocab_size, "prompt")
    check_sampling_token_ids(req.sampling_params, vocab_size)


# Seconds the engine waits, when it exits, for its last messages (a failed step's errors) to be
# written to the pipe.
FLUSH_TIMEOUT_S = 5.0


class _Sender:
    """Writes frames to the pipe from a thread, in the order ``put`` gets them; ``put`` never
    blocks. Once a write fails (the API process is gone), ``put`` raises _Exit."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._frames: queue.SimpleQueue = queue.SimpleQueue()
        self._broken = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="jaxserve-engine-send")
        self._thread.start()

    def put(self, frame: bytes) -> None:
        if self._broken.is_set():
            raise _Exit()
        self._frames.put(frame)

    def _run(self) -> None:
        while (frame := self._frames.get()) is not None:
            try:
                self._conn.send_bytes(frame)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                self._broken.set()
                return

    def close(self, timeout: float) -> None:
        """Write what is queued (waiting at most ``timeout`` s), then stop the thread."""
        self._frames.put(None)
        self._thread.join(timeout)


class EngineCoreProc:
    """Runs an EngineCore against one end of the pipe. ``run()`` returns on shutdown/EOF."""

    def __init__(self, core, conn: Connection):
        self.core = core
        self.conn = conn
        self._sender = _Sender(conn)
        self.live: set[str] = set()
        self._last_stats = None
        self._failed_steps = 0  # in a row
        self._worked = False  # a step ran since the heap was last handed back

    # -- pipe --------------------------------------------------------------------------------

    def send(self, msg) -> None:
        self._sender.put(M.encode(msg))

    def _recv(self):
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            raise _Exit() from None
        try:
            return M.decode(data)
        except ValueError as e:
            _log(f"dropping a malformed message: {e}")
            return None

    # -- handling ----------------------------------------------------------------------------

    def _handle(self, msg) -> None:
        if isinstance(msg, M.AddRequest):
            req = msg.request
            n = req.sampling_params.n
            ids = [child_request_id(req.request_id, i, n) for i in range(n)]
            if not self.live.isdisjoint(ids):
                self.send(M.Error([req.request_id], f"duplicate request id {req.request_id!r}",
                                  kind="invalid_request"))
                return
            try:
                check_engine_request(req, self.core.vocab_size, self.core.config.max_model_len)
                self.core.add_request(req)
            except ValueError as e:
                self.send(M.Error([req.request_id], _describe(e), kind="invalid_request"))
            except Exception as e:  # noqa: BLE001 - a bad request must never kill the engine
                traceback.print_exc()
                self.send(M.Error([req.request_id], _describe(e), kind="internal"))
            else:
                self.live.update(ids)
        elif isinstance(msg, M.AbortRequests):
            ids = [r for r in msg.request_ids if r in self.live]
            if ids:
                self.live.difference_update(ids)
                try:
                    self.core.abort_requests(ids)
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
        elif isinstance(msg, M.Shutdown):
            raise _Exit()

    def _step(self) -> None:
        """One engine step. A step that fails fails the requests in it (EngineCore's
        ``recover_from_failed_step``), and the others go on; when the engine cannot go on (its
        KV pool went down with the step) or after MAX_FAILED_STEPS failed steps in a row, every
        live request fails and the process exits, for the API process to start it again."""
        try:
            outputs = self.core.step()
            timestamp = time.monotonic()
        except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving
            traceback.print_exc()
            self._failed_steps += 1
            message = f"engine step failed: {_describe(e)}"
            try:
                ids, usable = self.core.recover_from_failed_step()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                ids, usable = sorted(self.live), False
            if usable and self._failed_steps < MAX_FAILED_STEPS:
                ids = [i for i in ids if i in self.live]
                self.live.difference_update(ids)
                if ids:
                    self.send(M.Error(ids, message, kind="internal"))
                return
            why = ("the KV pool did not survive it" if not usable
                   else f"{self._failed_steps} failed steps in a row")
            _log(f"{message}; {why}: restarting the engine")
            # The requests get the reason; the API process sees the exit and restarts us.
            self.send(M.Error(sorted(self.live), f"{message} ({why}; the engine restarts)",
                              kind="internal"))
            raise _Exit() from None
        self._failed_steps = 0
        for o in outputs:
            if o.finished:
                self.live.discard(o.request_id)
        self.send(M.Outputs(list(outputs), self._stats(), timestamp))

    def _stats(self):
        try:
            stats = self.core.get_stats()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            return None
        self._last_stats = stats
        return stats

    def _send_stats_if_changed(self) -> None:
        prev = self._last_stats
        stats = self._stats()
        if stats is not None and stats != prev:
            self.send(M.Outputs([], stats))

    def run(self) -> None:
        try:
            while True:
                if not self.core.has_unfinished_requests():
                    self._send_stats_if_changed()
                    if self._worked and not self.conn.poll(IDLE_TRIM_S):
                        # Idle after work: hand back the heap pages its requests freed.
                        host_memory.release_freed()
                        self._worked = False
                    msg = self._recv()  # idle: block until the API side has something
                    if msg is not None:
                        self._handle(msg)
                while self.conn.poll():
                    msg = self._recv()
                    if msg is not None:
                        self._handle(msg)
                if self.core.has_unfinished_requests():
                    self._step()
                    self._worked = True
        except _Exit:
            return
        finally:
            self._sender.close(FLUSH_TIMEOUT_S)


def _leave_to_the_api_process(signum, frame):
    # A handler, not SIG_IGN: an ignored signal stays ignored through exec, and the processes
    # this one starts (pip, the tokenizer export) must end with the process group.
    pass


def run_engine_core(config: EngineConfig, conn: Connection, parent_pid: int | None = None) -> None:
    """Engine process entry point (multiprocessing ``spawn`` target).

    Args:
      config: the engine configuration (CLI flags).
      conn: this process's end of the duplex Pipe.
      parent_pid: the API process; the engine exits if it disappears.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _leave_to_the_api_process)
    threading.Thread(target=_watch_parent, args=(parent_pid or os.getppid(),), daemon=True,
                     name="jaxserve-parent-watch").start()
    try:
        try:
            from jaxserve.engine.core import EngineCore  # imports JAX: engine process only

            core = EngineCore(config, log=_log)
        except Exception as e:  # noqa: BLE001 - reported as one line by the API process
            if os.environ.get("JAXSERVE_DEBUG"):
                traceback.print_exc()
            conn.send_bytes(M.encode(M.Error([], _describe(e), kind="internal", fatal=True)))
            return
        # What start-up made (the model runner, its compiled steps) lives as long
        # as the process: frozen, a full collection no longer scans it (120-220 ms on 2 CPU
        # cores with a tiny model, one in a run of 60 requests, in a request's path if unlucky).
        gc.collect()
        gc.freeze()
        conn.send_bytes(M.encode(M.Ready(
            model_name=str(core.model_name), config=core.config,
            tokenizer_dir=core.tokenizer_dir, eos_token_ids=list(core.eos_token_ids),
            vocab_size=core.vocab_size,
            allocator_fraction=core.allocator_fraction,
            generation_config=dict(core.generation_config),
            lora_shapes=None if core.lora_manager is None else core.lora_manager.shapes,
            num_gpu_blocks=core.num_pages,
        )))
        EngineCoreProc(core, conn).run()
    except (SystemExit, KeyboardInterrupt, BrokenPipeError, EOFError, OSError):
        pass
    finally:
        try:
            conn.close()
        except OSError:
            pass
