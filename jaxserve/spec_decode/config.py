"""SpeculativeConfig: ``--speculative-config`` / ``LLM(speculative_config=...)``, vLLM V1's
names and defaults (``vllm/config/speculative.py``), validated in one place."""

import dataclasses
import json
from dataclasses import dataclass

# Methods vLLM V1 has that this engine does not build yet: refused by name, not accepted.
NOT_BUILT = ("medusa", "mtp")
METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# Methods that draft with a model of their own: "model" is its path.
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates.

    Attributes:
      method: "ngram" (prompt lookup over the sequence's own tokens), "draft_model" (a
        smaller model with the target's vocabulary, ``draft_model.py``), "eagle" or "eagle3"
        (a head over the target's hidden states, ``eagle.py``).
      model: the draft model's or the EAGLE head's path or name (``resolve_model``; an EAGLE
        head's "dummy": a random one, ``eagle.DUMMY``), the methods of MODEL_METHODS only.
      num_speculative_tokens: k, drafts proposed and verified per sequence and step, 1 to
        MAX_SPECULATIVE_TOKENS.
      prompt_lookup_max, prompt_lookup_min: the longest and shortest suffix (tokens) the n-gram
        proposer matches; vLLM's defaults: 5 and 5 when both are unset, else the one given.
      disable_by_batch_size: no drafts in a step while more than this many requests are
        unfinished (running and waiting): a batch that large is compute-bound on a GPU, where
        verifying drafts costs as much as it saves.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int = 16

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        """The config of a ``--speculative-config`` JSON object.

        Raises:
          ValueError: not an object, an unknown field, an unknown or not-yet-built method, or a
            value out of range; the message names the field.
        """
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {d!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r} (fields: {', '.join(sorted(names))})")
        d = _with_method(d)
        method = d.get("method")
        if method in NOT_BUILT:
            raise ValueError(f"method {method!r} is not built in this engine yet; "
                             f"use one of {', '.join(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if (method in MODEL_METHODS) != isinstance(d.get("model"), str):
            raise ValueError(f"model (the drafter's path) is required by methods "
                             f"{', '.join(MODEL_METHODS)} and by them alone")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        d["prompt_lookup_min"] = hi if lo is None else lo
        d["prompt_lookup_max"] = lo if hi is None else hi
        for name, low, high in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
                                ("prompt_lookup_min", 1, None), ("prompt_lookup_max", 1, None),
                                ("disable_by_batch_size", 1, None)):
            if name not in d and name != "num_speculative_tokens":
                continue
            v = d.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low or (high and v > high):
                bound = f"an integer in [{low}, {high}]" if high else f"an integer >= {low}"
                raise ValueError(f"{name} must be {bound}, got {v!r}")
        if d["prompt_lookup_min"] > d["prompt_lookup_max"]:
            raise ValueError(f"prompt_lookup_min {d['prompt_lookup_min']} exceeds "
                             f"prompt_lookup_max {d['prompt_lookup_max']}")
        return cls(**d)


def _with_method(d: dict) -> dict:
    """A copy of ``d`` with ``method`` as vLLM infers it: "[ngram]" is "ngram", and so is
    ``"model": "ngram"``; without a method, a model path whose name holds "eagle3" (or else
    "eagle") is an EAGLE head of that kind, any other a draft model."""
    d = dict(d)
    model = d.get("model")
    if d.get("method") == "[ngram]" or (d.get("method") in (None, "ngram")
                                        and model in ("ngram", "[ngram]")):
        d["method"] = "ngram"
        d.pop("model", None)
    elif d.get("method") is None and isinstance(model, str):
        name = model.lower()
        d["method"] = "eagle3" if "eagle3" in name else "eagle" if "eagle" in name else "draft_model"
    return d


def parse_speculative_config(text: str) -> dict:
    """``--speculative-config``'s argparse type: the JSON text as a dict, checked by
    ``SpeculativeConfig.from_dict`` (argparse names the flag in the error).

    Raises:
      ValueError: invalid JSON or an invalid config.
    """
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    SpeculativeConfig.from_dict(d)
    return d
