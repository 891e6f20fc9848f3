"""``--reasoning-parser qwen3`` and ``--metrics-prefix vllm`` through a real server and the official
client (docs/reasoning.md): a tiny random Llama whose tokenizer (the default model's) has
``<think>`` / ``</think>`` as added tokens and whose chat template is Qwen3's in small (it closes
the reasoning in the prompt when ``enable_thinking`` is false).

The model's final norm weighs zero: every logit is 0, so a request sets each token's odds
exactly with ``logit_bias`` / ``allowed_token_ids``, whatever the machine's numerics, and seeded
sampling draws the same tokens everywhere. The tests check vLLM's documented behaviour: the
reasoning under ``reasoning`` and ``reasoning_content``, the content only after ``</think>``,
stream deltas that join to the whole message, output constraints and tool calls that start
after the reasoning, the Responses API's ``reasoning`` item, and vLLM's metric names and labels
(with the playground's /metrics/summary reading them).
"""

from __future__ import annotations

import json
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import Server, get

from tests.integration import tp_utils

try:  # the HTTP library the openai client is built on (httpx2 in its 3.x releases)
    import httpx2 as httpx
except ImportError:
    import httpx

pytestmark = pytest.mark.slow

# Qwen3's template in small: ChatML, earlier reasoning rendered back, and the closed reasoning
# its enable_thinking=false writes after the generation prompt.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")
QUESTION = [{"role": "user", "content": "Which fruit?"}]
WORDS = [" apple", " banana", " cherry"]


@pytest.fixture(scope="module")
def tiny_reasoner(tmp_path_factory, smollm):
    """(HF folder, its tokenizer): the tiny model described in the module docstring."""
    import torch
    import transformers
    from tokenizers import AddedToken

    folder = tmp_path_factory.mktemp("reasoner") / "tiny-reasoner"
    smollm.tokenizer.save_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<think>", "</think>")])
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, tok


@pytest.fixture(scope="module")
def server(tiny_reasoner):
    srv = Server("--model", str(tiny_reasoner[0]), *tp_utils.TP_CLI_FLAGS,
                 "--reasoning-parser", "qwen3", "--metrics-prefix", "vllm")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=600)
    return r.status_code, r.json()


def _id(tok, text: str) -> int:
    (token,) = tok.encode(text, add_special_tokens=False)
    return token


def _split(tok, token_ids: list[int]) -> tuple[str, str | None]:
    """What vLLM's parser makes of a choice's tokens: (text before the first </think>, the
    text after it, None when empty); without one, (all the text, None)."""
    end = _id(tok, "</think>")
    if end not in token_ids:
        return tok.decode(token_ids, skip_special_tokens=True), None
    i = token_ids.index(end)
    after = tok.decode(token_ids[i + 1:], skip_special_tokens=True)
    return tok.decode(token_ids[:i], skip_special_tokens=True), after or None


def test_reasoning_then_content_whole_and_streamed(client, model, tiny_reasoner):
    """Each choice's reasoning is its text up to ``</think>`` and its content the rest, under
    vLLM's field names (``reasoning`` and the older ``reasoning_content``); streamed deltas
    carry the same, reasoning first, and join to the whole message; ``include_reasoning:
    false`` leaves the reasoning out."""
    tok = tiny_reasoner[1]
    allowed = [_id(tok, w) for w in WORDS] + [_id(tok, "</think>")]
    kw = dict(model=model, messages=QUESTION, n=4, max_tokens=8, temperature=1.0, seed=11,
              extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    whole = client.chat.completions.create(**kw)
    both = 0
    for choice in whole.choices:
        message = choice.message
        expected = _split(tok, choice.token_ids)
        assert (message.reasoning, message.content) == (expected[0] or None, expected[1])
        assert message.reasoning_content == message.reasoning
        both += bool(message.reasoning and message.content)
    assert both, [c.message for c in whole.choices]  # the seed gives some of each
    streamed = {i: {"reasoning": "", "content": "", "content_started": False} for i in range(4)}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            s, delta = streamed[ch.index], ch.delta.model_extra
            assert delta.get("reasoning") == delta.get("reasoning_content")
            if delta.get("reasoning"):
                assert not s["content_started"]  # content only after the reasoning
                s["reasoning"] += delta["reasoning"]
            if ch.delta.content:
                s["content_started"] = True
                s["content"] += ch.delta.content
    for choice in whole.choices:
        s = streamed[choice.index]
        assert (s["reasoning"] or None, s["content"] or None) == (
            choice.message.reasoning, choice.message.content)
    kw["extra_body"]["include_reasoning"] = False
    hidden = client.chat.completions.create(**kw)
    assert [(c.message.reasoning, c.message.content) for c in hidden.choices] == [
        (None, c.message.content) for c in whole.choices]


def test_enable_thinking_false_is_all_content(client, model, tiny_reasoner):
    """``chat_template_kwargs: {"enable_thinking": false}`` reaches the template, which closes
    the reasoning in the prompt: the whole output is content, ``</think>`` included."""
    tok = tiny_reasoner[1]
    end = _id(tok, "</think>")
    r = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, temperature=1.0, seed=3,
        extra_body={"allowed_token_ids": [_id(tok, " apple"), end], "return_token_ids": True,
                    "chat_template_kwargs": {"enable_thinking": False}})
    prompt = tok.decode(r.prompt_token_ids)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert r.choices[0].message.reasoning is None
    assert r.choices[0].message.content == tok.decode(r.choices[0].token_ids)
    assert end in r.choices[0].token_ids


