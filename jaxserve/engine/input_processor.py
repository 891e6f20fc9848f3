"""InputProcessor: prompt -> checked token ids for an EngineCoreRequest (vLLM V1's name).

The one place where prompts are tokenized and validated, shared by the server (``AsyncLLM``),
``jaxserve.LLM`` and ``scripts/offline_batch.py``, so that the same prompt gives the same ids
through every entry point. The engine trusts what comes out of it.

Tokenization follows vLLM:
- a text prompt is encoded *with* the tokenizer's special tokens (a BOS where the tokenizer adds
  one, as the model saw in training);
- a chat is rendered through the model's chat template with the assistant turn opened (or its
  last message left open: vLLM's ``continue_final_message``), and that text is encoded *without*
  adding special tokens: the template writes its own BOS, so a prompt never starts with two;
  tools go to the template, or into the messages for a template that ignores them
  (``chat_tools``, docs/tool_calling.md); a request's ``chat_template_kwargs`` reach the
  template filtered to its own variables (``chat_template``);
- a prompt given as token ids is taken as it is.

Text is measured before it is tokenized (``check_text_size``): no token stands for more than
``max_token_bytes`` bytes of text, so a text of more than ``max_model_len * max_token_bytes``
UTF-8 bytes has more tokens than fit, and is refused in microseconds instead of being tokenized
(a 50 MB prompt takes 43 s to tokenize and blocks the API's event loop meanwhile).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from jaxserve.engine.chat_template import template_kwargs, template_variables
from jaxserve.engine.chat_tools import hermes_messages, template_handles_tools
from jaxserve.exceptions import ValidationError


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for.

    A vocabulary entry's own string is never shorter in UTF-8 than the text it decodes to:
    byte-level BPE writes one character per byte, SentencePiece writes the text itself (``▁``,
    3 bytes, for a 1-byte space), byte-fallback tokens are ``<0x41>`` (6 bytes for 1), and added
    tokens are their literal text. A normalizer that deletes characters could break the bound,
    so with a normalizer it is doubled.
    """
    vocab = tokenizer.get_vocab()
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.normalizer is not None:
        longest *= 2
    return max(longest, 1)


