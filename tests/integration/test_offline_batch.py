"""scripts/offline_batch.py end to end: 50 real ShareGPT prompts plus
one malformed line, run as a subprocess on the real default model with small engine flags."""

import json
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import SMALL_ENGINE, SMALL_ENGINE_FLAGS, sharegpt_prompts

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "offline_batch.py"
BAD_LINE = 26  # 1-based line number of the malformed line


def run_script(tmp_path, lines: list[str], *extra) -> tuple[subprocess.CompletedProcess, list[dict]]:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--input", str(inp), "--output", str(out), *SMALL_ENGINE_FLAGS, *extra],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    rows = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return proc, rows


@pytest.mark.slow
def test_50_sharegpt_prompts_and_one_malformed_line(tmp_path):
    prompts = sharegpt_prompts(50, max_chars=200)
    lines = []
    for i, p in enumerate(prompts):
        rec = {"id": f"sg-{i}", "max_tokens": 8, "temperature": 0}
        # a mix of plain prompts and chats, all in the one engine batch
        rec.update({"prompt": p} if i % 2 else {"messages": [{"role": "user", "content": p}]})
        lines.append(json.dumps(rec))
    lines.insert(BAD_LINE - 1, '{"id": "broken", "prompt": "unterminated')  # not valid JSON
    proc, rows = run_script(tmp_path, lines)

    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert len(rows) == 51
    errors = [r for r in rows if "error" in r]
    assert len(errors) == 1
    assert errors[0]["line"] == BAD_LINE
    assert f"line {BAD_LINE}" in errors[0]["error"] and "JSON" in errors[0]["error"]
    results = [r for r in rows if "error" not in r]
    assert [r["id"] for r in results] == [f"sg-{i}" for i in range(50)]  # input order
    assert [r["line"] for r in results] == [n for n in range(1, 52) if n != BAD_LINE]
    for r in results:
        assert isinstance(r["text"], str)
        assert r["prompt_tokens"] > 0
        assert 1 <= r["completion_tokens"] <= 8
        assert r["finish_reason"] in ("stop", "length")
        if r["finish_reason"] == "length":
            assert r["completion_tokens"] == 8
    assert sum(r["completion_tokens"] for r in results) > 50  # the model really generated


@pytest.mark.slow
def test_bad_lines_each_fail_alone_and_all_valid_exits_zero(tmp_path):
    good = json.dumps({"id": "ok", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    bad = [
        json.dumps({"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
        json.dumps({"id": "neither", "max_tokens": 4}),
        json.dumps({"id": "type", "prompt": "x", "max_tokens": "8"}),
        json.dumps({"id": "range", "prompt": "x", "temperature": -1}),
        json.dumps({"id": "unknown", "prompt": "x", "max_token": 8}),
        json.dumps({"id": "long", "prompt": "hello " * SMALL_ENGINE["max_model_len"]}),
        "[1, 2]",
    ]
    proc, rows = run_script(tmp_path, [good, *bad, "", good])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert [r["id"] for r in rows] == ["ok", "both", "neither", "type", "range", "unknown", "long", None, "ok"]
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8, 10]  # line 9 is blank: skipped
    by_id = {r["id"]: r for r in rows[1:8]}
    assert "line 2:" in by_id["both"]["error"] and "both" in by_id["both"]["error"]
    assert "neither" in by_id["neither"]["error"]
    assert "max_tokens" in by_id["type"]["error"]
    assert "temperature" in by_id["range"]["error"]
    assert "max_token" in by_id["unknown"]["error"]
    assert "max_model_len" in by_id["long"]["error"]
    assert rows[0]["text"] == rows[-1]["text"] and rows[0]["completion_tokens"] == 4

    proc, rows = run_script(tmp_path, [good, json.dumps({"id": "chat", **OPENAI_CHAT, "max_tokens": 4})])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["id"] for r in rows] == ["ok", "chat"] and not any("error" in r for r in rows)
    assert rows[1]["completion_tokens"] >= 1


# OpenAI's chat format beyond {"role", "content": str}: the developer role, text content parts.
OPENAI_CHAT = {"messages": [
    {"role": "developer", "content": "Answer in one word."},
    {"role": "user", "content": [{"type": "text", "text": "The capital of France?"},
                                 {"type": "text", "text": " One word."}]}]}


def test_messages_are_read_as_the_server_reads_them():
    """A line's messages go through the server's own parser (protocol.parse_messages), so they
    take what a chat request takes, and fail as it fails, naming the message's field."""
    from jaxserve.entrypoints.protocol import parse_messages
    from scripts.offline_batch import LineError, parse_line

    _, line = parse_line(json.dumps(OPENAI_CHAT).encode())
    assert line.messages == parse_messages(OPENAI_CHAT["messages"])
    assert line.messages[0]["role"] == "system"  # developer, as the server renders it
    bad = [({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                        "image_url": {"url": "x"}}]}]},
            "messages.0.content.0"),
           ({"messages": [{"content": "x"}]}, "messages.0.role: field required"),
           ({"messages": []}, "messages"),
           ({"messages": "hi"}, "messages")]
    for obj, says in bad:
        with pytest.raises(LineError) as e:
            parse_line(json.dumps({"id": "m", **obj}).encode())
        assert says in e.value.args[0] and e.value.args[1] == "m", e.value.args


def test_cli_errors_are_one_line_exit_2(tmp_path):
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--input", str(tmp_path / "missing.jsonl"), "--output", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "--input" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1

    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
         "--model", str(tmp_path / "no-such-model")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "--model" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_no_valid_line_loads_no_model(tmp_path):
    """Every line invalid: each gets its error and no model is loaded (a model that does not
    exist is never opened)."""
    lines = ['{"prompt": "x", "max_token": 8}', "not json", '{"prompt": "x", "temperature": -1}',
             '{"prompt": [1, -5]}', '{"prompt": "x", "seed": 9223372036854775808}']
    proc, rows = run_script(tmp_path, lines, "--model", str(tmp_path / "no-such-model"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5] and all("error" in r for r in rows)
    assert "temperature" in rows[2]["error"] and "seed" in rows[4]["error"]
    assert "the model is not loaded" in proc.stderr and "Traceback" not in proc.stderr
