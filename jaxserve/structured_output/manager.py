"""StructuredOutputManager: the engine's grammars (vLLM V1's name; docs/structured_outputs.md).

Each constraint (kind, spec) is compiled once into a template matcher (an LRU cache); every
sequence that uses it (each choice of an ``n`` request) gets its own copy, which the scheduler
advances with the sequence's tokens. Each step that samples a constrained sequence, the
scheduler asks ``grammar_bitmask`` for the allowed tokens of those sequences: one row of
ceil(V / 32) int32 words each (bit j of word i allows token 32 i + j), filled by llguidance's
threads, and with speculative decoding one more after each draft the sequence verifies.
``token_bitmask`` gives the fixed row of a sequence's ``allowed_token_ids``, which the
scheduler ANDs into its rows.
"""

from __future__ import annotations

from collections import OrderedDict

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured_output.grammar import build_ll_tokenizer, compile_matcher

# Compiled grammars kept for reuse; a request's grammar outlives the cache entry (a copy).
MAX_CACHED_GRAMMARS = 256


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one bitmask row covering ``vocab_size`` tokens."""
    return -(-vocab_size // 32)


def token_bitmask(token_ids, vocab_size: int) -> np.ndarray:
    """[bitmask_width(vocab_size)] int32: a bitmask row allowing exactly ``token_ids`` (each
    in [0, vocab_size)), as ``allowed_token_ids`` constrains a sequence."""
    ids = np.unique(np.asarray(token_ids, np.int64))
    words = np.zeros(bitmask_width(vocab_size), np.uint32)
    np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    return words.view(np.int32)


class StructuredOutputManager:
    """Args:
      vocab: the model's fast tokenizer (``TokenizerVocab``).
      vocab_size: the model's vocabulary size V (the bitmask rows cover V tokens).
      eos_token_ids: the ids that end generation.
    """

    def __init__(self, vocab, vocab_size: int, eos_token_ids):
        self.ll_tokenizer = build_ll_tokenizer(vocab, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor()

    def grammar_init(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher of the constraint at its start state, for one sequence.

        Raises:
          ValidationError: on ``structured_outputs``, "<kind>: <error>", for a spec that does
            not compile.
        """
        key = params.key
        template = self._compiled.get(key)
        if template is None:
            template = compile_matcher(self.ll_tokenizer, params)
            self._compiled[key] = template
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return template.deep_copy()

    def grammar_bitmask(self, matchers: list[llguidance.LLMatcher],
                        drafts: list[list[int]] | None = None) -> np.ndarray:
        """[sum of 1 + len(drafts[i]), width] int32: per matcher in turn, the tokens it allows
        next (a matcher that is complete and accepts nothing more allows only EOS; one in an
        error state too), then after each of its ``drafts`` (token ids in [0, V), the drafts
        its sequence verifies) as long as it accepts them: the rows after a draft it rejects
        allow every token (that draft is rejected, and the rows after it emit nothing). The
        matchers are left as they were (llguidance rolls the drafts back)."""
        drafts = drafts or [[]] * len(matchers)
        starts = np.cumsum([0] + [1 + len(d) for d in drafts]).tolist()
        mask = llg_numpy.allocate_token_bitmask(starts[-1], self.ll_tokenizer.vocab_size)
        mask.fill(-1)
        plain = [(m, i) for m, i, d in zip(matchers, starts, drafts) if not d]
        drafted = [(m, i, d) for m, i, d in zip(matchers, starts, drafts) if d]
        if plain:
            llg_numpy.fill_next_token_bitmask_par(self._executor, plain, mask)
        if drafted:
            llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted,
                                                                    mask)
        return np.ascontiguousarray(mask[:, : self.width])
