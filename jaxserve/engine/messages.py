"""The msgpack schema of the API process <-> engine process pipe (docs/design.md section 1).

Every frame is one msgpack map with a ``type`` field, sent with ``Connection.send_bytes``.
Token ids cross the pipe, text never does.

API -> engine:
  ``add``       {request_id, prompt_token_ids, sampling_params (SamplingParams fields), arrival_time}
  ``abort``     {request_ids}
  ``shutdown``  {}

Engine -> API:
  ``ready``     {model_name, max_model_len, tokenizer_dir, eos_token_ids, vocab_size, config,
                 allocator_fraction}
  ``outputs``   {outputs: [EngineCoreOutput fields], stats: SchedulerStats fields | None}
  ``error``     {request_ids, message, kind, fatal}; ``kind`` is "invalid_request" (the request
                was rejected, e.g. its prompt does not fit) or "internal"; ``fatal`` means the
                engine is exiting (e.g. the model could not be loaded) and ``request_ids`` is empty.
  ``log``       {message}: a progress line (start-up phases) for the API process to print.

``encode(msg)`` turns one of the dataclasses below into bytes; ``decode(data)`` turns bytes back
into the same dataclass. Both raise ``ValueError`` on an unknown type or a malformed frame.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgpack

from jaxserve.engine import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from jaxserve.sampling_params import SamplingParams


@dataclass
class AddRequest:
    request: EngineCoreRequest


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class Ready:
    """The engine finished start-up.

    Attributes:
      model_name: the model's own name (served name default).
      max_model_len: longest sequence, prompt + output, tokens.
      tokenizer_dir: a folder with the tokenizer saved by ``save_pretrained`` (the API process
        loads it with ``AutoTokenizer.from_pretrained`` and may delete it afterwards).
      eos_token_ids: ids that end generation by default.
      vocab_size: the model's vocabulary size (ids at or above it are invalid).
      config: the effective engine configuration (EngineConfig fields, for /v1/models, logs).
      allocator_fraction: XLA_PYTHON_CLIENT_MEM_FRACTION the engine's JAX backend runs with (the
        share of device memory its allocator may take; computed and reported on CPU too).
    """

    model_name: str
    max_model_len: int
    tokenizer_dir: str
    eos_token_ids: list[int] = field(default_factory=list)
    vocab_size: int = 0
    config: dict = field(default_factory=dict)
    allocator_fraction: float = 0.0


@dataclass
class Outputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None


@dataclass
class Error:
    request_ids: list[str]
    message: str
    kind: str = "internal"  # "invalid_request" | "internal"
    fatal: bool = False


@dataclass
class Log:
    message: str


Message = AddRequest | AbortRequests | Shutdown | Ready | Outputs | Error | Log


def _sp_to_dict(sp: SamplingParams) -> dict:
    return dataclasses.asdict(sp)


def _sp_from_dict(d: dict) -> SamplingParams:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in d.items() if k in names})


def _to_map(msg: Message) -> dict:
    if isinstance(msg, AddRequest):
        r = msg.request
        return {"type": "add", "request_id": r.request_id,
                "prompt_token_ids": list(r.prompt_token_ids),
                "sampling_params": _sp_to_dict(r.sampling_params),
                "arrival_time": r.arrival_time}
    if isinstance(msg, AbortRequests):
        return {"type": "abort", "request_ids": list(msg.request_ids)}
    if isinstance(msg, Shutdown):
        return {"type": "shutdown"}
    if isinstance(msg, Ready):
        return {"type": "ready", **dataclasses.asdict(msg)}
    if isinstance(msg, Outputs):
        return {"type": "outputs",
                "outputs": [[o.request_id, list(o.new_token_ids), o.finish_reason, o.stop_reason,
                             o.num_prompt_tokens, o.num_cached_tokens] for o in msg.outputs],
                "stats": None if msg.stats is None else dataclasses.asdict(msg.stats)}
    if isinstance(msg, Error):
        return {"type": "error", **dataclasses.asdict(msg)}
    if isinstance(msg, Log):
        return {"type": "log", "message": msg.message}
    raise ValueError(f"not a pipe message: {type(msg).__name__}")


def encode(msg: Message) -> bytes:
    """One message -> one msgpack frame (bytes). Raises ValueError for a non-message."""
    return msgpack.packb(_to_map(msg), use_bin_type=True)


def decode(data: bytes) -> Message:
    """One msgpack frame -> the message dataclass. Raises ValueError if malformed."""
    try:
        m = msgpack.unpackb(data, raw=False)
        kind = m["type"]
        if kind == "add":
            return AddRequest(EngineCoreRequest(
                request_id=m["request_id"], prompt_token_ids=list(m["prompt_token_ids"]),
                sampling_params=_sp_from_dict(m["sampling_params"]),
                arrival_time=m.get("arrival_time", 0.0)))
        if kind == "abort":
            return AbortRequests(list(m["request_ids"]))
        if kind == "shutdown":
            return Shutdown()
        if kind == "ready":
            m.pop("type")
            return Ready(**m)
        if kind == "outputs":
            outs = [EngineCoreOutput(request_id=o[0], new_token_ids=o[1], finish_reason=o[2],
                                     stop_reason=o[3], num_prompt_tokens=o[4],
                                     num_cached_tokens=o[5]) for o in m["outputs"]]
            stats = m.get("stats")
            return Outputs(outs, None if stats is None else SchedulerStats(**stats))
        if kind == "error":
            m.pop("type")
            return Error(**m)
        if kind == "log":
            return Log(m["message"])
    except ValueError:
        raise
    except Exception as e:  # msgpack errors, KeyError, TypeError from a malformed map
        raise ValueError(f"malformed pipe message: {type(e).__name__}: {e}") from e
    raise ValueError(f"unknown pipe message type {kind!r}")
