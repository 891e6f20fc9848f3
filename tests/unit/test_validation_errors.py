"""ValidationError carries the field at fault, and the server's 400 names it as ``param`` in the
request's own words: SamplingParams' and the input checks' ``parameter``, renamed where the
request's field differs (chat's ``max_completion_tokens``, ``messages`` for the prompt), whatever
the message says. Only a ValidationError is a 400; any other ValueError is a 500."""

import json

import numpy as np
import pytest
from test_openai_serving import FakeLLM, _call

from jaxserve.engine.input_processor import InputProcessor, check_token_ids
from jaxserve.exceptions import ValidationError
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("kwargs,parameter", [
    ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"seed": 2**63}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {1: 101}}, "logit_bias"), ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_sampling_params_errors_carry_the_field(kwargs, parameter):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**kwargs)
    assert e.value.parameter == parameter and isinstance(e.value, ValueError)


def test_structured_outputs_and_input_errors_carry_the_field():
    with pytest.raises(ValidationError) as e:
        StructuredOutputsParams()
    assert e.value.parameter == "structured_outputs"
    with pytest.raises(ValidationError) as e:
        check_token_ids([7], 5, "tokens")
    assert e.value.parameter == "tokens"
    ip = object.__new__(InputProcessor)  # check_prompt reads only these two
    ip.max_model_len, ip.vocab_size = 8, 100
    for ids, max_tokens, parameter in [([], None, "prompt"), ([1] * 8, None, "prompt"),
                                       ([1] * 4, 5, "max_tokens"), ([1, 200], 2, "prompt")]:
        with pytest.raises(ValidationError) as e:
            ip.check_prompt(ids, max_tokens)
        assert e.value.parameter == parameter, (ids, max_tokens)


class RejectingLLM(FakeLLM):
    """``check_request`` raises ``error``: a message that names no field, so only ``parameter``
    can say which one it is."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    def check_request(self, ids, sp):
        raise self.error


def _error(path, body, llm=None):
    status, _, text = _call(path, body, llm)
    return status, json.loads(text)["error"]


@pytest.mark.parametrize("path,body,parameter,param", [
    ("/v1/completions", {"prompt": "hi"}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "hi"}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "hi"}, "logit_bias", "logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES}, "prompt", "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES}, "max_tokens", "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 5}, "max_tokens",
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES}, "stop_token_ids", "stop_token_ids"),
    ("/v1/chat/completions", {"messages": MESSAGES}, None, None),
])
def test_param_is_the_parameter_in_the_request_s_name(path, body, parameter, param):
    llm = RejectingLLM(ValidationError("out of range", parameter=parameter))
    status, err = _error(path, body, llm)
    assert status == 400 and err["param"] == param and err["message"] == "out of range", err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 2.5}, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "guided_regex": "a",
                              "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {}},
     "structured_outputs"),
])
def test_request_validation_names_the_field(path, body, param):
    status, err = _error(path, body)
    assert status == 400 and err["param"] == param, err


def test_only_a_validation_error_is_a_400():
    status, err = _error("/v1/completions", {"prompt": "hi"},
                         RejectingLLM(ValueError("max_tokens: not a validation error")))
    assert status == 500 and err["param"] is None, err


@pytest.mark.parametrize("field,value", [("seed", "abc"), ("temperature", "hot"), ("n", None),
                                         ("stop", [1])])
def test_sampling_params_of_the_wrong_type_name_the_field(field, value):
    """LLM's users build SamplingParams without the API's typed bodies: a value of the wrong
    type is a ValidationError naming the field, not a TypeError from a comparison."""
    with pytest.raises(ValidationError) as e:
        SamplingParams(**{field: value})
    assert e.value.parameter == field and str(e.value).startswith(f"{field} {value!r}: Expected")


@pytest.mark.parametrize("field,value", [
    ("n", 2.5), ("n", True), ("max_tokens", 3.5), ("max_tokens", 3.0), ("min_tokens", 1.5),
    ("top_k", 2.5), ("seed", 1.5), ("logprobs", 1.5), ("prompt_logprobs", False),
    ("stop_token_ids", [2.5]), ("stop_token_ids", [np.int64(1), 2.5]),
    ("allowed_token_ids", [504.5]), ("logit_bias", {504.5: 5}),
])
def test_integer_fields_refuse_floats_and_bools(field, value):
    """As the HTTP API's strict bodies do (``max_tokens: 3.0`` is a 400 there too)."""
    with pytest.raises(ValidationError) as e:
        SamplingParams(**{field: value})
    assert e.value.parameter == field and "Expected `int" in str(e.value), e.value


def test_numpy_integers_are_stored_as_python_ints():
    sp = SamplingParams(n=np.int64(2), max_tokens=np.int32(3), seed=np.int64(5), top_k=np.int8(4),
                        stop_token_ids=np.array([7, 8]), allowed_token_ids=[np.uint16(9)],
                        logit_bias={np.int64(10): 1.0}, logprobs=np.int64(1))
    values = [sp.n, sp.max_tokens, sp.seed, sp.top_k, sp.logprobs, *sp.stop_token_ids,
              *sp.allowed_token_ids, *sp.logit_bias]
    assert values == [2, 3, 5, 4, 1, 7, 8, 9, 10]
    assert {type(v) for v in values} == {int} and type(sp.stop_token_ids) is list
