"""EngineConfig's CLI flags, generated from the dataclass (vLLM's ``EngineArgs.add_cli_args`` /
``from_cli_args``, ``vllm/engine/arg_utils.py``).

``python -m jaxserve.serve`` and ``scripts/offline_batch.py`` both call ``add_cli_args``, so every
EngineConfig field is a flag of both, with the field's name, default and help text; each adds its
own flags (host and port; input and output) next to them. Imports no JAX, so a usage error is
reported at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable

from jaxserve.config import EngineConfig


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every optional flag's default (a required flag has none to show)."""

    def _get_help_string(self, action):
        return action.help if action.required else super()._get_help_string(action)


def bounded(kind: type, ok: Callable[[float], bool], text: str) -> Callable[[str], float]:
    """An argparse type: ``kind`` (int or float) parsed from the text and checked with ``ok``;
    ``text`` says what a valid value is ("positive"). argparse names the flag in the error."""
    noun = "an integer" if kind is int else "a number"

    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {s!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must be {text}, got {s}")
        return v

    return parse


def _parser(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type from ``parse``, whose ValueError message argparse shows with the flag
    (it replaces a plain ValueError's with "invalid value")."""

    def wrapped(s: str):
        try:
            return parse(s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return wrapped


def _value_type(hint):
    """``X`` for ``X | None``: None is only ever a default, never typed on the command line."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = (a for a in typing.get_args(hint) if a is not type(None))
    return hint


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds one flag per EngineConfig field (``max_num_seqs`` -> ``--max-num-seqs``), in a group
    of their own; returns ``parser``."""
    group = parser.add_argument_group("engine", "EngineConfig fields (jaxserve/config.py)")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        kind = _value_type(hints[f.name])
        kwargs = {"default": f.default, "help": f.metadata["help"]}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = typing.get_args(kind)
        elif "parse" in f.metadata:
            kwargs["type"] = _parser(f.metadata["parse"])
        elif "valid" in f.metadata:
            kwargs["type"] = bounded(kind, *f.metadata["valid"])
        else:
            kwargs["type"] = kind
        group.add_argument("--" + f.name.replace("_", "-"), **kwargs)
    return parser


def from_cli_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed flags (``args`` may hold other flags too)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