def chat_text_bytes(messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    chat_template_kwargs: dict | None = None) -> int:
    """UTF-8 bytes of a chat's text, for ``InputProcessor.check_text_size``: the messages'
    roles (any string: vLLM's custom roles), contents and reasoning, their tool calls'
    arguments, the tools' and the template variables' JSON (all of it may reach the prompt)."""
    size = sum(len(m["role"].encode("utf-8")) + len(m["content"].encode("utf-8"))
               + len(m.get("reasoning_content", "").encode("utf-8")) for m in messages)
    calls = [c["function"] for m in messages for c in m.get("tool_calls") or ()]
    if calls or tools or chat_template_kwargs:
        size += len(json.dumps([calls, tools or [], chat_template_kwargs or {}],
                               ensure_ascii=False).encode("utf-8"))
    return size


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Raises ValidationError on ``field`` for an id outside [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValidationError(f"{field}: token id {bad[0]} is out of range [0, {vocab_size})",
                              parameter=field)


def check_sampling_token_ids(sp, vocab_size: int) -> None:
    """Raises ValidationError on the field of a SamplingParams token id outside
    [0, vocab_size)."""
    check_token_ids(sp.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(sp.logit_bias or (), vocab_size, "logit_bias")
    check_token_ids(sp.allowed_token_ids or (), vocab_size, "allowed_token_ids")


class InputProcessor:
    """Args:
      tokenizer: a transformers fast tokenizer (with a chat template for ``tokenize_chat``).
      max_model_len: longest sequence, prompt + output, tokens.
      vocab_size: the model's vocabulary size; prompt ids must be in [0, vocab_size).
    """

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # Longest text that might still fit max_model_len tokens, UTF-8 bytes.
        self.max_text_bytes = max_model_len * max_token_bytes(tokenizer)
        self.template_handles_tools = (bool(getattr(tokenizer, "chat_template", None))
                                       and template_handles_tools(tokenizer))
        self.template_variables = template_variables(tokenizer)

    def check_text_size(self, num_bytes: int, field: str = "prompt") -> None:
        """Refuse, before tokenizing, text too long to fit max_model_len tokens.

        Args:
          num_bytes: the text's UTF-8 length (a chat: all message contents together).
          field: the request field named in the error.

        Raises:
          ValidationError: on ``field``, the text has more than ``max_text_bytes`` bytes.
        """
        if num_bytes > self.max_text_bytes:
            raise ValidationError(
                f"{field}: {num_bytes} bytes of text cannot fit this model's maximum context "
                f"length (max_model_len) of {self.max_model_len} tokens (at most "
                f"{self.max_text_bytes} bytes could). Please reduce the length of the input.",
                parameter=field)

    def check_sampling_params(self, sp) -> None:
        """Raises ValidationError, on ``stop_token_ids``, ``logit_bias`` or
        ``allowed_token_ids``, for a token id of the SamplingParams outside the vocabulary."""
        check_sampling_token_ids(sp, self.vocab_size)

    def tokenize_prompt(self, prompt: str | Sequence[int],
                        add_special_tokens: bool = True) -> list[int]:
        """A completion prompt (text, or token ids) -> token ids."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        return [int(t) for t in prompt]

    def tokenize_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                      add_special_tokens: bool = False, tools: Sequence[dict] | None = None,
                      continue_final_message: bool = False,
                      chat_template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """Chat messages (the transformers chat format: ``{"role", "content"}``, assistant
        ``tool_calls``, ``tool`` messages) -> (the rendered template, with the assistant
        generation prompt appended unless ``add_generation_prompt`` is False, and its token
        ids; ``add_special_tokens`` adds the tokenizer's own on top, vLLM's option).
        ``continue_final_message`` ends the text inside the last message, for the model to go
        on with it (not with ``add_generation_prompt``). ``tools`` (OpenAI tool definitions)
        go to the template, or, for a template that ignores them, into the messages in the
        Hermes format (``chat_tools``, docs/tool_calling.md). ``chat_template_kwargs``: more
        template variables (``chat_template.template_kwargs`` filters them).

        Raises:
          ValidationError: on ``messages``: the tokenizer has no chat template, or the template
            rejected the messages (e.g. roles that do not alternate); on
            ``chat_template_kwargs``: a key that cannot be set.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValidationError("messages: this model has no chat template; use /v1/completions",
                                  parameter="messages")
        kw = template_kwargs(chat_template_kwargs, self.template_variables)
        if self.template_handles_tools:
            kw["tools"] = list(tools) if tools else None
        else:
            messages = hermes_messages(messages, tools)
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kw)
        except Exception as e:  # jinja errors, raised by the template itself
            raise ValidationError(f"messages: the chat template rejected them: {e}",
                                  parameter="messages") from e
        return text, list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_prompt(self, prompt_token_ids: Sequence[int], max_tokens: int | None = None) -> None:
        """Check that a prompt can run (OpenAI's wording for the length errors).

        Args:
          prompt_token_ids: the tokenized prompt.
          max_tokens: when given, the prompt plus max_tokens must fit max_model_len (the
            server's rule, as OpenAI's API and vLLM's server reject such requests); when None,
            only the prompt must leave room for one generated token (the offline rule:
            generation stops at max_model_len with finish_reason "length").

        Raises:
          ValidationError: on ``prompt``: an empty prompt, an id outside the vocabulary, or a
            prompt that leaves no room; on ``max_tokens``: a prompt that fits, but not with
            ``max_tokens`` more.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise ValidationError("prompt: the prompt is empty (it tokenizes to no tokens)",
                                  parameter="prompt")
        if n >= self.max_model_len:
            raise ValidationError(
                f"This model's maximum context length (max_model_len) is {self.max_model_len} "
                f"tokens. However, your prompt has {n} tokens, which leaves no room for the "
                "completion.", parameter="prompt")
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise ValidationError(
                f"This model's maximum context length (max_model_len) is {self.max_model_len} "
                f"tokens. However, you requested {n + max_tokens} tokens ({n} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the length of the prompt or "
                "of the completion.",
                parameter="max_tokens")
        # After the length check, so a huge id list costs no more than max_model_len looks.
        check_token_ids(prompt_token_ids, self.vocab_size, "prompt")
