"""The server's bounds (docs/reliability.md), unit by unit: SamplingParams ranges, the text-size bound checked before
tokenizing, log lines a client cannot forge, engine-side request checks, metrics after engine
death, and one bad output failing its own request only."""

import asyncio
import logging
import math

import pytest

from jaxserve.engine import EngineCoreOutput, EngineCoreRequest
from jaxserve.engine.core_proc import check_engine_request
from jaxserve.engine.input_processor import InputProcessor, max_token_bytes
from jaxserve.engine.output_processor import OutputProcessor, RequestError
from jaxserve.entrypoints.safe_log import SafeFormatter, clip
from jaxserve.metrics import Metrics
from jaxserve.sampling_params import SamplingParams


@pytest.mark.parametrize("kw,field", [
    ({"top_k": 2**31}, "top_k"), ({"max_tokens": 2**31}, "max_tokens"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": 1e308}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"top_p": math.nan}, "top_p"), ({"stop": ["a"] * 17}, "stop"),
    ({"stop": ["x" * 257]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
])
def test_sampling_params_bounds(kw, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kw)


def test_tiny_temperature_is_raised_to_vllms_floor():
    assert SamplingParams(temperature=1e-30).temperature == 0.01
    assert SamplingParams(temperature=0).temperature == 0


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.model_loader import default_tokenizer

    return default_tokenizer()


def test_text_size_bound_is_sound(tokenizer):
    """No token stands for more bytes of text than max_token_bytes says, so a text longer than
    max_model_len * max_token_bytes can never fit; the check refuses it without tokenizing."""
    bound = max_token_bytes(tokenizer)
    for text in ["hello world " * 50, " " * 500, "é😀中" * 100, "\n\n\n" * 100]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(text.encode()) <= len(ids) * bound
    ip = InputProcessor(tokenizer, max_model_len=100, vocab_size=len(tokenizer))
    ip.check_text_size(100 * bound)
    with pytest.raises(ValueError, match="^prompt: "):
        ip.check_text_size(100 * bound + 1)


def test_engine_checks_every_add():
    ok = EngineCoreRequest("r", [1, 2], SamplingParams(stop_token_ids=[3]))
    check_engine_request(ok, vocab_size=10, max_model_len=8)
    for req, field in [(EngineCoreRequest("r", [], SamplingParams()), "prompt"),
                       (EngineCoreRequest("r", [1] * 8, SamplingParams()), "prompt"),
                       (EngineCoreRequest("r", [10], SamplingParams()), "prompt"),
                       (EngineCoreRequest("r", [1], SamplingParams(stop_token_ids=[10])),
                        "stop_token_ids")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            check_engine_request(req, vocab_size=10, max_model_len=8)


def test_log_lines_are_escaped_and_bounded():
    fmt = SafeFormatter("%(levelname)s %(message)s")
    forged = "x\n[jaxserve] ERROR FORGED \ud800"
    rec = logging.LogRecord("t", logging.WARNING, __file__, 1, "fields: %s", (forged,), None)
    line = fmt.format(rec)
    assert "\n" not in line and "\\x0a[jaxserve] ERROR FORGED \\ud800" in line
    assert len(clip("y" * 10**6)) < 120
    try:
        raise ValueError("bad\ninput")
    except ValueError:
        import sys

        rec = logging.LogRecord("t", logging.ERROR, __file__, 1, "oops", (), sys.exc_info())
    text = fmt.format(rec)
    assert text.splitlines()[-1] == "ValueError: bad\\x0ainput"


def test_metrics_after_engine_death_and_restart():
    from jaxserve.engine import SchedulerStats

    m = Metrics("m")
    m.update_stats(SchedulerStats(num_running_reqs=20, kv_cache_usage=0.5, num_preemptions_total=3))
    m.engine_down()
    text = m.render().decode()
    assert 'jaxserve:num_requests_running{model_name="m"} 0.0' in text
    assert 'jaxserve:engine_alive{model_name="m"} 0.0' in text
    m.update_stats(SchedulerStats(num_preemptions_total=1))  # the new engine counts from 0
    m.engine_up(1)
    text = m.render().decode()
    assert 'jaxserve:num_preemptions_total{model_name="m"} 4.0' in text
    assert 'jaxserve:engine_restarts_total{model_name="m"} 1.0' in text


def test_an_output_that_fails_fails_its_own_request_only(tokenizer):
    op = OutputProcessor(tokenizer, eos_token_ids=[2])

    async def go():
        good, bad = asyncio.Queue(), asyncio.Queue()
        op.add_request("good", None, [1], SamplingParams(), good)
        op.add_request("bad", None, [1], SamplingParams(), bad)
        op.requests["bad"].choices[0].detokenizer = None  # any failure while handling its output
        result = op.process_outputs([EngineCoreOutput("bad", [5]), EngineCoreOutput("good", [5])])
        return result.reqs_to_abort, bad.get_nowait(), good.get_nowait()

    to_abort, bad_out, good_out = asyncio.run(go())
    assert to_abort == ["bad"] and isinstance(bad_out, RequestError)
    assert good_out.outputs[0].token_ids == [5] and "bad" not in op.requests
