"""Structured-output specs whose depth is the attack: chains of Lark rules and of JSON-schema
``$ref`` definitions, as deep as the spec-size limit (MAX_STRUCTURED_OUTPUT_CHARS) lets them be.
llguidance compiles them by native recursion: on a thread's default 8 MiB stack a chain of
~3,000 rules, or ~1,500 definitions, overflowed it (a segfault of the whole process). And one whose breadth is: a grammar that
compiles and fails only while it generates."""

from __future__ import annotations

import json

import numpy as np

from jaxserve.sampling_params import MAX_STRUCTURED_OUTPUT_CHARS


def _key(i: int) -> str:
    return np.base_repr(i, 36).lower()


def _name(i: int) -> str:
    return "a" + _key(i)  # a Lark rule name starts with a letter


def rule_chain(n: int, terminal: str = "") -> str:
    """``start: a0``, ``a0: a1 <terminal>``, ..., ``a<n>: "x"``: a Lark chain n rules deep."""
    return (f"start: {_name(0)}\n" + "".join(f"{_name(i)}: {_name(i + 1)}{terminal}\n"
                                             for i in range(n)) + f'{_name(n)}: "x"\n')


def wide_choice_grammar(alternatives: int = 2100) -> str:
    """A valid Lark grammar whose second token meets a limit of llguidance's (at most 2,000
    Earley items in a row): the first mask is fine, the one after "[" fails."""
    return 'start: "[" x "]"\nx: ' + " | ".join(f'"v{i}"' for i in range(alternatives))


def ref_chain(n: int, wrap=lambda ref: {"items": ref}) -> dict:
    """A schema whose $defs chain n definitions deep, each ``wrap``ping a $ref to the next."""
    defs = {_key(i): wrap({"$ref": f"#/$defs/{_key(i + 1)}"}) for i in range(n)}
    defs[_key(n)] = {"type": "integer"}
    return {"$ref": "#/$defs/0", "$defs": defs}


def at_limit(make) -> str | dict:
    """``make(n)`` for the largest n whose spec fits MAX_STRUCTURED_OUTPUT_CHARS."""
    def size(n):
        spec = make(n)
        return len(spec if isinstance(spec, str) else json.dumps(spec, separators=(",", ":")))

    lo, hi = 1, 2
    while size(hi) <= MAX_STRUCTURED_OUTPUT_CHARS:
        hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= MAX_STRUCTURED_OUTPUT_CHARS else (lo, mid)
    return make(lo)


def lark_bombs() -> list[str]:
    """Valid Lark grammars at the size limit: bare and sequenced rule chains, and a $ref chain
    embedded with ``%json``."""
    return [rule_chain(3000, ' "0"'), at_limit(rule_chain), at_limit(lambda n: rule_chain(n, ' "x"')),
            at_limit(lambda n: "start: %json " + json.dumps(ref_chain(n), separators=(",", ":")))]


def schema_bombs() -> list[dict]:
    """$ref chains: the reported one (1,500 definitions) and, at the size limit, chains through
    items, properties, anyOf and bare $refs."""
    return [ref_chain(1500), at_limit(ref_chain),
            at_limit(lambda n: ref_chain(n, lambda r: {"properties": {"a": r}, "required": ["a"]})),
            at_limit(lambda n: ref_chain(n, lambda r: {"anyOf": [r, {"type": "string"}]})),
            at_limit(lambda n: ref_chain(n, lambda r: r))]
