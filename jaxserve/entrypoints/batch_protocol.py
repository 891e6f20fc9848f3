"""The batch file's lines (``run_batch``): OpenAI's Batch API request lines in, vLLM's
``BatchRequestOutput`` lines out.

Input, one JSON object a line (OpenAI's "request input object")::

    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}}

``custom_id`` (a string), ``method`` (``POST``), ``url`` (one of ``BATCH_URLS``) and ``body``
(a JSON object: the request body that url takes) are required; other keys are ignored, as
vLLM does. The body is not read here: the server reads it, so a line's body is checked exactly
as a request's. A body with ``"stream": true`` is refused (vLLM's "Request must not be sent in
stream mode"), and a /v1/responses body with ``"background": true``: a batch line's answer is
one finished body.

Output, one JSON object a line (vLLM's ``BatchRequestOutput`` / ``BatchResponseData``)::

    {"id": "vllm-<hex>", "custom_id": "request-1",
     "response": {"status_code": 200, "request_id": "vllm-batch-<hex>", "body": {...}},
     "error": null}

``body`` is the server's response body. A request the server refuses has ``status_code`` its
HTTP status, ``body`` null and ``error`` the server's error body (``{"error": {"message",
"type", "param", "code"}}``); a line that could not be sent (``BatchLineError``: not JSON, a
field missing or of the wrong type, another method, url, ``stream`` or ``background``) has
``status_code`` 400, ``body`` null and ``error`` a string that names the line and the field.
``custom_id`` is null where the line has no string one.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict

from jaxserve.entrypoints.protocol import field_error

# The urls a batch line may name: the server's generation endpoints that answer with one body.
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# vLLM's batch urls for pooling models (embeddings, score, rerank), which jaxserve does not
# serve: such a line gets an error saying so.
_POOLING_URLS = ("/v1/embeddings", "/score", "/rerank")


class BatchLineError(ValueError):
    """A line that cannot be sent; ``custom_id`` is the line's, or None if it has no string
    one."""

    def __init__(self, message: str, custom_id: str | None):
        super().__init__(message)
        self.custom_id = custom_id


class BatchRequestInput(BaseModel):
    """One input line (vLLM's name). Types are strict; unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


def json_object_line(raw: bytes) -> dict:
    """One line of a JSONL file (UTF-8) -> its JSON object (also ``scripts/offline_batch.py``'s).

    Raises:
      ValueError: "not valid UTF-8: ...", "invalid JSON: ..." or "expected a JSON object, got
        list".
    """
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not valid UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def parse_batch_line(raw: bytes) -> BatchRequestInput:
    """One line of the input file (without its newline) -> the request to send.

    Raises:
      BatchLineError: not UTF-8 JSON, not an object, a field missing or of the wrong type, a
        method other than POST, a url not in BATCH_URLS, or ``"stream": true`` (or
        ``"background": true``) in the body.
    """
    try:
        obj = json_object_line(raw)
    except ValueError as e:
        raise BatchLineError(str(e), None) from None
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    try:
        line = BatchRequestInput.model_validate(obj)
    except pydantic.ValidationError as e:
        raise BatchLineError(str(field_error(e)), custom_id) from None
    if line.method != "POST":
        raise BatchLineError(f"method: only POST is supported, got {line.method!r}", custom_id)
    if line.url not in BATCH_URLS:
        pooling = (" (jaxserve serves generative models only: no embeddings, score or rerank)"
                   if line.url.endswith(_POOLING_URLS) else "")
        raise BatchLineError(f"url: {line.url!r} is not served{pooling}; supported: "
                             f"{', '.join(BATCH_URLS)}", custom_id)
    if line.body.get("stream") is True:
        raise BatchLineError("body.stream: Request must not be sent in stream mode (a batch "
                             "line's answer is one body; leave out stream)", custom_id)
    if line.body.get("background") is True:
        raise BatchLineError("body.background: a batch line's answer is the finished response "
                             "(leave out background)", custom_id)
    return line


def batch_output(custom_id: str | None, status_code: int, body: Any = None,
                 error: Any = None) -> dict:
    """An output line (vLLM's ``BatchRequestOutput``) with fresh ids: ``body`` the response
    body of a 200, else ``error`` (the server's error body, or a message)."""
    return {"id": f"vllm-{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status_code,
                         "request_id": f"vllm-batch-{uuid.uuid4().hex}", "body": body},
            "error": error}
