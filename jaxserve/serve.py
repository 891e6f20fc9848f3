"""``python -m jaxserve.serve``: the OpenAI-compatible HTTP server.

Parses the CLI flags, binds the port (so a busy port fails at once), starts the aiohttp app
(every endpoint but /health, /version, /metrics and the page at / answers 503 until the engine is
ready), spawns the engine process, and serves until SIGINT/SIGTERM. Shutdown stops accepting
connections, lets in-flight requests finish for ``--shutdown-timeout`` seconds, ends the rest with
an error, and waits for the engine process to exit. An engine process that dies is restarted up to
``--max-engine-restarts`` times (docs/reliability.md); after that the server exits with code 3.
With ``--num-hosts`` above 1, host 0 does all that and every other host (``--host-id`` > 0) runs
only the engine, in this process, following host 0's steps (docs/parallelism.md).

Exit codes: 0 after a clean shutdown, 2 for a bad flag or a model the engine cannot load (one
line on stderr naming it, no traceback), 3 when the engine died and could not be restarted, 1 for
anything else unexpected.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import resource
import signal
import socket
import sys
from collections.abc import Callable
from typing import NamedTuple

from jaxserve.distributed import check_hosts
from jaxserve.engine.arg_utils import HelpFormatter, add_cli_args, bounded, from_cli_args
from jaxserve.entrypoints.cors import CorsOptions
from jaxserve.entrypoints.limits import ServerLimits
from jaxserve.entrypoints.serving_models import RUNTIME_LORA_ENV
from jaxserve.entrypoints.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from jaxserve.lora.checkpoint import read_adapter
from jaxserve.metrics import METRICS_PREFIXES
from jaxserve.reasoning import REASONING_PARSERS
from jaxserve.spec_decode.config import SpeculativeConfig

PROG = "python -m jaxserve.serve"
EXIT_ENGINE_FAILED = 3
# File descriptors kept beyond --max-connections (the pipe, the tokenizer's files, logs).
_SPARE_FDS = 256


class UsageError(Exception):
    """A bad flag value: one line, exit code 2."""


class UsageParser(argparse.ArgumentParser):
    """argparse whose errors are UsageError (one line, exit code 2) instead of usage + exit."""

    def error(self, message):  # one clear line instead of usage + error
        raise UsageError(message)


_port = bounded(int, lambda v: 0 <= v <= 65535, "in 0..65535")
_count = bounded(int, lambda v: v >= 0, "non-negative")
_positive_int = bounded(int, lambda v: v > 0, "positive")
_positive = bounded(float, lambda v: v > 0, "positive")
_grace = bounded(float, lambda v: v >= 0, "non-negative")


def _json_list(text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form: ``'["https://a.example"]'``)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as "
                                         f"'[\"*\"]', got {text!r}")
    return value


class LoRAModulePath(NamedTuple):
    """One ``--lora-modules`` item (vLLM's ``LoRAModulePath``).

    Attributes:
      name: the name requests give as ``model``.
      path: the PEFT folder, ``~`` expanded.
      base_model_name: the model the adapter is for, the served model's name (the adapter's
        ``parent`` in ``GET /v1/models``); None: the served model.
    """

    name: str
    path: str
    base_model_name: str | None = None


def _lora_module(text: str) -> LoRAModulePath:
    """A ``--lora-modules`` item in either of vLLM's forms: ``name=path``, or a JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (``base_model_name`` optional).

    Raises:
      argparse.ArgumentTypeError: neither form, invalid JSON, a field other than those three,
        or a value that is not a non-empty string (base_model_name may be null; argparse names
        the flag).
    """
    if not text.lstrip().startswith("{"):
        name, sep, path = text.partition("=")
        if not (sep and name and path):
            raise argparse.ArgumentTypeError(
                f"expected name=path or a JSON object with name, path and optionally "
                f"base_model_name, got {text!r}")
        return LoRAModulePath(name, os.path.expanduser(path))
    try:
        fields = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON ({e}): {text!r}") from None
    unknown = sorted(set(fields) - set(LoRAModulePath._fields))
    missing = [k for k in ("name", "path") if k not in fields]
    if unknown or missing:
        raise argparse.ArgumentTypeError(
            (f"unknown fields {unknown}" if unknown else f"missing fields {missing}")
            + f" in {text!r}; the fields are name, path and optionally base_model_name")
    for key, value in fields.items():
        if not (isinstance(value, str) and value or key == "base_model_name" and value is None):
            raise argparse.ArgumentTypeError(f"{key} must be a non-empty string in {text!r}")
    return LoRAModulePath(fields["name"], os.path.expanduser(fields["path"]),
                          fields.get("base_model_name"))


def build_parser() -> argparse.ArgumentParser:
    p = UsageParser(prog=PROG, description="OpenAI-compatible LLM server on JAX/XLA.",
                formatter_class=HelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--api-key", default=None, help=(
        "require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (/health, "
        "/version and /metrics stay open); prefer the environment variable JAXSERVE_API_KEY, "
        "used when this flag is not given: a flag's value shows in `ps` to every user of the "
        "machine"))
    cors = CorsOptions()
    p.add_argument("--allowed-origins", type=_json_list, default=cors.allowed_origins, help=(
        "the origins whose browser pages may call the API (CORS), a JSON list; [\"*\"]: any"))
    p.add_argument("--allowed-methods", type=_json_list, default=cors.allowed_methods,
                   help="the HTTP methods a cross-origin request may use, a JSON list")
    p.add_argument("--allowed-headers", type=_json_list, default=cors.allowed_headers,
                   help="the headers a cross-origin request may send, a JSON list")
    p.add_argument("--allow-credentials", action="store_true",
                   help="cross-origin requests may carry cookies or HTTP authentication")
    p.add_argument("--metrics-prefix", choices=METRICS_PREFIXES, default="jaxserve", help=(
        "vllm: the /metrics that vLLM has too are named vllm:* with vLLM's labels, for vLLM's "
        "dashboards; docs/architecture.md, \"Engine stats\""))
    d = ServerLimits()
    g = p.add_argument_group("limits", "bounds on what clients may ask (docs/reliability.md)")
    g.add_argument("--max-waiting-requests", type=_count, default=d.max_waiting_requests, help=(
        "sequences (prompts x n of each generation request) in flight beyond the engine's "
        "--max-num-seqs; past it a request gets 503 with Retry-After"))
    g.add_argument("--max-connections", type=_positive_int, default=d.max_connections,
                   help=("open client connections served at once; a request on one past it "
                         "gets 503 with Retry-After"))
    g.add_argument("--max-request-body-mib", type=_positive, default=d.max_body_bytes / 2**20,
                   help="largest request body, MiB (413 beyond it)")
    g.add_argument("--body-timeout", type=_positive, default=d.body_timeout_s,
                   help="seconds a request body may take to arrive (408 after)")
    g.add_argument("--keepalive-timeout", type=_positive, default=d.keepalive_timeout_s, help=(
        "seconds a connection may stay open without sending a complete request (idle "
        "keep-alive, or headers that never end)"))
    g.add_argument("--request-timeout", type=_positive, default=d.request_timeout_s, help=(
        "seconds a generation request may run (504, or an error event in a stream); None: no "
        "limit"))
    g.add_argument("--max-stored-responses", type=_count, default=d.max_stored_responses, help=(
        "responses kept for GET /v1/responses/{id} and previous_response_id (store: true, "
        "OpenAI's default), least recently used out first; 0 keeps none (store is then "
        "false in every response)"))
    g.add_argument("--shutdown-timeout", type=_grace, default=5.0, help=(
        "seconds in-flight requests get to finish after SIGINT/SIGTERM"))
    g.add_argument("--max-engine-restarts", type=_count, default=3, help=(
        "times a dead engine process is started again (in-flight requests fail, new ones get "
        "503 until it is back); after that the server exits with code 3 (0: exit at once, for "
        "a supervisor to restart)"))
    return add_app_args(p)


def add_app_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the flags that shape the API's answers (``--served-model-name``, the tool-call and
    reasoning parsers, ``--return-tokens-as-token-ids``, ``--lora-modules``) and every engine
    flag (``arg_utils.add_cli_args``): the server's and ``jaxserve.entrypoints.run_batch``'s.
    Returns ``p``."""
    p.add_argument("--served-model-name", default=None,
                   help=("the name clients send as `model` (None: --model as given; without "
                         "--model, the default model's name SmolLM2-135M-Instruct)"))
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                   default=DEFAULT_TOOL_PARSER, help=(
                       "the format of the model's tool calls: hermes (Hermes 2 Pro, Qwen2.5, and "
                       "the format rendered for chat templates without tools, as the default "
                       "model's) or llama3_json (Llama 3.1 / 3.2); docs/tool_calling.md"))
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None, help=(
        "split a reasoning model's output into `reasoning` (and `reasoning_content`) and "
        "`content` in chat completions: deepseek_r1 (DeepSeek-R1, QwQ) or qwen3; output "
        "constraints and tool parsing start after the reasoning; docs/reasoning.md"))
    p.add_argument("--return-tokens-as-token-ids", action="store_true", help=(
        "write tokens in log-probabilities as 'token_id:{id}' (a request's "
        "return_tokens_as_token_ids overrides it)"))
    p.add_argument("--lora-modules", type=_lora_module, nargs="+", default=[],
                   metavar="NAME=PATH", help=(
                       "LoRA adapters (PEFT folders) served from the start under these names, "
                       "with --enable-lora, each name=path or vLLM's JSON object '{\"name\": "
                       "..., \"path\": ..., \"base_model_name\": ...}' (base_model_name "
                       "optional, the served model's name); POST /v1/load_lora_adapter adds "
                       f"more when {RUNTIME_LORA_ENV}=1 (docs/lora.md)"))
    return add_cli_args(p)


