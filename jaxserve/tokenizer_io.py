"""Saving and loading tokenizer folders, shared by the engine and the API process (no JAX here).

``save_tokenizer`` writes a folder that transformers 4.x and 5.x both load; ``load_tokenizer``
loads one without Hub access, and without importing torch where it can (see its docstring);
``TokenizerVocab.read`` reads what llguidance needs of one without importing transformers.
"""

import copy
import json
import pathlib
from dataclasses import dataclass

# What ``save_tokenizer`` adds to a folder beside transformers' files: the facts a process that
# does not import transformers needs of the tokenizer (``TokenizerVocab.read``).
FACTS_FILE = "jaxserve_tokenizer.json"


@dataclass(frozen=True)
class TokenizerVocab:
    """A fast tokenizer as llguidance takes it (``structured_output.grammar.build_ll_tokenizer``).

    Attributes:
      json: the Rust tokenizer serialised (tokenizer.json's format; padding and truncation,
        which llguidance does not use, off or as saved).
      size: ``len(tokenizer)``: ids it defines, added tokens included.
      eos_token_id: the tokenizer's own EOS id; None without one.
    """

    json: str
    size: int
    eos_token_id: int | None

    @classmethod
    def of(cls, tokenizer) -> "TokenizerVocab":
        """Of a transformers fast tokenizer (as ``llguidance.hf.from_tokenizer`` reads one)."""
        backend = copy.copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return cls(backend.to_str(), len(tokenizer), tokenizer.eos_token_id)

    @classmethod
    def read(cls, folder: str | pathlib.Path) -> "TokenizerVocab":
        """Of a ``save_tokenizer`` folder, without importing transformers."""
        folder = pathlib.Path(folder)
        facts = json.loads((folder / FACTS_FILE).read_text())
        return cls((folder / "tokenizer.json").read_text(), facts["size"], facts["eos_token_id"])


# The files transformers builds a tokenizer from (fast, sentencepiece, BPE vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(folder: pathlib.Path):
    """The tokenizer saved in ``folder``, with no Hub access: ``AutoTokenizer.from_pretrained``,
    except for a folder whose tokenizer_config.json names ``PreTrainedTokenizerFast`` (ours, from
    ``save_tokenizer``), which that class loads directly. AutoTokenizer's model-config machinery
    imports torch where it is installed (seconds of start-up, on a GPU machine more); the
    generic class does not, and behaves the same for such a folder.

    Raises:
      ValueError: a folder with no tokenizer file (transformers' own message lists its
        converters instead).
    """
    if not any((pathlib.Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    cfg_path = pathlib.Path(folder) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if cfg.get("tokenizer_class") == "PreTrainedTokenizerFast":
        from transformers import PreTrainedTokenizerFast as cls
    else:
        from transformers import AutoTokenizer as cls
    return cls.from_pretrained(str(folder), local_files_only=True)


def import_tokenizer_code() -> None:
    """Import what ``load_tokenizer`` needs for the folders ``save_tokenizer`` writes (the
    transformers package is imported lazily, module by module), ahead of the first load."""
    from transformers import PreTrainedTokenizerFast  # noqa: F401


def save_tokenizer(tokenizer, folder: str | pathlib.Path) -> None:
    """``tokenizer.save_pretrained(folder)``, made loadable by transformers 4.x and 5.x alike:
    ``tokenizer_class`` is written as ``PreTrainedTokenizerFast`` (5.x writes its own
    ``TokenizersBackend``) and the chat template also goes inline into tokenizer_config.json
    (5.x writes only ``chat_template.jinja``)."""
    folder = pathlib.Path(folder)
    tokenizer.save_pretrained(str(folder))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("tokenizer_class") in ("TokenizersBackend", None):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if getattr(tokenizer, "chat_template", None) and "chat_template" not in cfg:
        cfg["chat_template"] = tokenizer.chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (folder / FACTS_FILE).write_text(json.dumps({"size": len(tokenizer),
                                                 "eos_token_id": tokenizer.eos_token_id}) + "\n")
