"""LLM: offline batch generation that drives the EngineCore in process (vLLM's ``LLM``)."""

import sys
from collections.abc import Sequence
from numbers import Integral

from tqdm import tqdm

from jaxserve.config import EngineConfig
from jaxserve.engine import EngineCoreRequest
from jaxserve.engine.core import EngineCore
from jaxserve.engine.input_processor import InputProcessor, chat_text_bytes
from jaxserve.engine.output_processor import OutputProcessor, merge_outputs
from jaxserve.entrypoints.protocol import parse_messages
from jaxserve.exceptions import ValidationError
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams


PROMPT_TYPES = "text, token ids, {'prompt': text} or {'prompt_token_ids': ids}"


# vLLM's multimodal prompt keys: taken when they carry nothing (None or empty), since the
# engine serves text-only models and would otherwise ignore what they hold.
MULTIMODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


def _prompt_dict(p: dict) -> tuple[object, str | None]:
    """vLLM's TextPrompt / TokensPrompt -> (its prompt, its ``cache_salt`` or None).

    Raises:
      TypeError: not exactly one of ``prompt`` and ``prompt_token_ids``, a key vLLM's prompt
        dicts do not have, or a ``cache_salt`` that is no non-empty string.
      ValidationError: on the multimodal key that holds something.
    """
    keys = [k for k in ("prompt", "prompt_token_ids") if k in p]
    if len(keys) != 1 or not {*keys, "cache_salt", *MULTIMODAL_KEYS} >= p.keys():
        raise TypeError(f"a prompt dict holds 'prompt' or 'prompt_token_ids', and optionally "
                        f"'cache_salt' and vLLM's multimodal keys, empty; got "
                        f"{sorted(p, key=str)}")
    for key in MULTIMODAL_KEYS:
        value = p.get(key)
        if value is not None and not (isinstance(value, (dict, list, tuple)) and not value):
            raise ValidationError(f"{key}: multimodal input is not supported (this engine "
                                  "serves text-only models)", parameter=key)
    salt = p.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        raise TypeError(f"a prompt's cache_salt: expected a non-empty string, got {salt!r}")
    return p[keys[0]], salt


def _shape(value) -> str:
    """A value's type for an error message: ``list of str`` for a list."""
    if isinstance(value, (list, tuple)) and value:
        return f"{type(value).__name__} of {type(value[0]).__name__}"
    return type(value).__name__


