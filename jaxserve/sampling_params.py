"""SamplingParams: how to pick each next token and when to stop (vLLM's names and defaults).

Validation lives here, in one place, for the offline API, the HTTP server and the engine. A
msgspec Struct (as in vLLM V1), so it crosses the engine pipe as is; ``__post_init__`` also runs
when a frame is decoded, so the engine process re-checks every request it receives.

Bounds keep every value inside what the engine's arrays hold (int32 top_k, float32 temperature
and top_p) and what the API process can afford per token (stop strings are matched in Python on
every delta, so their number and length are capped).
"""

import math

import msgspec

INT32_MAX = 2**31 - 1
MAX_TEMPERATURE = 2.0  # OpenAI's documented range is [0, 2]
# vLLM's floor: 0 < temperature < 0.01 is raised to 0.01 (dividing logits by a smaller one
# overflows float32 and turns sampling into NaNs).
MIN_TEMPERATURE = 0.01
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Per-request sampling and stopping settings.

    Attributes:
      max_tokens: most tokens to generate, in [1, 2**31 - 1]; None means up to max_model_len.
      temperature: in [0, 2]; 0 means greedy (argmax); values in (0, 0.01) act as 0.01.
      top_p: nucleus sampling mass in (0, 1].
      top_k: keep the k most likely tokens, at most 2**31 - 1; 0 or -1 disables it.
      seed: per-request RNG seed for reproducible sampling; None draws one at random.
      stop: up to 16 strings of 1..256 characters that end generation; the stop string is not
        included in the text.
      stop_token_ids: up to 1024 non-negative token ids that end generation (besides EOS), kept
        out of the text (the InputProcessor also checks them against the vocabulary).
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
        if self.max_tokens is not None and not 1 <= self.max_tokens <= INT32_MAX:
            raise ValueError(f"max_tokens must be in [1, {INT32_MAX}], got {self.max_tokens}")
        # NaN fails every comparison, so each check is written to pass only for good values.
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or in [1, {INT32_MAX}], "
                             f"got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be a non-negative 63-bit integer, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got "
                             f"{len(self.stop_token_ids)}")
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
