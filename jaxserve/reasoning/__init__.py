"""Reasoning parsers, chosen with ``--reasoning-parser`` (vLLM's names and fields,
``vllm/reasoning/``): they split a reasoning model's output into its reasoning and its content
(docs/reasoning.md). Pure text; no JAX, no tokenizer."""

from jaxserve.reasoning.abs_reasoning_parsers import ReasoningDelta, ReasoningParser
from jaxserve.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from jaxserve.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}

__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser",
           "ReasoningDelta", "ReasoningParser"]
