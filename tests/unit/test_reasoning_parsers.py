"""The reasoning parsers on text (jaxserve/reasoning, docs/reasoning.md): vLLM's split of a
reasoning model's output, the same whole and fed in pieces of any size."""

import pytest

from jaxserve.reasoning import REASONING_PARSERS, DeepSeekR1ReasoningParser, Qwen3ReasoningParser

CASES = [
    # (model output, in_reasoning, (reasoning, content))
    ("<think>\nLet me see.\n</think>\n\nParis.", True, ("\nLet me see.\n", "\n\nParis.")),
    # The template wrote <think> itself (DeepSeek-R1, Qwen3.5): the output starts inside it.
    ("Let me see.</think>Paris.", True, ("Let me see.", "Paris.")),
    # Whitespace before the model's own <think> goes with it.
    ("\n <think>a</think>b", True, ("a", "b")),
    # Cut short before </think>: all reasoning.
    ("<think>still thinking", True, ("still thinking", None)),
    # A partial tag at the end was reasoning text after all.
    ("thinking </thi", True, ("thinking </thi", None)),
    # Only the first </think> ends it; later tags are content.
    ("a</think>b</think>c<think>d", True, ("a", "b</think>c<think>d")),
    # Nothing after the reasoning: content null, as vLLM sends it.
    ("<think>a</think>", True, ("a", None)),
    # An empty reasoning is null.
    ("<think></think>Paris.", True, (None, "Paris.")),
    # <think> later in the text is no start tag.
    ("a<think>b</think>c", True, ("a<think>b", "c")),
    # Output that does not start in the reasoning is all content, tags included.
    ("a</think>b", False, (None, "a</think>b")),
    ("", False, (None, "")),
]


@pytest.mark.parametrize("cls", [DeepSeekR1ReasoningParser, Qwen3ReasoningParser])
@pytest.mark.parametrize("text,in_reasoning,expected", CASES)
def test_whole_and_streamed_split_alike(cls, text, in_reasoning, expected):
    assert cls(in_reasoning).extract_reasoning(text) == expected
    for size in (1, 2, 3, 7):
        parser, reasoning, content = cls(in_reasoning), "", ""
        for i in range(0, len(text), size):
            delta = parser.feed(text[i:i + size])
            reasoning += delta.reasoning
            content += delta.content
        reasoning += parser.finish().reasoning
        assert (reasoning or None, content or None) == (
            expected[0], expected[1] or None), size


def test_streaming_holds_back_only_a_possible_tag():
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("<thi").reasoning == ""  # may be <think>
    assert parser.feed("nk>abc</").reasoning == "abc"  # "</" may start </think>
    delta = parser.feed("x")
    assert (delta.reasoning, delta.content) == ("</x", "")
    delta = parser.feed("</think>An")
    assert (delta.reasoning, delta.content) == ("", "An")
    assert parser.feed("swer").content == "swer"


def test_where_the_output_starts():
    for cls in REASONING_PARSERS.values():
        # A template told not to think closes the reasoning in the prompt.
        assert not cls.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert cls.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
        assert cls.starts_in_reasoning("<|im_start|>assistant\n")
    # Qwen3's switch, as vLLM reads it: only an explicit false turns reasoning off.
    assert not Qwen3ReasoningParser.starts_in_reasoning("x", {"enable_thinking": False})
    assert Qwen3ReasoningParser.starts_in_reasoning("x", {"enable_thinking": True})
    assert DeepSeekR1ReasoningParser.starts_in_reasoning("x", {"enable_thinking": False})
