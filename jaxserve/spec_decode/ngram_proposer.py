"""NgramProposer: drafts by prompt lookup, vLLM V1's n-gram method (``v1/spec_decode/
ngram_proposer.py``): find the longest suffix of the sequence, between prompt_lookup_max and
prompt_lookup_min tokens, that occurs earlier in it (prompt and output alike), and propose the
tokens that followed its first occurrence."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Args:
      prompt_lookup_min, prompt_lookup_max: the suffix lengths tried, longest first.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: np.ndarray, k: int) -> list[int]:
        """Up to k draft tokens to follow ``token_ids`` ([L] int, the sequence so far); fewer
        when the match lies near the end, none when no suffix of min_n or more tokens recurs.
        O(L * prompt_lookup_max) numpy work."""
        n_tok = len(token_ids)
        if k <= 0:
            return []
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            # windows that start before the suffix itself: i in [0, L - n)
            windows = sliding_window_view(token_ids[:-1], n)
            hits = np.flatnonzero((windows == token_ids[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[0]) + n
                return token_ids[start : start + k].tolist()
        return []
