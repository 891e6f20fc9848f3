"""StructuredOutputManager: the engine's grammars (vLLM V1's name; docs/structured_outputs.md).

Each constraint (kind, spec) is compiled once into a template matcher (an LRU cache); every
sequence that uses it (each choice of an ``n`` request) gets its own copy, which the scheduler
advances with the sequence's tokens. Each step that samples a constrained sequence, the
scheduler asks ``grammar_bitmask`` for the allowed tokens of those sequences: one row of
ceil(V / 32) int32 words each (bit j of word i allows token 32 i + j), filled by llguidance's
threads into a buffer allocated once. ``token_bitmask`` gives the fixed row of a sequence's
``allowed_token_ids``, which the scheduler ANDs into its rows.
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
      max_num_seqs: the most sequences one step samples.
    """

    def __init__(self, vocab, vocab_size: int, eos_token_ids, max_num_seqs: int):
        self.ll_tokenizer = build_ll_tokenizer(vocab, vocab_size, eos_token_ids)
        self.width = bitmask_width(vocab_size)
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor()
        self._bitmask = llg_numpy.allocate_token_bitmask(max_num_seqs,
                                                         self.ll_tokenizer.vocab_size)

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

    def grammar_bitmask(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """[len(matchers), width] int32: the tokens each matcher allows next (a matcher that
        is complete and accepts nothing more allows only EOS; one in an error state too).

        The rows are a copy: the buffer is refilled next step while the device may still
        be reading the previous step's rows."""
        n = len(matchers)
        llg_numpy.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, m in enumerate(matchers)], self._bitmask[:n])
        return self._bitmask[:n, : self.width].copy()
