"""Tool-call parsers, one module per output format, chosen with ``--tool-call-parser`` (vLLM's
names). ``hermes`` is the default: it is the format jaxserve renders into the system prompt
for chat templates that ignore tools, as the default model's does (docs/tool_calling.md)."""

from jaxserve.entrypoints.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls, ParsedDelta, ToolCall, ToolCallDelta, ToolParser)
from jaxserve.entrypoints.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from jaxserve.entrypoints.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": Hermes2ProToolParser,
    "llama3_json": Llama3JsonToolParser,
}
DEFAULT_TOOL_PARSER = "hermes"

__all__ = ["DEFAULT_TOOL_PARSER", "TOOL_PARSERS", "ExtractedToolCalls", "Hermes2ProToolParser",
           "Llama3JsonToolParser", "ParsedDelta", "ToolCall", "ToolCallDelta", "ToolParser"]