def test_earlier_reasoning_goes_back_to_the_template(server):
    """An assistant message's ``reasoning`` (or vLLM's older ``reasoning_content``) reaches the
    template as ``reasoning_content``, the key reasoning models' templates read."""
    for key in ("reasoning", "reasoning_content"):
        messages = [*QUESTION, {"role": "assistant", "content": "Apple.", key: "Red, round."},
                    {"role": "user", "content": "Why?"}]
        status, tok = _post(server, "/tokenize", {"messages": messages})
        assert status == 200, tok
        text = _post(server, "/detokenize", {"tokens": tok["tokens"]})[1]["prompt"]
        assert "<|im_start|>assistant\n<think>\nRed, round.\n</think>\n\nApple.<|im_end|>" in text


def test_output_constraint_starts_after_the_reasoning(client, model, tiny_reasoner):
    """A ``structured_outputs`` choice constrains the content only: the reasoning's tokens
    are drawn from the whole vocabulary, then the content is one of the choices and ends."""
    tok = tiny_reasoner[1]
    end = _id(tok, "</think>")
    r = client.chat.completions.create(
        model=model, messages=QUESTION, n=4, max_tokens=20, temperature=1.0, seed=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}, "return_token_ids": True,
                    "logit_bias": {str(end): 11}})  # </think> at odds of about 1:1
    free = []
    for choice in r.choices:
        assert choice.message.content in ("yes", "no") and choice.finish_reason == "stop"
        free += choice.token_ids[: choice.token_ids.index(end)]
    text = tok.decode(free, skip_special_tokens=True)
    assert len(free) >= 2 and not any(w.startswith(text) for w in ("yes", "no")), text


def test_tool_calls_are_parsed_after_the_reasoning(client, model, tiny_reasoner):
    """With tools and ``tool_choice: required`` the enforced call follows the reasoning: the
    message has the reasoning and a valid call, the call's text not in the content."""
    tok = tiny_reasoner[1]
    tools = [{"type": "function", "function": {
        "name": "pick_fruit", "parameters": {
            "type": "object", "properties": {"fruit": {"enum": ["apple", "cherry"]}},
            "required": ["fruit"], "additionalProperties": False}}}]
    r = client.chat.completions.create(
        model=model, messages=QUESTION, tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=1.0, seed=2,
        extra_body={"logit_bias": {str(_id(tok, "</think>")): 9}, "return_token_ids": True})
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "pick_fruit"
    assert json.loads(call.function.arguments)["fruit"] in ("apple", "cherry")
    assert choice.message.reasoning and choice.finish_reason == "tool_calls"
    assert "<tool_call>" not in (choice.message.content or "")


