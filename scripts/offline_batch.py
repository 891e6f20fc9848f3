#!/usr/bin/env python
"""Run a JSONL file of prompts through jaxserve offline, one output line per input line.

    python scripts/offline_batch.py --input in.jsonl --output out.jsonl [--model M]
        [--max-model-len N] [--max-num-seqs N] [...]

The engine flags are the server's (every EngineConfig field, jaxserve/engine/arg_utils.py);
``--help`` lists them with their defaults.

Input: one JSON object per line, either

    {"id": "q1", "prompt": "The capital of France is", "max_tokens": 8}
    {"id": "q2", "messages": [{"role": "user", "content": "Hi!"}], "temperature": 0}

Fields: exactly one of ``prompt`` (a string, or a list of token ids) or ``messages`` (chat
messages as a chat completions request takes them, read by the server's own parser,
``protocol.parse_messages``: OpenAI's format, text content parts, the ``developer`` role, tool
calls and tool results; sent through the model's chat template with the assistant turn opened);
optional ``id`` (string or integer, copied to the output); and six optional sampling fields,
``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (0 = off), ``seed``, ``stop`` (a string or a
list of strings). A field left out (or null) takes the model's sampling default, as on the server
(``--generation-config``; the start-up log names them), else vLLM's:
``max_tokens`` 16, ``temperature`` 1.0, ``top_p`` 1.0, ``top_k`` off, no seed, no stop. For whole
request bodies (every field the server takes, with its responses as output) use
``python -m jaxserve.entrypoints.run_batch`` (OpenAI's Batch API format) instead.

Validation is strict, as the OpenAI API is for a request body: a field this script does not know
(a typo such as ``max_token``) makes that line fail instead of being silently ignored (which
would quietly change the results), and so does a value of the wrong JSON type (``"8"`` for
``max_tokens``, ``true`` for ``top_k``) or out of range (``temperature`` < 0, ``top_p`` outside
(0, 1], ...). Messages are checked as the server checks them (a message without ``role``, or
with an image part, fails its line; keys of a message that the server ignores are ignored). A
prompt that is empty or has no room left to generate within ``--max-model-len`` fails too. Blank
lines are skipped.

Output: one JSON object per non-blank input line, in input order:

    {"id": "q1", "line": 1, "text": "...", "prompt_tokens": 6, "completion_tokens": 8,
     "finish_reason": "length"}

``line`` is the 1-based line number in the input file; ``finish_reason`` is "stop" (EOS or a stop
string) or "length" (max_tokens or max_model_len). A line that failed gives instead

    {"id": "q7", "line": 7, "error": "line 7: messages: Field required ..."}

(``id`` is null when the line has none or could not be parsed), and the other lines are still run.
All valid lines go to the engine together, in one batch (continuous batching; a tqdm progress bar
on stderr). A file with no valid line loads no model.

Exit status: 0 when every line succeeded; 1 when at least one line failed; 2 for a command-line
problem (missing input file, unwritable output, unusable model or engine flags), reported as one
line on stderr naming the flag.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import json
import os
import pathlib
import sys
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from jaxserve.engine.arg_utils import HelpFormatter, add_cli_args, from_cli_args
from jaxserve.entrypoints.batch_protocol import json_object_line
from jaxserve.entrypoints.protocol import parse_messages
from jaxserve.exceptions import ValidationError as RequestValidationError
from jaxserve.sampling_params import SamplingParams

# jaxserve.LLM (and with it JAX) is imported in main(), after the arguments are checked, so that a
# command-line error is reported at once.


class BatchLine(BaseModel):
    """One input line. Strict: unknown fields and wrong JSON types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | int | None = None
    prompt: str | list[int] | None = None
    # Read by the server's own parser in parse_line (protocol.parse_messages), which names the
    # message's field at fault; after it, the messages for the chat template.
    messages: list[Any] | None = None
    # Sampling fields (SAMPLING_FIELDS); None: the model's default (main()).
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, v):
        if v is None:
            return v
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be empty")
            return v
        if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            if not v:
                raise ValueError("must not be empty")
            if min(v) < 0:
                raise ValueError("token ids are non-negative")
            return v
        raise ValueError("must be a string or a list of integer token ids")

    @model_validator(mode="after")
    def _one_input(self) -> "BatchLine":
        if (self.prompt is None) == (self.messages is None):
            which = "both" if self.prompt is not None else "neither"
            raise ValueError(f"give exactly one of 'prompt' and 'messages' (got {which})")
        return self


SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}


class LineError(Exception):
    """A problem with one input line; the message is what the output line reports."""


