"""``python -m jaxserve.serve``: the OpenAI-compatible HTTP server.

Parses the CLI flags, binds the port (so a busy port fails at once), starts the aiohttp app
(every endpoint but /health, /version and /metrics answers 503 until the engine is ready), spawns
the engine process, and serves until SIGINT/SIGTERM. Shutdown stops accepting connections, lets
in-flight requests finish for a few seconds, ends the rest with an error, and waits for the
engine process to exit.

Exit codes: 0 after a clean shutdown, 2 for a bad flag or a model the engine cannot load (one
line on stderr naming it, no traceback), 1 for anything else unexpected.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from jaxserve.engine.arg_utils import HelpFormatter, add_cli_args, bounded, from_cli_args

PROG = "python -m jaxserve.serve"
SHUTDOWN_GRACE_S = 5.0  # in-flight requests get this long to finish after SIGINT/SIGTERM


class UsageError(Exception):
    """A bad flag value: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line instead of usage + error
        raise UsageError(message)


_port = bounded(int, lambda v: 0 <= v <= 65535, "in 0..65535")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="OpenAI-compatible LLM server on JAX/XLA.",
                formatter_class=HelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (None: the model's own name)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (None: $JAXSERVE_API_KEY)")
    return add_cli_args(p)


def parse_args(argv=None):
    """Parse and sanity-check the flags. Raises UsageError with a one-line message."""
    args = build_parser().parse_args(argv)
    if args.model is not None and args.load_format != "dummy":
        path = os.path.expanduser(args.model)
        if not os.path.exists(path):
            raise UsageError(f"argument --model: no such file or directory: {args.model}")
        args.model = path
    if args.api_key is None:
        args.api_key = os.environ.get("JAXSERVE_API_KEY") or None
    return args


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket. Raises UsageError if the address is unusable."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"argument --host: cannot resolve {host!r}: {e.strerror}") from None
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UsageError(f"argument --port: cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def _say(msg: str) -> None:
    print(f"[jaxserve] {msg}", flush=True)


async def serve(args, sock: socket.socket) -> int:
    """Run the server until a signal; returns the exit code."""
    from aiohttp import web

    from jaxserve.engine.async_llm import AsyncLLM, EngineStartError
    from jaxserve.entrypoints.api_server import build_app

    loop = asyncio.get_running_loop()
    llm = AsyncLLM(from_cli_args(args))
    app = build_app(llm, served_model_name=args.served_model_name, api_key=args.api_key)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                           shutdown_timeout=SHUTDOWN_GRACE_S)
    stop = asyncio.Event()

    def on_signal():
        if stop.is_set():  # a second Ctrl-C: do not wait for in-flight requests
            llm.fail_all("the server is shutting down")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    _say(f"listening on {url} (503 until the engine is ready); starting the engine process")

    code = 0
    start = asyncio.ensure_future(llm.start())
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if start.done() and start.exception() is None:
            name = args.served_model_name or llm.model_name
            _say(f"ready: serving {name!r} (max_model_len {llm.max_model_len}, allocator "
                 f"fraction {llm.allocator_fraction:g} of device memory) at {url}/v1")
            await stopper
        elif start.done():
            e = start.exception()
            msg = str(e) if isinstance(e, EngineStartError) else f"{type(e).__name__}: {e}"
            print(f"{PROG}: error: cannot start the engine for --model "
                  f"{args.model or 'default'}: {msg}", file=sys.stderr, flush=True)
            code = 2
        else:
            start.cancel()
        _say("shutting down")
    finally:
        stopper.cancel()
        await site.stop()
        await llm.shutdown(grace_s=SHUTDOWN_GRACE_S if code == 0 else 0.0)
        await runner.cleanup()
        llm.engine_core.kill()
    if code == 0:
        _say("stopped")
    return code


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="[jaxserve] %(levelname)s %(name)s: %(message)s")
    try:
        args = parse_args(argv)
        sock = bind_socket(args.host, args.port)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        return asyncio.run(serve(args, sock))
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - one line, the traceback only with JAXSERVE_DEBUG
        if os.environ.get("JAXSERVE_DEBUG"):
            raise
        print(f"{PROG}: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
