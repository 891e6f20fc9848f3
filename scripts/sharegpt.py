"""The repository's ShareGPT sample (data/sharegpt_1k_first_turns.json; data/README.md says where
it comes from), or any file in the same ShareGPT format, for benches and tests.

Format: a JSON list of ``{"id", "conversations": [{"from": "human"|"gpt", "value": str}, ...]}``.
"""

import json
import pathlib

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "data" / "sharegpt_1k_first_turns.json"


def first_turns(path: str | pathlib.Path = SAMPLE) -> list[str]:
    """The first human turn of each conversation, in file order, as written ('' for a
    conversation that does not open with a human turn).

    Raises:
      FileNotFoundError: no such file; json.JSONDecodeError: not JSON.
    """
    out = []
    for conv in json.loads(pathlib.Path(path).read_text()):
        turns = conv.get("conversations") or []
        out.append(turns[0]["value"] if turns and turns[0].get("from") == "human" else "")
    return out


def prompt_answer_pairs(path: str | pathlib.Path = SAMPLE) -> list[tuple[str, str]]:
    """(first human turn, first gpt answer) of each conversation of a ShareGPT-format file
    that opens with that exchange."""
    pairs = []
    for conv in json.loads(pathlib.Path(path).read_text()):
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs
