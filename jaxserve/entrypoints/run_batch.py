"""``python -m jaxserve.entrypoints.run_batch -i in.jsonl -o out.jsonl [--model M ...]``: vLLM's
batch runner (``vllm.entrypoints.openai.run_batch``, ``vllm run-batch``).

Runs a file of OpenAI Batch API request lines (chat completions and completions,
``batch_protocol``) through the model and writes one result line per non-blank input line, in
input order. ``-i`` / ``--input-file`` and ``-o`` / ``--output-file`` are local paths, or ``-``
for stdin / stdout (vLLM also takes http(s) URLs; here they are a usage error: fetch the file
first). The other flags are the server's that shape its answers (``--served-model-name``,
``--tool-call-parser``, ``--reasoning-parser``, ``--return-tokens-as-token-ids``,
``--lora-modules``) and every engine flag (``--help`` lists them).

Each body is answered by the server itself: the server's aiohttp app (``build_app``, as
``python -m jaxserve.serve`` builds it) runs in this process on 127.0.0.1, on a port the kernel
picks, guarded by an API key made for the run, and every line's body is POSTed to it on its url,
at most 2 x ``max_num_seqs`` at once (vLLM's bound), so the engine batches them. A line's result
is exactly what a client of the server would get for that body; a failed line does not stop the
others. Logs go to stderr (this process's and the engine's), so with ``-o -`` stdout carries the
results only.

Exit status: 0 once every line has its result line, failed lines included (vLLM's: a failed
request is a result); 2 for a usage problem (a bad flag, an input that cannot be read, an output
that cannot be written, a URL) or a model the engine cannot start, one line on stderr naming it;
3 when the engine process died during the batch (the lines it was running, and those after,
have error results); 130 when interrupted (the output holds the lines finished in order before
it); 1 for anything else unexpected.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import IO, Any

from jaxserve.engine.arg_utils import HelpFormatter, from_cli_args
from jaxserve.entrypoints.batch_protocol import BatchLineError, batch_output, parse_batch_line
from jaxserve.entrypoints.limits import ServerLimits
from jaxserve.serve import (UsageError, UsageParser, add_app_args, app_options, bind_socket,
                            check_app_args, configure_logging, run_guarded, serve_lora_modules,
                            start_failure)

PROG = "python -m jaxserve.entrypoints.run_batch"
EXIT_ENGINE_FAILED = 3
# The in-process server's bounds: the batch bounds its own concurrency, and its bodies come
# from the user's own file, so no body size, queue or stored response is bounded for it.
BATCH_LIMITS = ServerLimits(max_waiting_requests=2**62, max_body_bytes=2**62,
                            max_stored_responses=0)


def build_parser() -> UsageParser:
    p = UsageParser(prog=PROG, description="Run a file of OpenAI Batch API requests "
                    "(chat completions and completions) through jaxserve.",
                    formatter_class=HelpFormatter)
    p.add_argument("-i", "--input-file", required=True, help=(
        "the requests: a JSONL file of OpenAI Batch API lines (custom_id, method, url, body), "
        "or - for stdin"))
    p.add_argument("-o", "--output-file", required=True, help=(
        "where the results go, one JSONL line per input line in input order (overwritten), "
        "or - for stdout"))
    return add_app_args(p)


def log(msg: str) -> None:
    print(f"[jaxserve run_batch] {msg}", file=sys.stderr, flush=True)


def open_files(args) -> tuple[IO[bytes], IO[str]]:
    """(input, output) of ``-i`` and ``-o``; the output is opened (emptied) now, so that an
    unwritable one is told before the model loads.

    Raises:
      UsageError: a URL, a missing or unreadable input, an unwritable output.
    """
    for flag, value in (("--input-file", args.input_file), ("--output-file", args.output_file)):
        if "://" in value:
            raise UsageError(f"argument {flag}: URLs are not supported ({value}); give a local "
                             "path, or - for stdin / stdout")
    try:
        source = sys.stdin.buffer if args.input_file == "-" else open(args.input_file, "rb")
    except OSError as e:
        raise UsageError(f"argument --input-file: cannot read {args.input_file}: "
                         f"{e.strerror}") from None
    if args.output_file == "-":  # fd 1 itself goes to stderr (main): the results keep a copy
        sys.stdout.flush()
        return source, os.fdopen(os.dup(1), "w", encoding="utf-8")
    try:
        return source, open(args.output_file, "w", encoding="utf-8")
    except OSError as e:
        raise UsageError(f"argument --output-file: cannot write {args.output_file}: "
                         f"{e.strerror}") from None


async def read_lines(source: IO[bytes]) -> AsyncIterator[tuple[int, bytes]]:
    """(1-based line number, line) of each non-blank line, read on a thread: a slow stdin
    never holds the event loop, which serves the requests."""
    loop = asyncio.get_running_loop()
    number = 0
    while raw := await loop.run_in_executor(None, source.readline):
        number += 1
        if number == 1:  # a byte-order mark (Windows editors write one) is not JSON
            raw = raw.removeprefix(codecs.BOM_UTF8)
        if raw.strip():
            yield number, raw.rstrip(b"\r\n")


class OrderedWriter:
    """Writes result lines in input order as they come, holding those that finish early."""

    def __init__(self, sink: IO[str]):
        self.sink = sink
        self.next = 0
        self.held: dict[int, dict] = {}
        self.failed = 0

    def put(self, index: int, result: dict) -> None:
        self.failed += result["response"]["status_code"] != 200
        self.held[index] = result
        while self.next in self.held:
            self.sink.write(json.dumps(self.held.pop(self.next), ensure_ascii=False) + "\n")
            self.next += 1


async def post(session, url: str, line) -> dict:
    """The result line of one request sent to the in-process server."""
    try:
        async with session.post(url + line.url, json=line.body) as resp:
            text = await resp.text()
            status = resp.status
    except Exception as e:  # noqa: BLE001 - the server is in this process; told, not raised
        return batch_output(line.custom_id, 500, error=f"{type(e).__name__}: {e}")
    try:
        body: Any = json.loads(text)
    except ValueError:
        body = text
    if status == 200:
        return batch_output(line.custom_id, 200, body=body)
    return batch_output(line.custom_id, status, error=body)


async def run_lines(source: IO[bytes], writer: OrderedWriter, url: str, api_key: str,
                    limit: int) -> int:
    """Sends every line (at most ``limit`` at once) and writes its result; returns the number
    of lines."""
    import aiohttp

    slots = asyncio.Semaphore(limit)
    tasks: set[asyncio.Task] = set()

    async def run_one(index: int, line) -> None:
        try:
            writer.put(index, await post(session, url, line))
        finally:
            slots.release()

    index = 0
    headers = {"Authorization": f"Bearer {api_key}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=limit)) as session:
        try:
            async for number, raw in read_lines(source):
                try:
                    line = parse_batch_line(raw)
                except BatchLineError as e:
                    writer.put(index, batch_output(e.custom_id, 400, error=f"line {number}: {e}"))
                else:
                    await slots.acquire()
                    task = asyncio.ensure_future(run_one(index, line))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                index += 1
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
    return index


async def run_batch(args, source: IO[bytes], sink: IO[str]) -> int:
    """Starts the engine and the in-process server, runs every line; returns the exit code."""
    from aiohttp import web

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.api_server import build_app
    from jaxserve.sampling_params import describe_sampling_defaults

    loop = asyncio.get_running_loop()
    this = asyncio.current_task()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, this.cancel)
    api_key = secrets.token_urlsafe(32)  # only this process's client may use the server
    llm = AsyncLLM(from_cli_args(args))
    app = build_app(llm, **app_options(args), api_key=api_key, limits=BATCH_LIMITS)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    try:
        t0 = time.perf_counter()
        try:
            await llm.start(lambda: serve_lora_modules(app, args.lora_modules))
        except Exception as e:  # noqa: BLE001 - one line naming the flag or the model
            print(f"{PROG}: error: {start_failure(args, e)}", file=sys.stderr, flush=True)
            return 2
        await runner.setup()
        sock = bind_socket("127.0.0.1", 0)
        await web.SockSite(runner, sock).start()
        host, port = sock.getsockname()[:2]
        limit = 2 * llm.config.max_num_seqs
        log(f"ready in {time.perf_counter() - t0:.1f}s: serving "
            f"{args.served_model_name or llm.model_name!r} at http://{host}:{port} to this "
            f"process alone, {limit} requests at once")
        log("sampling defaults for requests that leave them out: "
            f"{describe_sampling_defaults(llm.generation_config)}")
        writer = OrderedWriter(sink)
        t1 = time.perf_counter()
        lines = await run_lines(source, writer, f"http://{host}:{port}", api_key, limit)
        sink.flush()
        log(f"{lines} lines in {time.perf_counter() - t1:.1f}s: {lines - writer.failed} ok, "
            f"{writer.failed} failed; results in {args.output_file}")
        if llm.failed.is_set():
            print(f"{PROG}: error: the engine process died during the batch; the lines it was "
                  "running and those after it have error results", file=sys.stderr, flush=True)
            return EXIT_ENGINE_FAILED
        return 0
    finally:
        await runner.cleanup()
        await llm.shutdown()
        llm.engine_core.kill()


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    try:
        args = build_parser().parse_args(argv)
        check_app_args(args)
        if args.host_id:
            raise UsageError("argument --host-id: run_batch is host 0; start the other hosts "
                             "with python -m jaxserve.serve --host-id N")
        source, sink = open_files(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    # Every line written to stdout from here on, this process's and the engine process's (which
    # inherits fd 1), goes to stderr: the results have stdout (or their file) to themselves.
    sys.stdout.flush()
    os.dup2(2, 1)

    def run() -> int:
        try:
            return asyncio.run(run_batch(args, source, sink))
        except asyncio.CancelledError:  # SIGINT / SIGTERM (run_batch's handlers)
            print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
            return 130
        finally:
            sink.close()

    return run_guarded(PROG, run)


if __name__ == "__main__":
    sys.exit(main())