def format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def parse_line(raw: bytes) -> tuple[Any, BatchLine]:
    """Returns (id, validated line). Raises LineError with (id or None) in ``args[1]``."""
    try:
        obj = json_object_line(raw)
    except ValueError as e:
        raise LineError(str(e), None) from None
    line_id = obj.get("id")
    if not isinstance(line_id, (str, int)) or isinstance(line_id, bool):
        line_id = None
    try:
        line = BatchLine.model_validate(obj)
        if line.messages is not None:
            line.messages = parse_messages(line.messages)
    except ValidationError as e:
        raise LineError(format_validation_error(e), line_id) from None
    except RequestValidationError as e:  # parse_messages': "messages.0.content: ..."
        raise LineError(str(e), line_id) from None
    try:  # the ranges, before any model is loaded (main() adds the model's defaults)
        SamplingParams(**line.model_dump(include=SAMPLING_FIELDS, exclude_none=True))
    except ValueError as e:
        raise LineError(str(e), line_id) from None
    return line_id, line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="offline_batch.py", description=__doc__.split("\n\n")[0],
                formatter_class=HelpFormatter)
    p.add_argument("--input", required=True, help="input JSONL file")
    p.add_argument("--output", required=True, help="output JSONL file (overwritten)")
    return add_cli_args(p)


def log(msg: str):
    print(f"[offline_batch] {msg}", file=sys.stderr, flush=True)


def cli_fail(parser: argparse.ArgumentParser, message: str):
    parser.error(message)


def run_lines(records: list[dict], args: argparse.Namespace, parser: argparse.ArgumentParser):
    """Loads the model and runs every parsed line: each record gets "result" or "error"."""
    t0 = time.perf_counter()
    from jaxserve import LLM

    try:
        llm = LLM(log=log, **dataclasses.asdict(from_cli_args(args)))
    except ValueError as e:
        msg = str(e)
        if "--" not in msg:  # the loader's messages name the model, not the flag
            msg = f"--model: {msg}"
        cli_fail(parser, msg)
    log(f"engine ready in {time.perf_counter() - t0:.1f}s")

    # LLM's own InputProcessor tokenizes and checks each line (the server and LLM.generate /
    # LLM.chat use the same one), so that a bad line fails alone and every valid line, prompt or
    # chat, goes to the engine in one generate() call.
    processor = llm.input_processor
    batch_ids, batch_params, batch_recs = [], [], []
    for rec in records:
        req: BatchLine | None = rec.get("req")
        if req is None:
            continue
        n = rec["line"]
        try:
            sp = SamplingParams(**{**llm.engine.generation_config,
                                   **req.model_dump(include=SAMPLING_FIELDS, exclude_none=True)})
            if req.messages is not None:
                _, ids = processor.tokenize_chat(req.messages)
            else:
                ids = processor.tokenize_prompt(req.prompt)
            processor.check_prompt(ids)
        except ValueError as e:
            rec["error"] = f"line {n}: {e}"
            continue
        batch_ids.append(ids)
        batch_params.append(sp)
        batch_recs.append(rec)

    if batch_ids:
        t1 = time.perf_counter()
        outputs = llm.generate(batch_ids, batch_params, use_tqdm=True)
        gen_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        dt = time.perf_counter() - t1
        log(f"{len(outputs)} requests, {gen_tokens} output tokens in {dt:.1f}s "
            f"({gen_tokens / dt:.1f} tok/s)")
        for rec, out in zip(batch_recs, outputs):
            c = out.outputs[0]
            rec["result"] = {
                "text": c.text,
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": len(c.token_ids),
                "finish_reason": c.finish_reason,
            }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    in_path, out_path = pathlib.Path(args.input), pathlib.Path(args.output)
    if not in_path.is_file():
        cli_fail(parser, f"--input: {in_path} does not exist or is not a file")
    try:
        # A byte-order mark (Windows editors write one) is not part of line 1's JSON.
        raw_lines = in_path.read_bytes().removeprefix(codecs.BOM_UTF8).splitlines()
    except OSError as e:
        cli_fail(parser, f"--input: cannot read {in_path}: {e.strerror}")
    out_dir = out_path.parent if str(out_path.parent) else pathlib.Path(".")
    if not out_dir.is_dir():
        cli_fail(parser, f"--output: folder {out_dir} does not exist")
    if out_path.is_dir():
        cli_fail(parser, f"--output: {out_path} is a folder")
    if not os.access(out_dir, os.W_OK) or (out_path.exists() and not os.access(out_path, os.W_OK)):
        cli_fail(parser, f"--output: {out_path} is not writable")

    # Parse every line before loading the model: pure-syntax errors need no engine.
    records: list[dict] = []  # in input order: {"line", "id", "req" | "error"}
    for n, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        try:
            line_id, req = parse_line(raw)
            records.append({"line": n, "id": line_id, "req": req})
        except LineError as e:
            records.append({"line": n, "id": e.args[1], "error": f"line {n}: {e.args[0]}"})

    if any("req" in rec for rec in records):  # no valid line: no model to load
        run_lines(records, args, parser)
    else:
        log("no valid line: the model is not loaded")

    failed = 0
    with out_path.open("w", encoding="utf-8") as f:
        for rec in records:
            row = {"id": rec["id"], "line": rec["line"]}
            if "error" in rec:
                failed += 1
                row["error"] = rec["error"]
            else:
                row.update(rec["result"])
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    log(f"wrote {len(records)} lines to {out_path}: {len(records) - failed} ok, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
