"""ResponseStore: the responses a client may fetch again (GET /v1/responses/{id}) or continue
(``previous_response_id``), those created with ``store: true`` (OpenAI's default).

In memory, in the API process, bounded by count: past ``--max-stored-responses`` the least
recently used (created, fetched or continued) goes first; ``--max-stored-responses 0`` keeps none
(vLLM keeps none unless ``VLLM_ENABLE_RESPONSES_API_STORE`` is set, and then all, unbounded).
An entry is the response object as sent and the conversation that led to it as chat messages
(the previous responses', its input's, its output's; not ``instructions``, which OpenAI does not
carry over), so a follow-up prepends one list and no chain is walked. A follow-up's list holds
the same message objects as its predecessor's, so a chain of N turns costs N lists of
references, not N copies of its text. Nothing survives a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from jaxserve.entrypoints.protocol import ChatCompletionMessageParam
from jaxserve.entrypoints.responses_protocol import Response


@dataclass
class StoredResponse:
    response: Response
    messages: list[ChatCompletionMessageParam]  # the conversation, output included


class ResponseStore:
    """At most ``max_size`` StoredResponses by response id (``max_size`` > 0), least recently
    used evicted first. Used from the event loop only: no lock."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        """Whether there was such a response."""
        return self._entries.pop(response_id, None) is not None