def test_responses_reasoning_item(client, model):
    """/v1/responses: the reasoning is a ``reasoning`` item (the openai client's strict types
    read it), first in ``output``; a reply cut in its reasoning leaves it and the empty
    message incomplete; the streamed ``reasoning_text`` deltas join to the item. (No
    ``logit_bias`` on this API: the reply is 8 tokens drawn from the whole vocabulary, so it
    reasons unless its first token is ``</think>`` or EOS, odds of 2 in 49k.)"""
    kw = dict(model=model, input="Which fruit?", max_output_tokens=8, temperature=1.0)
    whole = client.responses.create(**kw)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text and reasoning.summary == []
    assert whole.status == reasoning.status == message.status == "incomplete"
    assert message.type == "message" and whole.output_text == ""
    events = list(client.responses.create(**kw, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = [e.text for e in events if e.type == "response.reasoning_text.done"]
    final = events[-1].response
    assert deltas == done == final.output[0].content[0].text
    assert final.output[0].id == next(e.item_id for e in events
                                      if e.type == "response.reasoning_text.delta")


def test_vllm_metric_names_and_labels(server, client, model):
    """``--metrics-prefix vllm``: the metrics vLLM has are ``vllm:*`` with its labels
    ``model_name`` and ``engine``; the inter-token latency histogram counts outputs after a
    choice's first; jaxserve's own metrics keep their names."""
    before = server.metrics()
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks
    status, text = get(f"{server.url}/metrics")
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "jaxserve:engine_alive"):
        assert samples[name].labels["model_name"] == model, name
        assert samples[name].labels["engine"] == "0", name
    assert not any(n.startswith("jaxserve:num_requests") for n in samples)
    after = server.metrics()
    assert after["vllm:inter_token_latency_seconds_count"] - \
        before["vllm:inter_token_latency_seconds_count"] == 4
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    # The playground's summary reads the same registry under vLLM's names.
    status, text = get(f"{server.url}/metrics/summary")
    summary, final = json.loads(text), server.metrics()
    assert status == 200 and summary["engine_alive"] is True
    assert summary["generation_tokens"] == final["vllm:generation_tokens_total"]
    assert summary["inter_token_latency_seconds"]["count"] == \
        final["vllm:inter_token_latency_seconds_count"]
    assert final["vllm:time_per_output_token_seconds_sum"] == \
        final["vllm:inter_token_latency_seconds_sum"]  # vLLM's older name, the same values
    assert summary["time_to_first_token_seconds"]["count"] == \
        final["vllm:time_to_first_token_seconds_count"]


def test_vllm_request_phase_metrics(server, client, model):
    """vLLM's per-request histograms: each choice's queue, prefill, decode and inference times
    (engine-measured: inference = prefill + decode, within the request's end-to-end latency),
    the n and max_tokens parameters, and the most tokens a choice generated."""
    before = server.metrics()
    t0 = time.monotonic()
    client.completions.create(model=model, prompt="Count: one two three", max_tokens=6, n=2,
                              temperature=1.0, extra_body={"ignore_eos": True})
    wall = time.monotonic() - t0
    after = server.metrics()

    def delta(name):
        return after[f"vllm:{name}"] - before[f"vllm:{name}"]

    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"request_{phase}_time_seconds_count") == 2, phase  # one per choice
    prefill, decode = delta("request_prefill_time_seconds_sum"), delta(
        "request_decode_time_seconds_sum")
    assert prefill > 0 and decode > 0 and delta("request_queue_time_seconds_sum") >= 0
    assert delta("request_inference_time_seconds_sum") == pytest.approx(prefill + decode)
    assert (delta("request_queue_time_seconds_sum") + delta("request_inference_time_seconds_sum")
            <= 2 * wall)
    assert delta("request_params_n_count") == 1 and delta("request_params_n_sum") == 2
    assert delta("request_params_max_tokens_sum") == 6
    assert delta("request_max_num_generation_tokens_sum") == 6
    # Each choice's decode time over its 5 tokens after the first.
    assert delta("request_time_per_output_token_seconds_count") == 2
    assert delta("request_time_per_output_token_seconds_sum") == pytest.approx(decode / 5)
    # The steps by their tokens, as vLLM counts them: each choice's prompt with its first
    # token, and the 12 tokens generated.
    assert 6 <= delta("iteration_tokens_total_count") <= 12
    assert delta("iteration_tokens_total_sum") == 2 * delta("prompt_tokens_total") + 12
    assert after["vllm:cache_config_info"] == 1
