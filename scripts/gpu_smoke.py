"""Every request type against the server with default flags, for a matrix of model shapes.

For each `--shape` (a dummy preset of `jaxserve.model_loader.dummy`, or a `config.json` path:
random weights of that shape) and each `--model` (a real checkpoint), starts
`python -m jaxserve.serve --model M [--load-format dummy] --port P` with no other flag (or with
`--server-args`), waits for `/health`, and sends:

- `chat`, `chat-stream`, `completions`: a short answer (16 tokens), streamed to `[DONE]` with no
  error event for the stream;
- `n=4`: four sampled choices; `logprobs`: chat `top_logprobs` 5 and completions `logprobs` 5;
  `penalties`: presence, frequency and repetition penalties together;
- `json_schema`: `response_format` with a schema; the answer must parse and validate
  (jsonschema, where installed: else it must parse);
- `long-prompt`: one prompt of min(max_model_len - 64, 32,000) token ids;
- `every-model`: a chat to each other model `/v1/models` lists (LoRA adapters);
- `burst`: `--burst` (default 2 x 256, the GPU's default --max-num-seqs) completions sent at
  once, each 64 prompt ids and 32 output tokens (`ignore_eos`), cycling over the listed models:
  every one complete.

With `--hf-reference` (a real `--model` whose HF transformers counterpart is built with
`checkpoints_tools.convert`), a second server of that model with `--dtype float32` then
greedy-decodes `--greedy-prompts` ShareGPT prompts (`--greedy-tokens` each, the chat template
applied), compared with transformers in float32 up to the reference's first near-tie
(docs/architecture.md's "Testing numerics" rule, tests/greedy.py, is for float32 on both sides:
bfloat16 logits move by more than its 1e-3).

Prints one table row per model and writes `--result-dir/gpu_smoke.json`; the exit code is 1 when
any request failed.

    python scripts/gpu_smoke.py --shape smollm2-135m --shape llama-3.1-8b \\
        --model ~/.cache/jaxserve/SmolLM2-135M-Instruct.Q4_1.gguf --hf-reference
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import numpy as np

try:
    import jsonschema
except ImportError:  # the GPU image lacks it: json_schema answers are then parsed, not validated
    jsonschema = None

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from sharegpt import first_turns  # noqa: E402

TOKEN_IDS_BELOW = 49152  # the borrowed tokenizer's vocabulary: every dummy model has at least it
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m jaxserve.serve` on a free port, its log in `log_path`."""

    def __init__(self, model: str, dummy: bool, log_path: pathlib.Path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "jaxserve.serve", "--model", model, "--port", str(self.port),
               *flags]
        if dummy:
            cmd += ["--load-format", "dummy"]
        self.command = " ".join(cmd[1:])
        self.log = open(log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=REPO)

    async def wait_ready(self, session, timeout_s: float) -> float:
        """Seconds until /health answered 200. Raises RuntimeError if the server exits first."""
        while time.perf_counter() - self.started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}")
            try:
                async with session.get(f"{self.url}/health") as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1)
        raise RuntimeError(f"not ready in {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


async def post(session, url: str, body: dict) -> dict:
    """The JSON answer of a non-streamed request. Raises RuntimeError on a non-200 answer."""
    async with session.post(url, json=body) as r:
        text = await r.text()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {text[:300]}")
        return json.loads(text)


async def stream(session, url: str, body: dict) -> list[dict]:
    """The events of a streamed request, up to [DONE]. Raises RuntimeError on a non-200 answer,
    an error event or a stream that ends without [DONE]."""
    events = []
    async with session.post(url, json=body | {"stream": True}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return events
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            events.append(event)
    raise RuntimeError("the stream ended without [DONE]")


def random_ids(n: int, rng) -> list[int]:
    return rng.integers(10, TOKEN_IDS_BELOW, n).tolist()


async def checks(session, url: str, models: list[str], max_model_len: int, burst: int,
                 rng) -> dict[str, str]:
    """Each request type -> "ok" or what failed. ``models``: what `/v1/models` lists, the base
    model first; the others (LoRA adapters) each answer a chat, and the burst cycles over all."""
    model = models[0]
    chat, comp = f"{url}/v1/chat/completions", f"{url}/v1/completions"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    base = {"model": model, "max_tokens": 16}

    async def chat_once():
        out = await post(session, chat, base | {"messages": msgs})
        assert out["choices"][0]["message"]["role"] == "assistant"

    async def chat_stream():
        events = await stream(session, chat, base | {"messages": msgs})
        assert any(e["choices"] and e["choices"][0]["delta"].get("content") for e in events)

    async def completions():
        out = await post(session, comp, base | {"prompt": "The capital of France is"})
        assert out["usage"]["completion_tokens"] > 0

    async def n4():
        out = await post(session, comp, base | {"prompt": "Once upon a time", "n": 4,
                                                "temperature": 0.8})
        assert len(out["choices"]) == 4

    async def logprobs():
        out = await post(session, chat, base | {"messages": msgs, "logprobs": True,
                                                "top_logprobs": 5})
        content = out["choices"][0]["logprobs"]["content"]
        counts = [len(t["top_logprobs"]) for t in content]
        assert content and set(counts) == {5}, f"chat top_logprobs per token: {counts}"
        out = await post(session, comp, base | {"prompt": "Hello", "logprobs": 5})
        # a dict by token text: up to 5 alternatives and the sampled token when it is not
        # among them (OpenAI's and vLLM's), and alternatives that decode alike (random
        # weights pick byte tokens that decode to U+FFFD) share one key
        counts = [len(t) for t in out["choices"][0]["logprobs"]["top_logprobs"]]
        assert counts and all(1 <= c <= 6 for c in counts), f"completions top_logprobs: {counts}"

    async def penalties():
        await post(session, chat, base | {"messages": msgs, "presence_penalty": 0.5,
                                          "frequency_penalty": 0.5, "repetition_penalty": 1.2})

    async def json_schema():
        out = await post(session, chat, {"model": model, "max_tokens": 64, "messages": [
            {"role": "user", "content": "Give a person's name and age as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": SCHEMA}}})
        choice = out["choices"][0]
        if choice["finish_reason"] == "stop":  # a 64-token cut leaves a prefix of valid JSON
            answer = json.loads(choice["message"]["content"])
            if jsonschema is not None:
                jsonschema.validate(answer, SCHEMA)

    async def long_prompt():
        n = min(max_model_len - 64, 32_000)
        out = await post(session, comp, base | {"prompt": random_ids(n, rng)})
        assert out["usage"]["prompt_tokens"] == n

    async def every_model():
        for name in models[1:]:
            out = await post(session, chat, base | {"model": name, "messages": msgs})
            assert out["model"] == name, f"asked {name}, answered as {out['model']}"

    async def burst_all():
        async def one(i):
            body = {"model": models[i % len(models)], "prompt": random_ids(64, rng), "max_tokens": 32,
                    "ignore_eos": True}
            return (await post(session, comp, body))["usage"]["completion_tokens"]

        got = await asyncio.gather(*(one(i) for i in range(burst)), return_exceptions=True)
        bad = [g for g in got if g != 32]
        assert not bad, f"{len(bad)} of {burst} failed, first: {bad[0]!r}"

    results = {}
    for name, fn in [("chat", chat_once), ("chat-stream", chat_stream),
                     ("completions", completions), ("n=4", n4), ("logprobs", logprobs),
                     ("penalties", penalties), ("json_schema", json_schema),
                     ("long-prompt", long_prompt), ("every-model", every_model),
                     ("burst", burst_all)]:
        try:
            await fn()
            results[name] = "ok"
        except Exception as e:  # noqa: BLE001 - each failure is reported, the rest still run
            results[name] = f"{type(e).__name__}: {e}"[:300]
    return results


def hf_reference(gguf: str, work: pathlib.Path):
    """(HF transformers model in float32, its tokenizer) of a GGUF, converted to an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = work / "hf"
    if not (folder / "config.json").exists():
        subprocess.run([sys.executable, "-m", "checkpoints_tools.convert", "--input", gguf,
                        "--output", str(folder), "--to", "hf"], check=True, cwd=REPO)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(folder))


async def greedy_agreement(session, url, model_name, hf, tokenizer, n, max_tokens) -> dict:
    """Greedy decoding through the server against HF transformers (float32) on n ShareGPT
    prompts; docs/architecture.md's "Testing numerics" rule."""
    import torch

    from tests.greedy import compare_greedy, hf_greedy_margins

    same, compared, differs = 0, 0, []
    for i, text in enumerate(first_turns()[:n]):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text[:2000]}],
                                            add_generation_prompt=True)
        ids = list(getattr(ids, "input_ids", ids))
        out = await post(session, f"{url}/v1/completions", {
            "model": model_name, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True})
        ours = out["choices"][0]["token_ids"]
        with torch.no_grad():
            # (no min_new_tokens: it would forbid the end-of-sequence token that ours may end on)
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=len(ours),
                              do_sample=False)[0, len(ids):].tolist()
        ok, upto = compare_greedy(ours, ref, hf_greedy_margins(hf, ids, ref))
        same += ok
        compared += upto
        if not ok:
            differs.append(i)
    return {"prompts": n, "identical": same, "positions_compared": compared, "differ": differs}


