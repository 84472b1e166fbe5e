"""Language-modelling text: ``ptb``, ``wikitext2`` (word level) and ``tiny-shakespeare`` (char or word level)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data.dataset import Dataset
from fedfuse.data.datasets.common import EOS, UNK, _candidates, _missing, _source_info

# --------------------------------------------------------------------------------------- language models


def _lines(text: str) -> list[str]:
    """Lines as ``for line in file`` yields them (only ``\\n`` breaks lines)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _word_tokens(text: str) -> list[str]:
    """Whitespace tokens with ``<eos>`` closing every line (empty lines included)."""
    out: list[str] = []
    for line in _lines(text):
        out.extend(line.split())
        out.append(EOS)
    return out


def _build_vocab(tokens: Sequence[str]) -> list[str]:
    """Words by decreasing frequency, ties broken alphabetically."""
    counts = Counter(tokens)
    return sorted(counts, key=lambda w: (-counts[w], w))


def _encode(tokens: Sequence[str], vocab: list[str], stoi: dict[str, int]) -> np.ndarray:
    unk = stoi.get(UNK)
    if unk is None and any(t not in stoi for t in tokens):
        vocab.append(UNK)
        stoi[UNK] = unk = len(vocab) - 1
    return np.fromiter((stoi.get(t, unk) for t in tokens), dtype=np.int64, count=len(tokens))  # type: ignore[arg-type]


def _windows(ids: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows: x = ids[i*L:(i+1)*L], y = x shifted by one token."""
    n = max(0, (len(ids) - 1) // seq_len)
    x = ids[: n * seq_len].reshape(n, seq_len)
    y = ids[1 : n * seq_len + 1].reshape(n, seq_len)
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def _lm_dataset(
    name: str, streams: dict[str, np.ndarray], vocab: list[str], seq_len: int, info: dict[str, Any]
) -> Dataset:
    tr, va, te = (_windows(streams[s], seq_len) for s in ("train", "valid", "test"))
    return Dataset(
        name=name,
        task="lm",
        train_x=tr[0],
        train_y=tr[1],
        test_x=te[0],
        test_y=te[1],
        val_x=va[0],
        val_y=va[1],
        num_classes=len(vocab),
        input_shape=(seq_len,),
        vocab=vocab,
        info={**info, "tokens": {s: len(v) for s, v in streams.items()}, "vocab_size": len(vocab)},
    )


def _find_splits(searched: Sequence[Path], patterns: Sequence[str]) -> list[Path] | None:
    """The first ``[train, valid, test]`` files matching one of ``patterns`` in one of ``searched``."""
    for folder in searched:
        for pat in patterns:
            paths = [folder / pat.format(s) for s in ("train", "valid", "test")]
            if all(p.is_file() for p in paths):
                return paths
    return None


def _word_lm(name: str, root: Path | None, subdirs: Sequence[str], patterns: Sequence[str], seq_len: int) -> Dataset:
    searched = _candidates(root, *subdirs)
    paths = _find_splits(searched, patterns)
    if paths is None:
        raise _missing(name, root, searched)
    tokens = {s: _word_tokens(p.read_text(encoding="utf-8")) for s, p in zip(("train", "valid", "test"), paths)}
    vocab = _build_vocab(tokens["train"])
    stoi = {w: i for i, w in enumerate(vocab)}
    streams = {s: _encode(t, vocab, stoi) for s, t in tokens.items()}
    info = {**_source_info(name, paths), "vocab_from": "train split, by frequency then word"}
    return _lm_dataset(name, streams, vocab, seq_len, info)


def _load_ptb(root: Path | None, opts: dict[str, Any]) -> Dataset:
    return _word_lm("ptb", root, ["ptb", "penn-treebank", "PTB"], ["ptb.{}.txt"], int(opts["seq_len"]))


def _load_wikitext2(root: Path | None, opts: dict[str, Any]) -> Dataset:
    subdirs = ["wikitext2", "wikitext-2", "wikitext-2-v1", "wikitext-2/wikitext-2"]
    return _word_lm("wikitext2", root, subdirs, ["{}.txt", "wiki.{}.tokens"], int(opts["seq_len"]))


def _load_tiny_shakespeare(root: Path | None, opts: dict[str, Any]) -> Dataset:
    """Contiguous 90/5/5 train/val/test split of the char (or token) stream; vocab from the whole text."""
    searched = _candidates(root, "tiny-shakespeare", "tinyshakespeare", "tiny_shakespeare")
    path = next((d / "input.txt" for d in searched if (d / "input.txt").is_file()), None)
    if path is None:
        raise _missing("tiny-shakespeare", root, searched)
    text = path.read_text(encoding="utf-8")
    level = str(opts["level"])
    seq: Sequence[str] = text if level == "char" else _word_tokens(text)
    vocab = sorted(set(text)) if level == "char" else _build_vocab(seq)
    stoi = {w: i for i, w in enumerate(vocab)}
    ids = np.fromiter((stoi[t] for t in seq), dtype=np.int64, count=len(seq))
    a, b = int(0.9 * len(ids)), int(0.95 * len(ids))
    streams = {"train": ids[:a], "valid": ids[a:b], "test": ids[b:]}
    info = {
        **_source_info("tiny-shakespeare", [path]),
        "level": level,
        "split": "contiguous 90/5/5 of the stream",
        "vocab_from": "whole text" + ("" if level == "char" else ", by frequency then word"),
    }
    return _lm_dataset("tiny-shakespeare", streams, vocab, int(opts["seq_len"]), info)