class LLM:
    """Generate text for many prompts at once with continuous batching.

    Args:
      model: None for the default model (SmolLM2-135M-Instruct, fetched on first use); a GGUF
        file, an HF folder, an orbax folder, or with ``load_format="dummy"`` a preset such as
        ``"llama-3.1-8b"`` or a config.json path.
      log: receives the start-up progress lines (default: stderr).
      **kwargs: other EngineConfig fields (``max_model_len``, ``max_num_seqs``,
        ``max_num_batched_tokens``, ``dtype``, ``kv_cache_gib``, ``load_format``,
        ``generation_config``, ...).

    Raises:
      ValueError: an unusable model or settings (see EngineCore).
    """

    def __init__(self, model: str | None = None, *, log=None, **kwargs):
        if log is None:  # start-up progress goes to stderr, as the server's does
            log = lambda msg: print(f"[jaxserve] {msg}", file=sys.stderr, flush=True)  # noqa: E731
        self.engine = EngineCore(EngineConfig(model=model, **kwargs), log=log)
        self.tokenizer = self.engine.tokenizer
        self.input_processor = InputProcessor(self.tokenizer, self.engine.config.max_model_len,
                                              self.engine.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer, self.engine.eos_token_ids)
        self._next_id = 0

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, a list of token ids, or vLLM's prompt dicts
        ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``); results in input order, each
        with its ``n`` choices (CompletionOutputs by index) and, where asked, log-probabilities
        (``CompletionOutput.logprobs``, ``RequestOutput.prompt_logprobs``).

        A prompt dict may also hold vLLM's ``cache_salt`` (the prefix cache shares its pages
        only with prompts of the same salt) and its multimodal keys (``multi_modal_data``,
        ``mm_processor_kwargs``, ``multi_modal_uuids``) when they are None or empty.

        ``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`` (or
        ``regex``, ``choice``, ``grammar``, ``json_object``) constrains the output.
        ``lora_request`` (one for all prompts, or one per prompt; None: the base model) runs
        them with LoRA adapters (``LLM(enable_lora=True, ...)``, docs/lora.md).

        Raises:
          ValidationError: a prompt that is empty, holds an id outside the vocabulary or does not
            fit max_model_len (a text too long to fit is refused before it is tokenized:
            ``InputProcessor.check_text_size``), carries multimodal data, a SamplingParams field
            out of range (checked again here, as it may have been changed since it was made)
            or token id outside the vocabulary, or structured outputs that do not compile
            (before any work; the message names the prompt's index).
          ValueError: a LoRA adapter that is missing or refused, before any work.
          TypeError: ``prompts`` or ``sampling_params`` of another type than these, a prompt
            dict with other keys, a ``cache_salt`` that is no non-empty string.
        """
        if (isinstance(prompts, (str, dict))
                or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], Integral))):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts: expected {PROMPT_TYPES} or a list of them, "
                            f"got {type(prompts).__name__}")
        items = []
        for i, p in enumerate(prompts):
            salt = None
            try:
                if isinstance(p, dict):  # vLLM's TextPrompt / TokensPrompt
                    p, salt = _prompt_dict(p)
                if isinstance(p, str):  # measured before it is tokenized, as the server does
                    self.input_processor.check_text_size(len(p.encode("utf-8")))
            except ValidationError as e:
                raise ValidationError(f"prompt {i}: {e}", parameter=e.parameter) from None
            if isinstance(p, str):
                items.append((p, self.input_processor.tokenize_prompt(p), salt))
            elif isinstance(p, Sequence) and all(isinstance(t, Integral) for t in p):
                items.append((None, self.input_processor.tokenize_prompt(p), salt))
            else:
                raise TypeError(f"a prompt: expected {PROMPT_TYPES}, got {type(p).__name__}")
        return self._run(items, sampling_params, use_tqdm, lora_request)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or a list of them, through the
        model's chat template with the assistant turn opened (vLLM's ``add_generation_prompt``,
        ``continue_final_message`` and ``chat_template_kwargs`` as the server takes them).
        The messages are read as the server reads a chat request's (OpenAI's format,
        ``protocol.parse_messages``): text content parts are joined, ``developer`` is
        ``system``, assistant ``tool_calls`` carry their ``id`` and their arguments as JSON
        text, ``tool`` messages their ``tool_call_id``. ``tools`` (OpenAI tool definitions)
        are rendered as the server renders them (docs/tool_calling.md); the text comes back as
        the model wrote it, calls unparsed, as vLLM's ``LLM.chat`` does.

        Raises:
          ValidationError: as ``generate``, or on ``messages``: a message the server would
            refuse (a non-text content part, a missing field), or the chat template rejected
            them (the message names the conversation's index as ``prompt``'s).
          ValueError: as ``generate``.
          TypeError: ``messages`` is not a list of message dicts or a list of such lists;
            ``sampling_params`` as ``generate``.
        """
        is_conversation = (isinstance(messages, Sequence) and not isinstance(messages, str)
                           and bool(messages) and isinstance(messages[0], dict))
        conversations = [messages] if is_conversation else messages
        if not isinstance(conversations, Sequence) or isinstance(conversations, str) or any(
                not isinstance(c, Sequence) or isinstance(c, str)
                or not all(isinstance(m, dict) for m in c) for c in conversations):
            raise TypeError(f"messages: expected a conversation (a list of message dicts, "
                            f"{{'role': ..., 'content': ...}}) or a list of them, got "
                            f"{_shape(messages)}")
        items = []
        for i, conv in enumerate(conversations):
            try:
                conv = parse_messages(conv)
                self.input_processor.check_text_size(
                    chat_text_bytes(conv, tools, chat_template_kwargs), "messages")
                text, ids = self.input_processor.tokenize_chat(
                    conv, add_generation_prompt, tools=tools,
                    continue_final_message=continue_final_message,
                    chat_template_kwargs=chat_template_kwargs)
                items.append((text, ids, None))
            except ValidationError as e:
                raise ValidationError(f"prompt {i}: {e}", parameter=e.parameter) from None
        return self._run(items, sampling_params, use_tqdm, lora_request)

    def get_tokenizer(self):
        """The model's tokenizer (a transformers tokenizer), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``chat`` use when given no SamplingParams: the model's
        generation config (``generation_config``, as vLLM's), else SamplingParams' defaults."""
        return SamplingParams(**self.engine.generation_config)

    def _run(self, items, sampling_params, use_tqdm, lora_request=None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(items)
        if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str):
            raise TypeError(f"sampling_params: expected a SamplingParams or a list of them (one "
                            f"per prompt), got {type(sampling_params).__name__}")
        for sp in sampling_params:
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params: expected a SamplingParams or a list of them "
                                f"(one per prompt), got a list holding {type(sp).__name__}")
        if len(sampling_params) != len(items):
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {len(items)} prompts"
            )
        loras = (lora_request if isinstance(lora_request, Sequence)
                 else [lora_request] * len(items))
        if len(loras) != len(items):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(items)} prompts")
        for lora in {r for r in loras if r is not None}:
            self.engine.add_lora(lora)
        checked = set()  # ids of the SamplingParams checked (one is often every prompt's)
        for i, ((_, ids, _), sp) in enumerate(zip(items, sampling_params)):
            try:
                self.input_processor.check_prompt(ids)
                if id(sp) in checked:
                    continue
                checked.add(id(sp))
                sp.verify()  # again: a field may have been changed since it was made
                self.input_processor.check_sampling_params(sp)
                if sp.structured_outputs is not None:  # compiled once; add_request reuses it
                    self.engine.structured_output_manager.grammar_init(sp.structured_outputs)
            except ValidationError as e:
                raise ValidationError(f"prompt {i}: {e}", parameter=e.parameter) from None
        index: dict[str, int] = {}
        results: list[RequestOutput | None] = [None] * len(items)
        bar = tqdm(total=len(items), desc="generating", disable=not use_tqdm, unit="req")
        try:
            for i, ((prompt, ids, salt), sp, lora) in enumerate(
                    zip(items, sampling_params, loras)):
                rid = str(self._next_id)
                self._next_id += 1
                index[rid] = i
                self.output_processor.add_request(rid, prompt, ids, sp, lora_request=lora)
                self.engine.add_request(EngineCoreRequest(rid, ids, sp, lora_request=lora,
                                                          cache_salt=salt))
            while index:
                processed = self.output_processor.process_outputs(self.engine.step())
                if processed.reqs_to_abort:
                    self.engine.abort_requests(processed.reqs_to_abort)
                for delta in processed.request_outputs:
                    i = index[delta.request_id]
                    results[i] = delta if results[i] is None else merge_outputs(results[i], delta)
                    if delta.finished:
                        del index[delta.request_id]
                        bar.update(1)
        finally:  # an interrupt (Ctrl-C) or an error leaves no request behind in the engine
            bar.close()
            for rid in index:
                self.engine.abort_requests(self.output_processor.abort_request(rid))
        return results
