"""LEAF datasets (JSON per user): ``femnist`` (writer-partitioned EMNIST) and ``shakespeare`` (speaking roles)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data.dataset import Dataset
from fedfuse.data.datasets.common import UNK, _cached, _candidates, _missing, _natural_key, _source_info
from fedfuse.errors import UserError

# LEAF's ALL_LETTERS (models/utils/language_utils.py); other characters map to the extra id len(LEAF_LETTERS).
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


# ------------------------------------------------------------------------------------------------- LEAF


def _leaf_dirs(name: str, root: Path | None, subdirs: Sequence[str]) -> tuple[Path, list[Path], list[Path]]:
    """The LEAF folder holding ``train/*.json`` and ``test/*.json``, and those files (natural order)."""
    searched: list[Path] = []
    for base in _candidates(root, *subdirs):
        for d in (base / "data", base):
            searched.append(d)
            train = sorted((d / "train").glob("*.json"), key=_natural_key)
            test = sorted((d / "test").glob("*.json"), key=_natural_key)
            if train and test:
                return d, train, test
    raise _missing(name, root, searched, "Need at least one JSON file in each of train/ and test/.")


def _read_leaf(paths: Sequence[Path]) -> list[tuple[str, list[Any], list[Any]]]:
    """(user, x, y) in file order then user order; sample counts from ``len(y)``, not ``num_samples``."""
    out = []
    for p in paths:
        blob = _read_json(p)
        if not isinstance(blob, dict) or not isinstance(blob.get("user_data"), dict):
            raise UserError(f"{p}: not a LEAF file (expected a JSON object with 'user_data')")
        users = blob.get("users") or list(blob["user_data"])
        for u in users:
            data = blob["user_data"][u]
            if len(data["x"]) != len(data["y"]):
                raise UserError(f"{p}: user {u} has {len(data['x'])} inputs but {len(data['y'])} targets")
            out.append((str(u), data["x"], data["y"]))
    return out


def _read_json(path: Path) -> Any:
    """A JSON file's content; a malformed file is a ValueError naming it and the place."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _group_ids(records: Sequence[tuple[str, list[Any], list[Any]]], index: dict[str, int]) -> np.ndarray:
    for u, _, _ in records:
        index.setdefault(u, len(index))
    return np.concatenate([np.full(len(y), index[u], dtype=np.int64) for u, _, y in records] or [np.zeros(0, int)])


FEMNIST_NORMALIZATIONS = ("authors", "none")
FEMNIST_NORMALIZATION_INFO = {
    "authors": "(0.5 - x) / 0.5 (FedMR/FedMut authors' code): background -1, ink +1",
    "none": "none (LEAF values in [0, 1], 1.0 = background)",
}


def femnist_normalize(x: torch.Tensor, mode: str = "authors") -> torch.Tensor:
    """FEMNIST pixel scaling.  LEAF stores values in [0, 1] with 1.0 = background (white paper).

    ``"authors"`` (default): ``(0.5 − x) / 0.5`` as the FedMR/FedMut authors' ``utils/FEMNIST.py`` does, so the
    background maps to −1 and full ink to +1 (zero-centred, ink positive).  ``"none"``: LEAF's values as given.
    """
    if mode == "authors":
        return (0.5 - x) / 0.5
    if mode == "none":
        return x
    raise UserError(f"unknown FEMNIST normalization {mode!r}; choose one of {FEMNIST_NORMALIZATIONS}")


def _load_femnist(root: Path | None, opts: dict[str, Any]) -> Dataset:
    _, train_files, test_files = _leaf_dirs("femnist", root, ["femnist-leaf", "femnist"])

    def build() -> dict[str, np.ndarray]:
        index: dict[str, int] = {}
        arrays: dict[str, np.ndarray] = {}
        for split, files in (("train", train_files), ("test", test_files)):
            records = _read_leaf(files)
            xs = [np.asarray(x, dtype=np.float32).reshape(-1, 784) for _, x, _ in records]
            arrays[f"{split}_x"] = np.concatenate(xs) if xs else np.zeros((0, 784), np.float32)
            arrays[f"{split}_y"] = np.concatenate([np.asarray(y, dtype=np.int64) for _, _, y in records])
            arrays[f"{split}_groups"] = _group_ids(records, index)
        arrays["group_names"] = np.array(list(index), dtype=str)
        return arrays

    arrays, cache_path = _cached("femnist", [*train_files, *test_files], build)
    mode = str(opts.get("normalize", "authors"))
    return Dataset(
        name="femnist",
        task="classification",
        train_x=femnist_normalize(torch.from_numpy(arrays["train_x"].reshape(-1, 1, 28, 28)), mode),
        train_y=torch.from_numpy(arrays["train_y"]),
        test_x=femnist_normalize(torch.from_numpy(arrays["test_x"].reshape(-1, 1, 28, 28)), mode),
        test_y=torch.from_numpy(arrays["test_y"]),
        num_classes=62,
        input_shape=(1, 28, 28),
        class_names=[*"0123456789", *map(chr, range(65, 91)), *map(chr, range(97, 123))],
        train_groups=arrays["train_groups"],
        test_groups=arrays["test_groups"],
        group_names=[str(u) for u in arrays["group_names"]],
        info={
            **_source_info("femnist", [*train_files, *test_files]),
            "cache": str(cache_path),
            "normalization": FEMNIST_NORMALIZATION_INFO[mode],
        },
    )


def _char_ids(texts: Sequence[str], width: int) -> np.ndarray:
    """(N, width) LEAF_LETTERS indices of N strings of ``width`` chars; others map to len(LEAF_LETTERS)."""
    table = np.full(256, len(LEAF_LETTERS), dtype=np.int64)
    table[[ord(c) for c in LEAF_LETTERS]] = np.arange(len(LEAF_LETTERS))
    codes = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
    if len(codes) != len(texts) * width:
        raise UserError(f"shakespeare: every string must have {width} characters")
    ids = np.full(len(codes), len(LEAF_LETTERS), dtype=np.int64)
    ascii_ = codes < 256
    ids[ascii_] = table[codes[ascii_]]
    return ids.reshape(len(texts), width)


def _load_shakespeare(root: Path | None, opts: dict[str, Any]) -> Dataset:
    data_dir, train_files, test_files = _leaf_dirs("shakespeare", root, ["shakespeare-leaf", "shakespeare"])
    index: dict[str, int] = {}
    split_arrays: dict[str, tuple[torch.Tensor, torch.Tensor, np.ndarray]] = {}
    width = None
    for split, files in (("train", train_files), ("test", test_files)):
        records = _read_leaf(files)
        xs = [s for _, x, _ in records for s in x]
        ys = [str(s) for _, _, y in records for s in y]
        width = width or (len(xs[0]) if xs else 80)
        split_arrays[split] = (
            torch.from_numpy(_char_ids(xs, width)),
            torch.from_numpy(_char_ids(ys, 1).reshape(-1)),
            _group_ids(records, index),
        )
    users = list(index)
    domains: dict[str, np.ndarray] = {}
    domain_names = None
    plays_file = data_dir / "raw_data" / "users_and_plays.json"
    files = [*train_files, *test_files]
    if plays_file.is_file():
        files.append(plays_file)
        plays = _read_json(plays_file)
        user_play = [str(plays.get(u, "UNKNOWN")) for u in users]
        domain_names = sorted(set(user_play))
        play_id = np.array([domain_names.index(p) for p in user_play], dtype=np.int64)
        domains = {s: play_id[split_arrays[s][2]] for s in ("train", "test")}
    vocab = [*LEAF_LETTERS, UNK]
    return Dataset(
        name="shakespeare",
        task="classification",
        train_x=split_arrays["train"][0],
        train_y=split_arrays["train"][1],
        test_x=split_arrays["test"][0],
        test_y=split_arrays["test"][1],
        num_classes=len(vocab),
        input_shape=(int(width or 80),),
        class_names=vocab,
        train_groups=split_arrays["train"][2],
        test_groups=split_arrays["test"][2],
        group_names=users,
        train_domains=domains.get("train"),
        test_domains=domains.get("test"),
        domain_names=domain_names,
        vocab=vocab,
        info=_source_info("shakespeare", files),
    )
