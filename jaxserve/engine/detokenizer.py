"""Incremental, UTF-8-safe detokenization with stop-string handling.

Token ids arrive a few at a time (one per engine step); text leaves as deltas. Decoding goes
through ``tokenizers.decoders.DecodeStream``, which buffers ids until they form whole UTF-8
characters, so a delta never holds half a multi-byte character (no U+FFFD from a split emoji or
CJK character). Stop strings are matched on the decoded text; text that might be the start of a
stop string is held back until it is known not to be one.

Used by the API process (AsyncLLM's OutputProcessor) and by the offline ``jaxserve.LLM``.
``TokenPieces`` gives single tokens' text and bytes, for log-probabilities.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from tokenizers import decoders
from tokenizers.decoders import DecodeStream

# Text for token ids beyond the tokenizer's vocabulary (dummy-weight models borrow the default
# model's tokenizer but may sample ids it does not know).
UNKNOWN_TOKEN_TEXT = "<unk>"

# How many prompt ids prime the decode stream (so e.g. SentencePiece's leading-space rule sees
# the context the first generated token follows).
_PROMPT_CONTEXT_IDS = 6


def _backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a transformers fast tokenizer (or itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        backend = getattr(tokenizer, "_tokenizer", None)
    return backend if backend is not None else tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas, stopping at stop strings.

    Args:
      tokenizer: a transformers fast tokenizer (``PreTrainedTokenizerFast`` or transformers 5's
        ``TokenizersBackend``) or a raw ``tokenizers.Tokenizer``.
      skip_special_tokens: leave special tokens (e.g. ``<|im_end|>``) out of the text.
      stop: stop strings; generation text ends right before the earliest match, and the match
        is not part of the text (as in OpenAI and vLLM).
      include_stop_str_in_output: the text ends right after the match instead.
      min_tokens: stop strings are looked for only once more than this many ids were fed (as
        vLLM does).
      prompt_token_ids: optional prompt ids; the last few prime the decoder so the first
        generated token is decoded in context. Their text is never emitted.

    Attributes:
      output_text: all text decoded so far, up to (excluding) a matched stop string. It includes
        text that ``update`` still holds back; it is final once ``finished``.
      stop_matched: the stop string that matched, or None.
      token_ids: every id fed so far (ids fed after a stop string matched are ignored).
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True,
                 stop: Iterable[str] = (), include_stop_str_in_output: bool = False,
                 min_tokens: int = 0, prompt_token_ids: Sequence[int] | None = None):
        self._tok = _backend(tokenizer)
        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        context = [i for i in (prompt_token_ids or [])[-_PROMPT_CONTEXT_IDS:]
                   if 0 <= i < self._vocab_size]
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self.output_text = ""
        self.stop_matched: str | None = None
        self.token_ids: list[int] = []
        self._emitted = 0  # chars of output_text already returned as deltas
        self._finished = False

    @property
    def finished(self) -> bool:
        """True once a stop string matched or ``flush`` was called."""
        return self._finished

    def _decode_one(self, token_id: int) -> str:
        if not 0 <= token_id < self._vocab_size:
            return UNKNOWN_TOKEN_TEXT
        piece = self._stream.step(self._tok, token_id)
        return piece or ""

    def update(self, new_token_ids: Iterable[int]) -> str:
        """Feed newly generated ids; returns the new text that is safe to show (may be "").

        After a stop string matched (``stop_matched`` set) the remaining ids of this call and any
        later calls are ignored and "" is returned; the caller should end the request.
        """
        if self._finished:
            return ""
        start = len(self.output_text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.output_text += self._decode_one(int(token_id))
            if self._stop and len(self.token_ids) > self._min_tokens and self._check_stop(start):
                break
        if self._finished:
            return self._take(len(self.output_text))
        return self._take(len(self.output_text) - self._holdback())

    def flush(self) -> str:
        """Finish the request (it ended without a stop string): returns the held-back text."""
        self._finished = True
        return self._take(len(self.output_text))

    # -- internals ---------------------------------------------------------------------------

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self.output_text[self._emitted:end]
        self._emitted = end
        return delta

    def _check_stop(self, start: int) -> bool:
        """Look for a stop string that ends in the text added since ``start``; truncate at it."""
        text = self.output_text
        lo = max(0, start - self._max_stop + 1)
        best = None
        for s in self._stop:
            i = text.find(s, lo)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.output_text = text[: i + len(s) if self._include_stop else i]
        self.stop_matched = s
        self._finished = True
        return True

    def _holdback(self) -> int:
        """Length of the longest suffix of the unemitted text that starts some stop string
        (none when stop strings end up in the output anyway)."""
        if not self._stop or self._include_stop:
            return 0
        text = self.output_text
        tail_len = min(self._max_stop - 1, len(text) - self._emitted)
        for n in range(tail_len, 0, -1):
            suffix = text[len(text) - n:]
            if any(s.startswith(suffix) for s in self._stop):
                return n
        return 0


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _has_byte_level(decoder) -> bool:
    if isinstance(decoder, decoders.ByteLevel):
        return True
    return isinstance(decoder, decoders.Sequence) and "ByteLevel" in repr(decoder)


class TokenPieces:
    """Each token's own text and UTF-8 bytes, cached per id (log-probabilities name tokens one
    at a time, where a token may hold only part of a character).

    Bytes: a byte-level BPE vocabulary (GPT-2's byte-to-character map, from transformers) maps
    back exactly, as do SentencePiece byte-fallback tokens (``<0x41>``); other tokens are their
    string with SentencePiece's ``▁`` as a space; added tokens (``<|im_end|>``) are their
    content. Text: the bytes decoded as UTF-8, U+FFFD for a partial character.

    Args:
      tokenizer: as IncrementalDetokenizer's.
    """

    def __init__(self, tokenizer):
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self._tok = _backend(tokenizer)
        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._byte_of = ({c: b for b, c in bytes_to_unicode().items()}
                         if _has_byte_level(self._tok.decoder) else None)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """(text, UTF-8 bytes) of one token; ids outside the vocabulary read as UNKNOWN."""
        hit = self._cache.get(token_id)
        if hit is None:
            data = self._bytes(token_id)
            hit = self._cache[token_id] = (data.decode("utf-8", "replace"), data)
        return hit

    def _bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self._vocab_size:
            return UNKNOWN_TOKEN_TEXT.encode()
        if token_id in self._added:
            return self._added[token_id].encode()
        token = self._tok.id_to_token(token_id)
        if self._byte_of is not None and all(c in self._byte_of for c in token):
            return bytes(self._byte_of[c] for c in token)
        fallback = _BYTE_FALLBACK.fullmatch(token)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return token.replace("\u2581", " ").encode()
