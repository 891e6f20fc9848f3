"""Byte-level BPE tokenizer from GGUF metadata -> ``transformers.PreTrainedTokenizerFast``.

Source format: llama.cpp's GGUF tokenizer keys (``tokenizer.ggml.model == "gpt2"``,
``tokenizer.ggml.tokens`` spelled in GPT-2's byte-to-unicode alphabet, ``tokenizer.ggml.merges``
as ``"a b"`` strings, ``tokenizer.ggml.token_type`` (3 = control, 4 = user-defined),
``tokenizer.ggml.{bos,eos,unknown,padding}_token_id``, ``tokenizer.ggml.pre`` naming the
pre-tokenizer regex, ``tokenizer.chat_template``).

The pieces are the ``tokenizers`` library's own (BPE model, Split/Digits/ByteLevel
pre-tokenizers, ByteLevel decoder), assembled the way transformers' GGUF integration does
(``transformers.integrations.gguf.gguf_tokenizer_mapping.byte_level_tokenizer``). We assemble them
here instead of calling that module because it is private and moved between transformers 4.x and
5.x (the GPU image has another version), and because it does not know llama.cpp's ``smollm``
pre-tokenizer (digits split one by one before the GPT-2 regex; llama.cpp ``llama-vocab.cpp``), which
SmolLM2 needs for numbers to tokenize as the original tokenizer does.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, split digits one by one first)
PRE_TOKENIZERS = {
    "default": (GPT2_SPLIT, False),
    "gpt2": (GPT2_SPLIT, False),
    "smollm": (GPT2_SPLIT, True),
    "starcoder": (GPT2_SPLIT, True),
    "refact": (GPT2_SPLIT, True),
    "llama3": (LLAMA3_SPLIT, False),
    "llama-v3": (LLAMA3_SPLIT, False),
    "llama-bpe": (LLAMA3_SPLIT, False),
    "qwen2": (QWEN2_SPLIT, False),
}

CONTROL, USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str | None):
    split, digits = PRE_TOKENIZERS.get(pre or "default", PRE_TOKENIZERS["default"])
    seq = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    seq += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return pre_tokenizers.Sequence(seq)


def build_tokenizer(meta: dict):
    """Build the tokenizer from GGUF metadata.

    Args:
      meta: ``{gguf key: python value}`` for the ``tokenizer.*`` keys (lists for arrays).
    Returns:
      ``transformers.PreTrainedTokenizerFast`` with bos/eos/unk/pad tokens, the chat template,
      and ``add_bos_token``/``add_eos_token`` as the file says (default: no BOS added, as
      llama.cpp does for ``gpt2``-type vocabularies).
    """
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer type {kind!r} is not supported (expected byte-level BPE 'gpt2')")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()

    types = list(meta.get("tokenizer.ggml.token_type") or [])
    # Control tokens (<|im_start|>, <|endoftext|>, ...) stay whole and are skipped by
    # decode(skip_special_tokens=True); user-defined ones (e.g. <think>) stay whole but are text.
    added = [AddedToken(t, special=(ty == CONTROL), normalized=False)
             for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
    tok.add_tokens(added)

    def tok_of(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    kwargs = dict(bos_token=tok_of("bos_token_id"), eos_token=tok_of("eos_token_id"),
                  unk_token=tok_of("unknown_token_id"), pad_token=tok_of("padding_token_id"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   **{k: v for k, v in kwargs.items() if v is not None})
    # gpt2-type vocabularies get no BOS/EOS from the tokenizer unless the file says so; the chat
    # template writes its own special tokens.
    if meta.get("tokenizer.ggml.add_bos_token") or meta.get("tokenizer.ggml.add_eos_token"):
        from tokenizers import processors
        bos = kwargs["bos_token"] if meta.get("tokenizer.ggml.add_bos_token") else None
        eos = kwargs["eos_token"] if meta.get("tokenizer.ggml.add_eos_token") else None
        single = " ".join([*([bos] if bos else []), "$A", *([eos] if eos else [])])
        pair = " ".join([*([bos] if bos else []), "$A", *([eos] if eos else []), "$B:1",
                         *([eos + ":1"] if eos else [])])
        special = [(t, vocab[t]) for t in {bos, eos} if t]
        fast.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special)
    if meta.get("tokenizer.chat_template"):
        fast.chat_template = meta["tokenizer.chat_template"]
    return fast
