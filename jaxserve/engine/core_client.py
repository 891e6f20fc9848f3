"""EngineCoreClient: the API process's end of the pipe to the engine process.

It starts the engine process (multiprocessing ``spawn`` context, target
``jaxserve.engine.core_proc.run_engine_core``) and drives its end of the pipe as an asyncio
transport (``_Pipe``): frames are handled on the event loop as they arrive, and written from it
at once, the transport buffering what a full pipe does not take, so that the loop never blocks
(and the two processes can never deadlock writing to each other). A request is in the pipe when
``add_request`` returns: no thread hand-off, which could wait for the event loop to let go of
the GIL. This module never imports JAX.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import threading
from collections.abc import Callable

from jaxserve.config import EngineConfig
from jaxserve.engine import EngineCoreRequest
from jaxserve.engine import messages as M


logger = logging.getLogger("jaxserve.engine")


def _frame(data: bytes) -> bytes:
    """``data`` framed as ``multiprocessing.Connection.send_bytes`` frames it (the engine
    process reads it with ``recv_bytes``): its length as a big-endian int32, or -1 then an
    uint64 from 2 GiB on, then the bytes."""
    n = len(data)
    if n > 0x7FFFFFFF:
        return (-1).to_bytes(4, "big", signed=True) + n.to_bytes(8, "big") + data
    return n.to_bytes(4, "big") + data


class _Pipe(asyncio.Protocol):
    """The API end of the pipe on the event loop: calls ``on_frame`` with each complete frame
    (``Connection``'s framing, see ``_frame``) and ``on_lost`` once the pipe is closed (EOF:
    the engine process is gone)."""

    def __init__(self, on_frame: Callable[[bytes], None], on_lost: Callable[[], None]):
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._buf = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start = 0  # of the first frame not handled yet (frames are cut from buf once, at the end)
        while len(buf) - start >= 4:
            n, head = int.from_bytes(buf[start:start + 4], "big", signed=True), 4
            if n == -1:
                if len(buf) - start < 12:
                    break
                n, head = int.from_bytes(buf[start + 4:start + 12], "big"), 12
            if len(buf) - start < head + n:
                break
            frame = bytes(buf[start + head:start + head + n])
            start += head + n
            self._on_frame(frame)
        del buf[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost()


@contextlib.contextmanager
def _signals_ignored(*signals: int):
    """The signals ignored in this process while the block runs (a child started meanwhile
    inherits SIG_IGN through exec; the engine process then sets its own handlers). Only the main
    thread may change them: elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = [signal.signal(sig, signal.SIG_IGN) for sig in signals]
    try:
        yield
    finally:
        for sig, handler in zip(signals, saved):
            signal.signal(sig, handler)


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
        self._transport: asyncio.Transport | None = None
        self._ready: asyncio.Future | None = None
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

        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)  # a socket pair
        sock = socket.fromfd(parent_conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
        parent_conn.close()
        self._transport, _ = await loop.connect_accepted_socket(
            lambda: _Pipe(self._on_frame, self._engine_gone), sock)
        self._proc = ctx.Process(target=run_engine_core,
                                 args=(self.config, child_conn, os.getpid()),
                                 name="jaxserve-engine", daemon=False)
        with _signals_ignored(signal.SIGINT, signal.SIGTERM):  # inherited through exec
            self._proc.start()
        child_conn.close()  # so that EOF reaches us when the engine exits
        self.ready_msg = await self._ready
        return self.ready_msg

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to exit, wait up to ``timeout`` s (0.5 s if it is still starting), then
        SIGKILL it (SIGTERM does nothing there: core_proc). Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self._proc is None:
            return
        if not self.dead:
            self._transport.write(_frame(M.encode(M.Shutdown())))
        if self.ready_msg is None:
            timeout = 0.5  # still loading/compiling: it would not read the pipe; kill it
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._proc.join, timeout)
        if self._proc.is_alive():
            self._proc.kill()
            await loop.run_in_executor(None, self._proc.join, 5.0)
        self._transport.close()

    def kill(self) -> None:
        """Synchronous last resort (e.g. from atexit): make sure the engine process is gone."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)

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
        self._transport.write(_frame(M.encode(msg)))

    # -- reading -------------------------------------------------------------------------------

    def _on_frame(self, data: bytes) -> None:
        try:
            msg = M.decode(data)
        except ValueError as e:  # a malformed frame: log and go on
            print(f"[jaxserve] dropping a malformed engine message: {e}", flush=True)
            return
        try:
            self._dispatch(msg)
        except Exception:  # noqa: BLE001 - raised into the transport, it would close the pipe
            logger.exception("error handling an engine message")

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

    def _engine_gone(self) -> None:
        if self.dead:
            return
        self.dead = True
        self._transport.close()
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
