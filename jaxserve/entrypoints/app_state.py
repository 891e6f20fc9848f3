"""The keys of what the aiohttp app holds: the AsyncLLM and the server's settings.

``api_server.build_app`` stores them and the handlers (api_server's own, the serving_*.py
modules') read them. They live here, apart from both, so that the serving modules do not import
api_server, which imports them.
"""

from __future__ import annotations

from aiohttp import web

from jaxserve.engine.async_llm import AsyncLLM

LLM_KEY = web.AppKey("llm", AsyncLLM)
# {"served_model_name": str | None (None: AsyncLLM.model_name), "created": int (unix time),
#  "limits": ServerLimits, "in_flight": int (generation requests admitted and not yet answered),
#  "tool_parser": the ToolParser class of --tool-call-parser,
#  "reasoning_parser": the ReasoningParser class of --reasoning-parser, or None,
#  "return_tokens_as_token_ids": bool, --return-tokens-as-token-ids,
#  "responses_store": the ResponseStore of /v1/responses, None with --max-stored-responses 0,
#  "lora_requests": {name: LoRARequest} the LoRA adapters served (serving_models.py),
#  "lora_ids": itertools.count, their ids (never reused)}
STATE_KEY = web.AppKey("state", dict)
