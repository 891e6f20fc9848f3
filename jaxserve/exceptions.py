"""ValidationError: a request value that is malformed, out of range or does not fit, with the
field at fault (vLLM's VLLMValidationError). The HTTP server answers it with a 400 whose
``param`` is that field, in the request's own name; the offline API raises it as is."""

from __future__ import annotations


class ValidationError(ValueError):
    """A request value that cannot be served.

    Attributes:
      parameter: the field at fault, in SamplingParams' / the engine's names (``prompt``,
        ``max_tokens``, ``logprobs``, ``structured_outputs``, ...), or the request's field
        (``messages``, ``tool_choice``, ``guided_json``, ...) where there is no internal one;
        None when no one field is.
    """

    def __init__(self, message: str, *, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter

