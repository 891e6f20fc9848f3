"""SpeculativeConfig: ``--speculative-config`` / ``LLM(speculative_config=...)``, vLLM V1's
names and defaults (``vllm/config/speculative.py``), validated in one place."""

import ast
import dataclasses
import json
from dataclasses import dataclass

# Methods vLLM V1 has that this engine does not build yet: refused by name, not accepted.
NOT_BUILT = ("medusa", "mtp", "mlp_speculator", "suffix")
METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# Methods that draft with a model of their own: "model" is its path.
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 16
# vLLM's other user fields that describe what this engine does at some values: those values
# (compared by identity: JSON's null, true, false) are accepted and change nothing, any other is
# refused, naming what the engine does.
AS_BUILT = {
    "enforce_eager": ((None, False), "the drafter's programs are compiled ahead of time"),
    "tensor_parallel_size": ((None,), "as in vLLM: the drafter's is "
                                      "draft_tensor_parallel_size"),
    "quantization": ((None,), "the drafter's weights load as its checkpoint gives them"),
    "revision": ((None,), "the draft model is read from model's path as it is"),
    "code_revision": ((None,), "no model code is fetched"),
    "draft_load_config": ((None,), "the draft model loads in the format its path holds"),
    "disable_padded_drafter_batch": ((False,), "the drafters' programs run padded batches of "
                                               "fixed shapes"),
    "parallel_drafting": ((False,), "drafts are drawn one after another"),
}
# vLLM's settings of its "suffix" method, which it reads for no other method: accepted with a
# value of the type, and ignored, as there.
SUFFIX_FIELDS = {"suffix_decoding_max_tree_depth": (int,),
                 "suffix_decoding_max_cached_requests": (int,),
                 "suffix_decoding_max_spec_factor": (int, float),
                 "suffix_decoding_min_token_prob": (int, float)}
# Integer fields: (name, least, most or None); null (None) is "unset" for all but the first.
INT_FIELDS = (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
              ("prompt_lookup_max", 1, None), ("prompt_lookup_min", 1, None),
              ("disable_by_batch_size", 1, None), ("draft_tensor_parallel_size", 1, None),
              ("max_model_len", 1, None))


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
        verifying drafts costs as much as it saves. None (JSON null, vLLM's default): never.
      draft_tensor_parallel_size: vLLM's devices of the drafter, 1 or the target's
        ``--tensor-parallel-size`` (``check_engine``); None: unset. The n-gram lookup runs in
        the target's step, and a draft model or EAGLE head needs a target on one device.
      max_model_len: vLLM's longest sequence the drafter drafts for, the target's
        ``--max-model-len`` (``check_engine``); None: unset.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int | None = 16
    draft_tensor_parallel_size: int | None = None
    max_model_len: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        """The config of a ``--speculative-config`` JSON object.

        Raises:
          ValueError: not an object, an unknown field, an unknown or not-yet-built method, a
            value out of range, or a vLLM field at a value this engine does not build
            (AS_BUILT, speculative_token_tree other than a chain of num_speculative_tokens);
            the message names the field the object gives.
        """
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {d!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        known = names | set(AS_BUILT) | set(SUFFIX_FIELDS) | {"speculative_token_tree"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r} (fields: {', '.join(sorted(known))})")
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
        for name, low, high in INT_FIELDS:
            v = d.get(name)
            if v is None and name != "num_speculative_tokens":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < low or (high and v > high):
                bound = f"an integer in [{low}, {high}]" if high else f"an integer >= {low}"
                raise ValueError(f"{name} must be {bound}, got {v!r}")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        d["prompt_lookup_min"] = hi if lo is None else lo
        d["prompt_lookup_max"] = lo if hi is None else hi
        if d["prompt_lookup_min"] > d["prompt_lookup_max"]:
            raise ValueError(f"prompt_lookup_min {d['prompt_lookup_min']} exceeds "
                             f"prompt_lookup_max {d['prompt_lookup_max']}")
        for name, (accepted, built) in AS_BUILT.items():
            v = d.pop(name, accepted[0])
            if not any(v is a for a in accepted):
                values = " or ".join(json.dumps(a) for a in accepted)
                raise ValueError(f"{name} must be {values} ({built}), got {_json(v)}")
        for name, types in SUFFIX_FIELDS.items():
            v = d.pop(name, 0)
            if not isinstance(v, types) or isinstance(v, bool):
                kind = "an integer" if types == (int,) else "a number"
                raise ValueError(f"{name} must be {kind}, got {_json(v)}")
        _check_token_tree(d.pop("speculative_token_tree", None), d["num_speculative_tokens"])
        return cls(**d)

    def check_engine(self, tensor_parallel_size: int, max_model_len: int | None) -> None:
        """The fields that must agree with the engine's flags.

        Args:
          tensor_parallel_size: ``--tensor-parallel-size``.
          max_model_len: ``--max-model-len`` in tokens; None: not known yet (not checked).

        Raises:
          ValueError: draft_tensor_parallel_size neither 1 nor ``tensor_parallel_size`` (vLLM's
            rule), max_model_len other than ``max_model_len``; the message names the field.
        """
        tp = self.draft_tensor_parallel_size
        if tp not in (None, 1, tensor_parallel_size):
            raise ValueError(f"draft_tensor_parallel_size must be 1 or --tensor-parallel-size "
                             f"({tensor_parallel_size}), got {tp}")
        if None not in (self.max_model_len, max_model_len) and self.max_model_len != max_model_len:
            raise ValueError(f"max_model_len must be --max-model-len ({max_model_len}) or null "
                             f"(drafts are made for sequences up to --max-model-len tokens), "
                             f"got {self.max_model_len}")


def _check_token_tree(tree, k: int) -> None:
    """Raises ValueError naming speculative_token_tree unless ``tree`` is None or vLLM's chain of
    ``k`` drafts (``"[(0,), (0, 0), ...]"``, in any order): drafts are drawn as a chain, draft
    trees are not built."""
    if tree is None:
        return
    chain = [(0,) * (i + 1) for i in range(k)]
    try:
        choices = sorted(ast.literal_eval(tree)) if isinstance(tree, str) else None
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        choices = None
    if choices != chain:
        raise ValueError(f"speculative_token_tree must be null or {str(chain)!r} (drafts are "
                         f"drawn as a chain; draft trees are not built), got {_json(tree)}")


def _json(v) -> str:
    """A value as JSON writes it (any other object: its repr), for messages."""
    return json.dumps(v, default=repr)


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
