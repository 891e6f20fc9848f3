"""SamplingParams: how to pick each next token and when to stop (vLLM's names and defaults).

Validation lives here, in one place, for the offline API, the HTTP server and the engine. A
msgspec Struct (as in vLLM V1), so it crosses the engine pipe as is; ``__post_init__`` also runs
when a frame is decoded.
"""

import msgspec


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Per-request sampling and stopping settings.

    Attributes:
      max_tokens: most tokens to generate (>= 1); None means up to max_model_len.
      temperature: >= 0; 0 means greedy (argmax).
      top_p: nucleus sampling mass in (0, 1].
      top_k: keep the k most likely tokens; 0 or -1 disables it.
      seed: per-request RNG seed for reproducible sampling; None draws one at random.
      stop: strings that end generation; the stop string is not included in the text.
      stop_token_ids: token ids that end generation (besides EOS), kept out of the text.
      ignore_eos: keep generating past EOS (benchmarks).

    Raises:
      ValueError: from ``__post_init__``, naming the field, when a value is out of range.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be a non-negative 63-bit integer, got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

