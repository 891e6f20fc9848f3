"""``python -m jaxserve.entrypoints.run_batch`` (vLLM's batch runner) end to end on the real
default model: a file of chat, completions and responses lines among lines that fail (not JSON,
an embeddings url, a stream, another method, a body the server refuses, a background response)
gives one result line per input line, in input order, in vLLM's shape; each 200's body is what
the server itself answers for that body (greedy, so the same text); stdin and stdout work as
``-``; usage errors are one line, exit 2."""

import json
import subprocess
import sys
import urllib.request

import pytest

from jaxserve.entrypoints import run_batch
from tests.conftest import SMALL_ENGINE_FLAGS
from tests.integration.server_utils import REPO, Server
from tests.openai_schema import CHAT, COMPLETION, errors

CHAT_BODY = {"messages": [{"role": "developer", "content": "Answer in one short sentence."},
                          {"role": "user", "content": [
                              {"type": "text", "text": "What is the capital of France?"}]}],
             "max_tokens": 8, "temperature": 0}
COMPLETION_BODY = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


def line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


LINES = [
    line("chat-1", "/v1/chat/completions", CHAT_BODY),
    "not json",
    line("cmpl-1", "/v1/completions", COMPLETION_BODY),
    line("emb-1", "/v1/embeddings", {"input": "hello", "model": "SmolLM2-135M-Instruct"}),
    "",  # blank: skipped, as vLLM skips it
    line("stream-1", "/v1/completions", {**COMPLETION_BODY, "stream": True}),
    line("get-1", "/v1/completions", COMPLETION_BODY, method="GET"),
    line("bad-body", "/v1/completions", {**COMPLETION_BODY, "max_tokens": "8"}),
    json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}),
    line("resp-1", "/v1/responses", {"input": "The capital of France is", "max_output_tokens": 6,
                                     "temperature": 0}),
    line("bg-1", "/v1/responses", {"input": "Hi", "background": True}),
]
# (custom_id, status_code, what the error says) of each output line, in input order
EXPECTED = [("chat-1", 200, None), (None, 400, "line 2: invalid JSON"), ("cmpl-1", 200, None),
            ("emb-1", 400, "line 4: url: '/v1/embeddings' is not served"),
            ("stream-1", 400, "line 6: body.stream: Request must not be sent in stream mode"),
            ("get-1", 400, "line 7: method: only POST"),
            ("bad-body", 400, "max_tokens"),
            ("no-body", 400, "line 9: body: field required"), ("resp-1", 200, None),
            ("bg-1", 400, "line 11: body.background")]


def run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve.entrypoints.run_batch", *argv,
                           *SMALL_ENGINE_FLAGS], input=stdin, capture_output=True, text=True,
                          timeout=900, cwd=REPO)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def without_ids(body: dict) -> dict:
    """A response body less what differs between any two answers: its id and timestamp."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.mark.slow
def test_batch_file_results_are_the_servers_bodies_in_input_order(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(LINES) + "\n")
    proc = run(["-i", str(inp), "-o", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]  # failed lines are results (vLLM's)
    assert proc.stdout == "", proc.stdout[-2000:]  # every log line goes to stderr
    assert "Traceback" not in proc.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]

    assert [(r["custom_id"], r["response"]["status_code"]) for r in rows] == \
        [(c, s) for c, s, _ in EXPECTED]
    for row, (_, status, says) in zip(rows, EXPECTED):
        assert set(row) == {"id", "custom_id", "response", "error"}
        assert set(row["response"]) == {"status_code", "request_id", "body"}
        assert row["id"].startswith("vllm-")
        assert row["response"]["request_id"].startswith("vllm-batch-")
        if status == 200:
            assert row["error"] is None
        else:
            assert row["response"]["body"] is None
            assert says in json.dumps(row["error"]), row["error"]
    assert len({r["id"] for r in rows}) == len(rows)
    assert len({r["response"]["request_id"] for r in rows}) == len(rows)
    # A body the server refuses: its status and its error body, as the server sends them.
    refused = rows[6]["error"]["error"]
    assert refused["param"] == "max_tokens" and refused["type"] == "invalid_request_error"

    chat, completion = rows[0]["response"]["body"], rows[2]["response"]["body"]
    assert errors(CHAT, chat) == [] and errors(COMPLETION, completion) == []
    assert chat["object"] == "chat.completion" and completion["object"] == "text_completion"
    assert chat["choices"][0]["message"]["content"]
    assert completion["usage"]["completion_tokens"] == 6
    response = rows[8]["response"]["body"]
    assert response["object"] == "response" and response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["output_tokens"] == 6
    assert response["output"][0]["content"][0]["text"]  # a chat turn: not the completion

    # The same bodies sent to the server, one at a time: the same answers, ids and times aside
    # (greedy; every token of both answers leads its runner-up by 0.2 logits or more, far beyond
    # what batching them together with other lines can change).
    server = Server(*SMALL_ENGINE_FLAGS)
    try:
        by_server = post(f"{server.url}/v1/chat/completions", CHAT_BODY)
        assert by_server["choices"][0]["message"]["content"] == \
            chat["choices"][0]["message"]["content"]
        assert without_ids(by_server) == without_ids(chat)
        by_server = post(f"{server.url}/v1/completions", COMPLETION_BODY)
        assert by_server["choices"][0]["text"] == completion["choices"][0]["text"]
        assert without_ids(by_server) == without_ids(completion)
    finally:
        assert server.stop() == 0

    # stdin and stdout as "-": stdout carries the result lines alone.
    proc = run(["-i", "-", "-o", "-"], stdin=LINES[2] + "\n" + LINES[1] + "\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [r["custom_id"] for r in rows] == ["cmpl-1", None]
    assert rows[0]["response"]["body"]["choices"][0]["text"] == completion["choices"][0]["text"]
    assert "line 2: invalid JSON" in rows[1]["error"]


@pytest.mark.parametrize("argv,flag", [
    (["-i", "https://example.com/in.jsonl", "-o", "OUT"], "--input-file: URLs are not supported"),
    (["-i", "IN", "-o", "s3://bucket/out.jsonl"], "--output-file: URLs are not supported"),
    (["-i", "MISSING", "-o", "OUT"], "--input-file: cannot read"),
    (["-i", "IN", "-o", "MISSING/out.jsonl"], "--output-file: cannot write"),
    (["-i", "IN"], "--output-file"),
    (["-i", "IN", "-o", "OUT", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["-i", "IN", "-o", "OUT", "--num-hosts", "2", "--host-id", "1"], "--host-id"),
    (["-i", "IN", "-o", "OUT", "--lora-modules", "a=/x"], "--lora-modules: needs --enable-lora"),
])
def test_usage_errors_are_one_line_exit_2(argv, flag, tmp_path, capsys):
    paths = {"IN": tmp_path / "in.jsonl", "OUT": tmp_path / "out.jsonl",
             "MISSING": tmp_path / "missing"}
    paths["IN"].write_text(LINES[0] + "\n")
    argv = [str(paths[a]) if a in paths else a.replace("MISSING", str(paths["MISSING"]))
            for a in argv]
    assert run_batch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "Traceback" not in err, err
