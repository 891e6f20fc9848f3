"""SpecDecodingStats: the engine's speculative decoding counters (vLLM V1's
``v1/spec_decode/metrics.py``), cumulative, sent with SchedulerStats to ``/metrics``."""

import msgspec


class SpecDecodingStats(msgspec.Struct):
    """Attributes:
      num_drafts: sequence-steps that verified drafts.
      num_draft_tokens: draft tokens verified.
      num_accepted_tokens: draft tokens accepted.
      num_accepted_tokens_per_pos: [k] drafts accepted at each position (0: the first draft).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        return cls(num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one sequence's verified drafts, of which the first num_accepted_tokens were
        accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def plus(self, other: "SpecDecodingStats") -> "SpecDecodingStats":
        """The sum of two engines' counters (per position over the longer list)."""
        a, b = self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos
        per_pos = [x + y for x, y in zip(a + [0] * (len(b) - len(a)),
                                         b + [0] * (len(a) - len(b)))]
        return SpecDecodingStats(self.num_drafts + other.num_drafts,
                                 self.num_draft_tokens + other.num_draft_tokens,
                                 self.num_accepted_tokens + other.num_accepted_tokens, per_pos)
