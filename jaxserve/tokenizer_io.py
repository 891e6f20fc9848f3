"""Saving and loading tokenizer folders, shared by the engine and the API process (no JAX here).

``save_tokenizer`` writes a folder that transformers 4.x and 5.x both load; ``load_tokenizer``
loads one without Hub access, and without importing torch where it can (see its docstring).
"""

import json
import pathlib


def load_tokenizer(folder: pathlib.Path):
    """The tokenizer saved in ``folder``, with no Hub access: ``AutoTokenizer.from_pretrained``,
    except for a folder whose tokenizer_config.json names ``PreTrainedTokenizerFast`` (ours, from
    ``save_tokenizer``), which that class loads directly. AutoTokenizer's model-config machinery
    imports torch where it is installed (seconds of start-up, on a GPU machine more); the
    generic class does not, and behaves the same for such a folder."""
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
