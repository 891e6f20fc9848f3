"""EngineConfig's generated CLI flags (jaxserve/engine/arg_utils.py) in the server, the offline
batch script and the batch runner: every field is a flag of each, --help shows every default, the hand-written flag
spellings still parse to the same values, and a bad value is a one-line usage
error naming the flag, exit code 2; the server's --lora-modules in both of vLLM's forms."""

import dataclasses
import os

import pytest

from jaxserve import serve
from jaxserve.config import LORA_RANKS, EngineConfig
from jaxserve.engine.arg_utils import from_cli_args
from jaxserve.entrypoints import run_batch
from scripts import offline_batch

BATCH_IO = ["--input", "in.jsonl", "--output", "out.jsonl"]
RUN_BATCH_IO = ["-i", "in.jsonl", "-o", "out.jsonl"]
# Each CLI's own required flags, so that its parser accepts an otherwise empty command line.
PARSERS = {"serve": (serve.build_parser, []), "offline_batch": (offline_batch.build_parser, BATCH_IO),
           "run_batch": (run_batch.build_parser, RUN_BATCH_IO)}
FIELDS = dataclasses.fields(EngineConfig)


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


@pytest.mark.parametrize("cli", PARSERS)
def test_every_field_is_a_flag_with_its_default(cli):
    build, required = PARSERS[cli]
    help_text = build().format_help()
    for f in FIELDS:
        assert _flag(f) in help_text, f.name
    assert from_cli_args(build().parse_args(required)) == EngineConfig()


@pytest.mark.parametrize("cli", PARSERS)
def test_help_shows_every_default(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a help text
    build, _ = PARSERS[cli]
    help_text = " ".join(build().format_help().split())
    for f in FIELDS:
        assert f"{f.metadata['help']} (default: {f.default})" in help_text, f.name
    if cli == "serve":
        assert "listen on (default: 127.0.0.1)" in help_text
        assert "(0: any free port) (default: 8000)" in help_text
    elif cli == "offline_batch":  # a required flag has no default to show
        assert "input JSONL file --output" in help_text
    else:
        assert "or - for stdin -o" in help_text


def test_server_flags_parse_to_their_engine_config():
    args = serve.build_parser().parse_args([
        "--model", "llama-3.1-8b", "--host", "0.0.0.0", "--port", "9000",
        "--served-model-name", "m", "--max-model-len", "2048", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256", "--dtype", "bfloat16",
        "--gpu-memory-utilization", "0.8", "--kv-cache-gib", "0.5", "--api-key", "k",
        "--load-format", "dummy", "--no-enable-prefix-caching", "--attention-backend", "reference",
    ])
    assert (args.host, args.port, args.served_model_name, args.api_key) == ("0.0.0.0", 9000, "m", "k")
    assert from_cli_args(args) == EngineConfig(
        model="llama-3.1-8b", load_format="dummy", dtype="bfloat16", max_model_len=2048,
        max_num_seqs=8, max_num_batched_tokens=256, kv_cache_gib=0.5,
        gpu_memory_utilization=0.8, enable_prefix_caching=False, attention_backend="reference",
    )
    assert serve.build_parser().parse_args(["--enable-prefix-caching"]).enable_prefix_caching


def test_run_batch_flags_parse_to_their_engine_config_and_app_options():
    args = run_batch.build_parser().parse_args([
        "--input-file", "in.jsonl", "--output-file", "-", "--model", "m.gguf",
        "--served-model-name", "m", "--reasoning-parser", "qwen3", "--max-num-seqs", "32",
    ])
    assert (args.input_file, args.output_file) == ("in.jsonl", "-")
    assert from_cli_args(args) == EngineConfig(model="m.gguf", max_num_seqs=32)
    assert serve.app_options(args) == dict(
        served_model_name="m", tool_call_parser="hermes", reasoning_parser="qwen3",
        return_tokens_as_token_ids=False)


def test_batch_flags_parse_to_their_engine_config():
    args = offline_batch.build_parser().parse_args([
        *BATCH_IO, "--model", "m.gguf", "--load-format", "gguf", "--max-model-len", "256",
        "--max-num-seqs", "32", "--max-num-batched-tokens", "128", "--kv-cache-gib", "0.25",
    ])
    assert (args.input, args.output) == ("in.jsonl", "out.jsonl")
    assert from_cli_args(args) == EngineConfig(
        model="m.gguf", load_format="gguf", max_model_len=256, max_num_seqs=32,
        max_num_batched_tokens=128, kv_cache_gib=0.25,
    )


@pytest.mark.parametrize("cli", PARSERS)
def test_page_size_and_seed_flags(cli):
    build, required = PARSERS[cli]
    config = from_cli_args(build().parse_args([*required, "--page-size", "32", "--seed", "7"]))
    assert (config.page_size, config.seed) == (32, 7)
    for page_size in ("1", "2", "128"):
        assert from_cli_args(build().parse_args([*required, "--page-size", page_size])).page_size \
            == int(page_size)


BAD = [
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-batched-tokens", "many"], "--max-num-batched-tokens"),
    (["--max-model-len", "-5"], "--max-model-len"),
    (["--kv-cache-gib", "0"], "--kv-cache-gib"),
    (["--page-size", "3"], "--page-size"),
    (["--page-size", "0"], "--page-size"),
    (["--page-size", "24"], "--page-size"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**63)], "--seed"),
    (["--dtype", "float8"], "--dtype"),
    (["--load-format", "pickle"], "--load-format"),
    (["--attention-backend", "cuda"], "--attention-backend"),
    (["--max-lora-rank", "100000"], "--max-lora-rank: must be one of 1, 8, 16, 32, 64, 128, 256, "
                                    "320, 512, got 100000"),
    (["--max-lora-rank", "4"], "--max-lora-rank"),
    (["--max-loras", "0"], "--max-loras"),
    (["--no-such-flag"], "--no-such-flag"),
]


