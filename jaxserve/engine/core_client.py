"""EngineCoreClient: the API process's end of the pipe to the engine process.

It starts the engine process (multiprocessing ``spawn`` context, target
``jaxserve.engine.core_proc.run_engine_core``), reads the pipe from the asyncio event loop with
``loop.add_reader`` (never a blocking read on the loop), and writes from a small sender thread so
that a full pipe never blocks the loop (and the two processes can never deadlock writing to each
other). This module never imports JAX.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import threading
from collections.abc import Callable

from jaxserve.config import EngineConfig
from jaxserve.engine import EngineCoreRequest
from jaxserve.engine import messages as M


class EngineStartError(RuntimeError):
    """The engine process could not start (e.g. the model could not be loaded); one-line message."""


class EngineDeadError(RuntimeError):
    """The engine process is gone; no request can be served."""


class EngineCoreClient:
    """Owns the engine process and the API side of the pipe.

    Args:
      config: passed to the engine process.
      on_message: called on the event loop with every ``Outputs`` / ``Error`` message.
      on_dead: called once on the event loop when the engine process goes away unexpectedly.
    """

    def __init__(self, config: EngineConfig, on_message: Callable[[object], None],
                 on_dead: Callable[[], None]):
        self.config = config
        self._on_message = on_message
        self._on_dead = on_dead
        self._proc = None
        self._conn = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        self._sendq: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._closing = False
        self.dead = False
        self.ready_msg: M.Ready | None = None

    # -- life cycle ----------------------------------------------------------------------------

    async def start(self) -> M.Ready:
        """Spawn the engine process and wait for its ``Ready``.

        Raises:
          EngineStartError: the engine reported a fatal error or exited during start-up.
        """
        from jaxserve.engine.core_proc import run_engine_core

        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=run_engine_core, args=(self.config, child_conn, os.getpid()),
                                 name="jaxserve-engine", daemon=False)
        self._proc.start()
        child_conn.close()  # so that EOF reaches us when the engine exits
        self._conn = parent_conn
        self._loop.add_reader(parent_conn.fileno(), self._on_readable)
        self._sender = threading.Thread(target=self._send_loop, name="jaxserve-pipe-sender",
                                        daemon=True)
        self._sender.start()
        self.ready_msg = await self._ready
        return self.ready_msg

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to exit, wait up to ``timeout`` s (0.5 s if it is still starting), then
        SIGTERM it, then SIGKILL it. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self._proc is None:
            return
        if not self.dead:
            self._sendq.put(M.encode(M.Shutdown()))
        self._sendq.put(None)
        if self.ready_msg is None:
            timeout = 0.5  # still loading/compiling: it would not read the pipe; SIGTERM it
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._proc.join, timeout)
        if self._proc.is_alive():
            self._proc.terminate()
            await loop.run_in_executor(None, self._proc.join, 5.0)
        if self._proc.is_alive():
            self._proc.kill()
            await loop.run_in_executor(None, self._proc.join, 5.0)
        self._close_conn()

    def kill(self) -> None:
        """Synchronous last resort (e.g. from atexit): make sure the engine process is gone."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue an ``add`` for the engine. Raises EngineDeadError if the engine is gone."""
        self._send(M.AddRequest(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Queue an ``abort``; a no-op if the engine is gone or shutting down."""
        if request_ids and not self.dead and not self._closing:
            self._send(M.AbortRequests(list(request_ids)))

    def _send(self, msg) -> None:
        if self.dead or self._closing:
            raise EngineDeadError("the engine is not running")
        self._sendq.put(M.encode(msg))

    def _send_loop(self) -> None:
        while True:
            data = self._sendq.get()
            if data is None:
                return
            try:
                self._conn.send_bytes(data)
            except (OSError, EOFError, ValueError):
                return  # the reader notices EOF and reports the engine dead

    # -- reading -------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                msg = M.decode(self._conn.recv_bytes())
                self._dispatch(msg)
        except (EOFError, OSError):
            self._engine_gone()
        except ValueError as e:  # a malformed frame: log and go on
            print(f"[jaxserve] dropping a malformed engine message: {e}", flush=True)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, M.Ready):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg)
        elif isinstance(msg, M.Error) and msg.fatal:
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(EngineStartError(msg.message))
            else:
                print(f"[jaxserve] engine error: {msg.message}", flush=True)
        else:
            self._on_message(msg)

    def _close_conn(self) -> None:
        if self._conn is not None:
            try:
                self._loop.remove_reader(self._conn.fileno())
            except (OSError, ValueError):
                pass
            try:
                self._conn.close()
            except OSError:
                pass

    def _engine_gone(self) -> None:
        if self.dead:
            return
        self.dead = True
        self._sendq.put(None)
        self._close_conn()
        if self._ready is not None and not self._ready.done():
            code = None
            if self._proc is not None:
                self._proc.join(5.0)
                code = self._proc.exitcode
            self._ready.set_exception(EngineStartError(
                f"the engine process exited during start-up (exit code {code})"))
            return
        if not self._closing:
            self._on_dead()
