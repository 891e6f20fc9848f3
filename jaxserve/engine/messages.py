"""The API process <-> engine process pipe: one msgpack frame per message (docs/architecture.md,
"Processes"), sent with ``Connection.send_bytes``. Token ids cross the pipe, text never does.

Each message is a msgspec Struct tagged with its ``type``; msgspec encodes and decodes the typed
objects directly (no per-field conversion), as vLLM V1 does.

API -> engine:
  ``add``       an EngineCoreRequest (request_id, prompt_token_ids, sampling_params)
  ``abort``     {request_ids}
  ``shutdown``  {}

Engine -> API:
  ``ready``     {model_name, config, tokenizer_dir, eos_token_ids, vocab_size,
                 allocator_fraction, generation_config, lora_shapes}
  ``outputs``   {outputs: [EngineCoreOutput], stats: SchedulerStats | None}
  ``error``     {request_ids, message, kind, fatal}; ``kind`` is "invalid_request" (the request
                was rejected) or "internal"; ``fatal`` means the engine is exiting (e.g. the
                model could not be loaded) and ``request_ids`` is empty.

``encode(msg)`` turns a message into bytes; ``decode(data)`` turns bytes back into the same
message. Both raise ``ValueError`` on anything else.
"""

from __future__ import annotations

import msgspec

from jaxserve.config import ResolvedConfig
from jaxserve.engine import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from jaxserve.lora.checkpoint import LoRAShapes


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    """The engine finished start-up.

    Attributes:
      model_name: the model's name, the served name unless --served-model-name: ``--model``
        as given, or the default model's own name (``SmolLM2-135M-Instruct``).
      config: the configuration the engine runs with (``max_model_len``: the longest
        sequence, prompt + output, tokens; ``max_num_seqs``: the most sequences in one step).
      tokenizer_dir: a folder with the tokenizer (``tokenizer_io.save_tokenizer``'s layout;
        ``model_loader.tokenizer_export``): the API process loads it (``load_tokenizer``).
      eos_token_ids: ids that end generation by default.
      vocab_size: the model's vocabulary size (ids at or above it are invalid).
      allocator_fraction: XLA_PYTHON_CLIENT_MEM_FRACTION the engine's JAX backend runs with (the
        share of device memory its allocator may take; computed and reported on CPU too).
      generation_config: sampling defaults for requests that leave them out (SamplingParams
        names: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens), from the
        model's generation config (``--generation-config``); empty for none.
      lora_shapes: with --enable-lora, what an adapter must fit (the API process checks an
        adapter before it registers one); else None.
      num_gpu_blocks: pages in the KV pool, the null page included (vLLM's name).
    """

    model_name: str
    config: ResolvedConfig
    tokenizer_dir: str
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    vocab_size: int = 0
    allocator_fraction: float = 0.0
    generation_config: dict = msgspec.field(default_factory=dict)
    lora_shapes: LoRAShapes | None = None
    num_gpu_blocks: int = 0


class Outputs(msgspec.Struct, tag="outputs"):
    """A step's outputs, the scheduler's stats, and ``timestamp``: the engine process's
    ``time.monotonic()`` when the step's tokens were known (the end of the outputs' phases,
    measured against their ``queued_ts`` / ``scheduled_ts``; 0 with no outputs)."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None
    timestamp: float = 0.0


class Error(msgspec.Struct, tag="error"):
    request_ids: list[str]
    message: str
    kind: str = "internal"  # "invalid_request" | "internal"
    fatal: bool = False


Message = AddRequest | AbortRequests | Shutdown | Ready | Outputs | Error

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """One message -> one msgpack frame. Raises ValueError for a non-message."""
    if not isinstance(msg, Message):
        raise ValueError(f"not a pipe message: {type(msg).__name__}")
    try:
        return _encoder.encode(msg)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"cannot encode {type(msg).__name__}: {e}") from e


def decode(data: bytes) -> Message:
    """One msgpack frame -> the message. Raises ValueError if malformed (msgspec's
    DecodeError and ValidationError are ValueErrors; so is a failed SamplingParams check)."""
    return _decoder.decode(data)
