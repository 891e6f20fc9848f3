"""DeepSeek-R1 (and QwQ): reasoning between ``<think>`` and ``</think>``; R1's template writes the
``<think>`` into the prompt, so the output often starts inside it (vLLM's ``deepseek_r1``)."""

from jaxserve.reasoning.abs_reasoning_parsers import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    start_tag = "<think>"
    end_tag = "</think>"
