"""Qwen3: reasoning between ``<think>`` and ``</think>`` (vLLM's ``qwen3``). The model thinks by
default; ``chat_template_kwargs: {"enable_thinking": false}`` turns it off, and then the whole
output is content."""

from jaxserve.reasoning.abs_reasoning_parsers import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    start_tag = "<think>"
    end_tag = "</think>"

    @classmethod
    def starts_in_reasoning(cls, prompt: str, chat_template_kwargs: dict | None = None) -> bool:
        if (chat_template_kwargs or {}).get("enable_thinking") is False:
            return False
        return super().starts_in_reasoning(prompt, chat_template_kwargs)