async def serve_and(model: str, dummy: bool, args, work: pathlib.Path, label: str, flags,
                    then) -> dict:
    """Start a server, wait for it, run ``then(session, url, cards)`` (`/v1/models`' list) and
    stop it: a row with its command, readiness time, max_model_len and what ``then`` returned."""
    row = {}
    server = Server(model, dummy, work / f"{label}.log", *flags)
    row["command"] = server.command
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    try:
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            row["ready_s"] = round(await server.wait_ready(session, args.start_timeout), 1)
            async with session.get(f"{server.url}/v1/models") as r:
                cards = (await r.json())["data"]
            row["max_model_len"] = cards[0]["max_model_len"]
            row |= await then(session, server.url, cards)
    except Exception as e:  # noqa: BLE001 - a server that did not start is one failed row
        row["checks"] = {"start": f"{type(e).__name__}: {e}"}
    finally:
        server.stop()
    log = (work / f"{label}.log").read_text().splitlines()
    row["memory_log"] = [line for line in log if "GPU memory:" in line or "KV cache:" in line]
    return row


async def run_one(model: str, dummy: bool, args, work: pathlib.Path) -> dict:
    name = pathlib.Path(model).name if not dummy else model

    async def all_checks(session, url, cards):
        rng = np.random.default_rng(0)
        return {"checks": await checks(session, url, [c["id"] for c in cards],
                                       cards[0]["max_model_len"], args.burst, rng)}

    row = {"model": name, "dummy": dummy}
    row |= await serve_and(model, dummy, args, work, name, shlex.split(args.server_args),
                           all_checks)
    if args.hf_reference and not dummy:
        hf, tok = hf_reference(model, work)

        async def greedy(session, url, cards):
            return {"greedy": await greedy_agreement(session, url, cards[0]["id"], hf, tok,
                                                     args.greedy_prompts, args.greedy_tokens)}

        f32 = await serve_and(model, dummy, args, work, f"{name}-float32",
                              ("--dtype", "float32"), greedy)
        row["greedy"] = f32.get("greedy")
        row["checks"]["greedy-float32-server"] = "ok" if "greedy" in f32 else str(f32["checks"])
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", default=[],
                    help="a dummy preset or config.json path (random weights); repeatable")
    ap.add_argument("--model", action="append", default=[],
                    help="a real checkpoint (GGUF file, HF or orbax folder); repeatable")
    ap.add_argument("--hf-reference", action="store_true",
                    help="greedy against HF transformers for each real --model (a GGUF)")
    ap.add_argument("--greedy-prompts", type=int, default=20)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--server-args", default="",
                    help="more server flags, one shell-quoted string (default: none); with "
                         "--enable-lora every listed adapter is checked too")
    ap.add_argument("--burst", type=int, default=512, help="requests sent at once")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds")
    ap.add_argument("--request-timeout", type=float, default=900, help="seconds")
    ap.add_argument("--result-dir", default="gpu_smoke_results")
    args = ap.parse_args()
    if not args.shape and not args.model:
        ap.error("give at least one --shape or --model")
    work = pathlib.Path(args.result_dir)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for model, dummy in [(s, True) for s in args.shape] + [(m, False) for m in args.model]:
        row = asyncio.run(run_one(model, dummy, args, work))
        rows.append(row)
        failed = {k: v for k, v in row["checks"].items() if v != "ok"}
        greedy = row.get("greedy")
        print(f"{row['model']:<28} ready {row.get('ready_s', '-'):>6} s  "
              f"max_model_len {row.get('max_model_len', '-'):>7}  "
              f"{len(row['checks']) - len(failed)}/{len(row['checks'])} ok"
              + (f"  greedy (float32) {greedy['identical']}/{greedy['prompts']}" if greedy
                 else "")
              + "".join(f"\n    {k}: {v}" for k, v in failed.items()), flush=True)
        for line in row["memory_log"]:
            print("    " + line.split("] ", 1)[-1][:200])
    (work / "gpu_smoke.json").write_text(json.dumps(rows, indent=1))
    return 1 if any(v != "ok" for r in rows for v in r["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