def app_options(args) -> dict:
    """``build_app``'s keyword arguments of the flags ``add_app_args`` adds."""
    return dict(served_model_name=args.served_model_name, tool_call_parser=args.tool_call_parser,
                reasoning_parser=args.reasoning_parser,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids)


def server_limits(args) -> ServerLimits:
    """The ServerLimits of parsed flags."""
    return ServerLimits(
        max_waiting_requests=args.max_waiting_requests, max_connections=args.max_connections,
        max_body_bytes=int(args.max_request_body_mib * 2**20), body_timeout_s=args.body_timeout,
        keepalive_timeout_s=args.keepalive_timeout, request_timeout_s=args.request_timeout,
        max_stored_responses=args.max_stored_responses)


def _raise_fd_limit(needed: int) -> int:
    """Raise the soft open-files limit towards ``needed`` (as vLLM does): a default of 1,024
    would fail accepts well below --max-connections. Returns the limit in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            _say(f"cannot raise the open-files limit to {want} ({e})")
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return needed if soft == resource.RLIM_INFINITY else soft


def parse_args(argv=None):
    """Parse and sanity-check the flags. Raises UsageError with a one-line message."""
    args = build_parser().parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("JAXSERVE_API_KEY") or None
    check_app_args(args)
    if args.num_hosts > 1 and args.max_engine_restarts:
        # The other hosts' processes end with host 0's engine: one could not restart alone.
        _say(f"--num-hosts {args.num_hosts}: no engine restarts (--max-engine-restarts 0)")
        args.max_engine_restarts = 0
    return args


def check_app_args(args) -> None:
    """What can be checked of ``add_app_args``' flags before the model is loaded: the model's
    path, ``--lora-modules``' folders, ``--host-id``, the ``--speculative-config`` fields that
    must agree with other flags. Raises UsageError naming the flag."""
    if args.model is not None and args.load_format != "dummy":
        # Kept as given: it is the served model name (the loader expands ~ itself).
        if not os.path.exists(os.path.expanduser(args.model)):
            raise UsageError(f"argument --model: no such file or directory: {args.model}")
    if args.lora_modules and not args.enable_lora:
        raise UsageError("argument --lora-modules: needs --enable-lora")
    for m in args.lora_modules:  # what can be checked before the model is loaded
        try:
            read_adapter(m.path, None, args.max_lora_rank, with_weights=False)
        except ValueError as e:
            raise UsageError(f"argument --lora-modules: {m.name}={m.path}: {e}") from None
    try:
        config = from_cli_args(args)
    except ValueError as e:  # a rule between flags (EngineConfig.__post_init__), naming them
        raise UsageError(str(e)) from None
    try:
        check_hosts(config)
    except ValueError as e:
        raise UsageError(f"argument --host-id: {e}") from None
    if config.speculative_config is not None:
        try:
            SpeculativeConfig.from_dict(config.speculative_config).check_engine(
                config.tensor_parallel_size, config.max_model_len)
        except ValueError as e:
            raise UsageError(f"argument --speculative-config: {e}") from None


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

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.api_server import build_app
    from jaxserve.entrypoints.limits import CappedSockSite
    from jaxserve.sampling_params import describe_sampling_defaults

    loop = asyncio.get_running_loop()
    limits = server_limits(args)
    # Connections past --max-connections are answered 503, up to the open-files limit.
    max_open = _raise_fd_limit(limits.max_connections * 2 + _SPARE_FDS) - _SPARE_FDS
    _say(f"connections: {min(limits.max_connections, max_open)} served at once "
         f"(--max-connections {limits.max_connections}); the open-files limit allows "
         f"{max_open} in all, those past --max-connections answered 503 with Retry-After")
    llm = AsyncLLM(from_cli_args(args), max_engine_restarts=args.max_engine_restarts,
                   metrics_prefix=args.metrics_prefix)
    app = build_app(llm, **app_options(args), api_key=args.api_key, limits=limits,
                    cors=CorsOptions(args.allowed_origins, args.allowed_methods,
                                     args.allowed_headers, args.allow_credentials),
                    allow_runtime_lora_updating=os.environ.get(
                        RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true"))
    # What each connection's protocol (limits.CappedSockSite makes them) is built with.
    protocol_kwargs = dict(access_log=None, keepalive_timeout=limits.keepalive_timeout_s,
                           lingering_time=limits.lingering_s)
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True,
                           shutdown_timeout=args.shutdown_timeout, **protocol_kwargs)
    stop = asyncio.Event()

    def on_signal():
        if stop.is_set():  # a second Ctrl-C: do not wait for in-flight requests
            llm.fail_all("the server is shutting down")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    await runner.setup()
    site = CappedSockSite(runner, sock, limits.max_connections, max_open, limits.retry_after_s,
                          **protocol_kwargs)
    await site.start()
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    _say(f"listening on {url} (503 until the engine is ready); starting the engine process")

    code = 0
    start = asyncio.ensure_future(llm.start(lambda: serve_lora_modules(app, args.lora_modules)))
    stopper = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(llm.failed.wait())
    try:
        await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if start.done() and start.exception() is None:
            # What start-up made (the tokenizer, the app) lives as long as the server: frozen, a
            # full collection no longer scans it (60-90 ms on 2 CPU cores, in a request's path
            # if unlucky; the engine process does the same).
            gc.collect()
            gc.freeze()
            name = args.served_model_name or llm.model_name
            _say(f"ready: serving {name!r} (max_model_len {llm.config.max_model_len}, allocator "
                 f"fraction {llm.allocator_fraction:g} of device memory) at {url}/v1; "
                 f"playground and dashboard at {url}/")
            _say("sampling defaults for requests that leave them out: "
                 f"{describe_sampling_defaults(llm.generation_config)}")
            await asyncio.wait({stopper, failed}, return_when=asyncio.FIRST_COMPLETED)
            if failed.done() and not stopper.done():
                print(f"{PROG}: error: the engine process died and was not restarted "
                      f"(--max-engine-restarts {args.max_engine_restarts})", file=sys.stderr,
                      flush=True)
                code = EXIT_ENGINE_FAILED
        elif start.done():
            print(f"{PROG}: error: {start_failure(args, start.exception())}", file=sys.stderr,
                  flush=True)
            code = 2
        else:
            start.cancel()
        _say("shutting down")
    finally:
        stopper.cancel()
        failed.cancel()
        await site.stop()
        await llm.shutdown(grace_s=args.shutdown_timeout if code == 0 else 0.0)
        await runner.cleanup()
        llm.engine_core.kill()
    if code == 0:
        _say("stopped")
    return code


def start_failure(args, e: BaseException) -> str:
    """The one line that says why ``AsyncLLM.start`` (with ``serve_lora_modules``) raised
    ``e``: a ``--lora-modules`` adapter that does not serve, or an engine that did not start."""
    from jaxserve.engine.async_llm import EngineStartError

    if isinstance(e, UsageError):
        return str(e)
    msg = str(e) if isinstance(e, EngineStartError) else f"{type(e).__name__}: {e}"
    return f"cannot start the engine for --model {args.model or 'default'}: {msg}"


async def serve_lora_modules(app, modules: list[LoRAModulePath]) -> None:
    """Serve ``--lora-modules``' adapters (once the engine is up, before the server is ready).

    Raises:
      UsageError: the first adapter that does not serve, and why.
    """
    from jaxserve.entrypoints.errors import APIError
    from jaxserve.entrypoints.serving_models import add_lora

    for m in modules:
        try:
            await add_lora(app, m.name, m.path, base_model_name=m.base_model_name)
        except APIError as e:
            raise UsageError(f"argument --lora-modules: {m.name}={m.path}: {e.message}") from None
        _say(f"serving LoRA adapter {m.name!r} from {m.path}")


def follow(args) -> int:
    """A host other than 0 (``--host-id`` > 0): the engine in this process, without a server,
    running host 0's steps until host 0 ends (docs/parallelism.md). Returns the exit code."""
    from jaxserve.engine.core import EngineCore

    try:
        core = EngineCore(from_cli_args(args), log=_say)
    except ValueError as e:
        print(f"{PROG}: error: cannot start the engine for --model {args.model or 'default'}: "
              f"{e}", file=sys.stderr, flush=True)
        return 2
    _say(f"ready: host {args.host_id} of {args.num_hosts}, following host 0")
    core.follow()
    _say("host 0 has ended; stopped")
    return 0


def configure_logging() -> None:
    """The API's log records, one line each on stderr (``SafeFormatter``: request text is
    clipped and escaped)."""
    from jaxserve.entrypoints.safe_log import SafeFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(SafeFormatter("[jaxserve] %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


def run_guarded(prog: str, run: Callable[[], int]) -> int:
    """``run()``'s exit code; 130 on Ctrl-C; 1 for anything unexpected, told in one line on
    stderr (the traceback only with JAXSERVE_DEBUG set)."""
    try:
        return run()
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - one line, the traceback only with JAXSERVE_DEBUG
        if os.environ.get("JAXSERVE_DEBUG"):
            raise
        print(f"{prog}: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


def main(argv=None) -> int:
    configure_logging()
    try:
        args = parse_args(argv)
        sock = None if args.host_id else bind_socket(args.host, args.port)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    return run_guarded(PROG, lambda: follow(args) if args.host_id
                       else asyncio.run(serve(args, sock)))

if __name__ == "__main__":
    sys.exit(main())
