"""Plain-text corpora (WikiText-2, PTB) read from their canonical files and cleaned of tokenisation artefacts."""

from __future__ import annotations

import re
from pathlib import Path

from fedfuse.data.dataset import DatasetNotFoundError
from fedfuse.data.datasets import resolve_data_dir


def clean_corpus(text: str, kind: str) -> str:
    """Undo the word-level tokenisation artefacts of WikiText (``@-@``, `` , ``) and PTB (``<unk>``)."""
    text = text.replace("<unk>", "")
    if kind == "wikitext2":
        text = text.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
        text = re.sub(r"^ = .* = $", "", text, flags=re.M)  # section headings
    text = re.sub(r" ([,.;:!?)'])", r"\1", text)
    text = re.sub(r"\( ", "(", text)
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r"\n\s*\n+", "\n", text)
    return text.strip() + "\n"


CORPUS_FILES = {"wikitext2": ("wikitext2", "{}.txt"), "ptb": ("ptb", "ptb.{}.txt")}


def corpus_path(name: str, split: str, data_dir: str | Path | None = None) -> Path:
    """The file of split ``split`` of corpus ``name`` (under ``data_dir`` or ``$FEDFUSE_DATA``)."""
    root = resolve_data_dir(data_dir)
    folder, pattern = CORPUS_FILES[name]
    candidates = [root / folder / pattern.format(split)] if root else []
    candidates += [Path("../shared/data") / folder / pattern.format(split)]
    for c in candidates:
        if c.is_file():
            return c
    raise DatasetNotFoundError(f"{name} {split} split not found (looked at {', '.join(map(str, candidates))}); "
                               f"pass --data-dir pointing at a folder holding {folder}/")


def load_corpus(name: str, split: str, data_dir: str | Path | None = None) -> str:
    """The cleaned text of split ``split`` of corpus ``name``."""
    return clean_corpus(corpus_path(name, split, data_dir).read_text(encoding="utf-8"), name)