@pytest.mark.parametrize("argv,flag", BAD)
def test_server_bad_value_is_one_line_exit_2(argv, flag, capsys):
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,flag", BAD)
def test_batch_bad_value_is_one_line_exit_2(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        offline_batch.main([*BATCH_IO, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,flag", BAD)
def test_run_batch_bad_value_is_one_line_exit_2(argv, flag, capsys):
    assert run_batch.main([*RUN_BATCH_IO, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "Traceback" not in err, err


def test_lora_modules_take_both_of_vllms_forms():
    args = serve.build_parser().parse_args([
        "--lora-modules", "sql=~/loras/sql",
        '{"name": "chat", "path": "/loras/c=1", "base_model_name": "m"}',
        '{"name": "math", "path": "/loras/math", "base_model_name": null}'])
    assert args.lora_modules == [
        serve.LoRAModulePath("sql", os.path.expanduser("~/loras/sql")),
        serve.LoRAModulePath("chat", "/loras/c=1", "m"),
        serve.LoRAModulePath("math", "/loras/math")]


@pytest.mark.parametrize("item, says", [
    ("sql", "expected name=path or a JSON object with name, path and optionally base_model_name"),
    ('{"name": "sql"', "invalid JSON"),
    ('{"name": "sql"}', "missing fields ['path']"),
    ('{"name": "sql", "path": "/p", "lora_int_id": 1}', "unknown fields ['lora_int_id']"),
    ('{"name": "sql", "path": 3}', "path must be a non-empty string")])
def test_bad_lora_modules_item_is_one_line_exit_2(item, says, capsys):
    assert serve.main(["--enable-lora", "--lora-modules", item]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: argument --lora-modules: " in err and says in err, err


def test_max_cpu_loras_below_max_loras_is_a_usage_error(capsys):
    """Checked with the flags (EngineConfig's rule between them), before the model loads;
    LLM(...) raises it as a ValueError."""
    assert serve.main(["--enable-lora", "--max-cpu-loras", "1", "--max-loras", "2"]) == 2
    err = capsys.readouterr().err
    assert err == ("python -m jaxserve.serve: error: --max-cpu-loras 1 must be at least "
                   "--max-loras 2\n")
    with pytest.raises(ValueError, match="^--max-cpu-loras 1 must be at least --max-loras 2$"):
        EngineConfig(max_cpu_loras=1, max_loras=2)
    assert EngineConfig(max_cpu_loras=2, max_loras=2).max_cpu_loras == 2


def test_max_lora_rank_takes_vllms_choices_default_included():
    assert LORA_RANKS == (1, 8, 16, 32, 64, 128, 256, 320, 512)
    assert EngineConfig().max_lora_rank in LORA_RANKS
    for rank in LORA_RANKS:
        assert from_cli_args(serve.build_parser().parse_args(
            ["--max-lora-rank", str(rank)])).max_lora_rank == rank
