"""Instruction data in the common JSON / JSONL formats, one client per task or per role.

Records are dicts; the prompt and the response are read from the usual field names:

* Alpaca (``instruction``, optional ``input``, ``output``) — formatted with the alpaca-lora template;
* Flan / T5 style (``inputs``, ``targets``), ``prompt``/``completion``, ``question``/``answer``,
  RoleBench-like ``question`` with ``generated`` (first answer) — the prompt is used as is.

Layouts (``instruction_federation(path, ...)``):

* a folder of task folders (``flan/<task>/{train,test}.json[l]`` or any ``*.json[l]`` inside): one client
  per task folder; a ``train`` / ``test`` file pair is used as the split, otherwise the records are split;
* a folder of files (``roles/<role>.jsonl``): one client per file;
* one file: one client per value of a record field (``group_field``, default ``task`` then ``role``).

Per client, up to ``train`` training and ``test`` test records are drawn with ``seed`` (the papers: 300 and
200 per Flan task), and ``val_fraction`` of the training records are held out for validation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data.lm_clients import encode_pairs, make_federation
from fedfuse.errors import UserError
from fedfuse.types import Federation

ALPACA_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n"
                     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
PROMPT_KEYS = ("inputs", "prompt", "question", "query", "source")
ANSWER_KEYS = ("output", "targets", "completion", "answer", "response", "target", "generated")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``.json`` file (a list, or a dict holding one list) or a ``.jsonl`` file."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise UserError(f"{path}: expected a list of records (or a dict holding exactly one list)")
        data = lists[0]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a list of records")
    return [r for r in data if isinstance(r, dict)]


def to_pair(rec: dict[str, Any]) -> tuple[str, str] | None:
    """(prompt text, response text) of a record, or None when it has no recognisable fields."""
    answer = next((rec[k] for k in ANSWER_KEYS if k in rec and rec[k] not in (None, "", [])), None)
    if isinstance(answer, list):
        answer = answer[0]
    if answer is None:
        return None
    if "instruction" in rec:
        inp = str(rec.get("input") or "").strip()
        tpl = ALPACA_WITH_INPUT if inp else ALPACA_NO_INPUT
        return tpl.format(instruction=str(rec["instruction"]).strip(), input=inp), str(answer)
    prompt = next((rec[k] for k in PROMPT_KEYS if k in rec), None)
    if prompt is None:
        return None
    return str(prompt), str(answer)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".jsonl"))


def discover(path: str | Path, group_field: str | None = None) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``{client name: {"train": records, "test": records}}`` (``test`` empty when the layout has no split)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"instruction data {path} not found")
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    if path.is_file():
        recs = read_records(path)
        field = group_field or next((f for f in ("task", "role", "category") if recs and f in recs[0]), None)
        if field is None:
            raise UserError(f"{path}: one file needs a grouping field (task/role); pass group_field")
        for r in recs:
            out.setdefault(str(r.get(field)), {"train": [], "test": []})["train"].append(r)
        return dict(sorted(out.items()))
    subdirs = sorted(p for p in path.iterdir() if p.is_dir())
    if subdirs:
        for d in subdirs:
            files = _files(d)
            if not files:
                continue
            split = {"train": [], "test": []}
            named = {f.stem.split(".")[0]: f for f in files}
            if "train" in named and "test" in named:
                split["train"], split["test"] = read_records(named["train"]), read_records(named["test"])
            else:
                for f in files:
                    split["train"] += read_records(f)
            out[d.name] = split
    else:
        for f in _files(path):
            out[f.stem] = {"train": read_records(f), "test": []}
    if not out:
        raise UserError(f"{path}: no .json/.jsonl files found")
    return out


def encode_text(tokenizer: Any, text: str, *, first: bool) -> list[int]:
    """Token ids; for Hugging Face tokenizers special tokens (BOS) only at the start of the prompt."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=first))
    except TypeError:
        return list(tokenizer.encode(text))


def pad_id(tokenizer: Any) -> int:
    for attr in ("pad_token_id", "eos_token_id", "pad_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return v
    return 0


def instruction_federation(path: str | Path, tokenizer: Any, *, group_field: str | None = None,
                           train: int = 300, test: int = 200, val_fraction: float = 0.1, max_len: int = 256,
                           clients: Sequence[str] | None = None, seed: int = 0,
                           device: torch.device | str = "cpu") -> Federation:
    """One client per task / role of the instruction data at ``path`` (see the module docstring)."""
    groups = discover(path, group_field)
    if clients:
        missing = [c for c in clients if c not in groups]
        if missing:
            raise UserError(f"unknown clients {missing}; available: {', '.join(groups)}")
        groups = {c: groups[c] for c in clients}
    rng = np.random.default_rng(seed)
    eos = getattr(tokenizer, "eos_token_id", None)
    eos = eos if isinstance(eos, int) else getattr(tokenizer, "eos_id", None)
    pad = pad_id(tokenizer)
    rows = []
    for name, split in groups.items():
        tr = [p for p in (to_pair(r) for r in split["train"]) if p]
        te = [p for p in (to_pair(r) for r in split["test"]) if p]
        tr = [tr[i] for i in rng.permutation(len(tr))]
        if not te:  # no test file: hold out the test records first
            k = min(test, len(tr) // 3)
            te, tr = tr[:k], tr[k:]
        te = [te[i] for i in rng.permutation(len(te))][:test]
        tr = tr[:train]
        nv = round(val_fraction * len(tr))
        if len(tr) < 2 or not te:
            raise UserError(f"client {name!r} has too few usable records ({len(tr)} train, {len(te)} test)")

        def enc(pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
            out = []
            for p, a in pairs:
                resp = encode_text(tokenizer, a, first=False) + ([eos] if isinstance(eos, int) else [])
                out.append((encode_text(tokenizer, p, first=True), resp))
            return out

        rows.append((name, encode_pairs(enc(tr[nv:]), max_len, pad), encode_pairs(enc(tr[:nv]), max_len, pad),
                     encode_pairs(enc(te), max_len, pad)))
    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else int(getattr(tokenizer, "vocab_size", 0))
    return make_federation(rows, vocab, dataset="instructions", partition="task", device=device,
                           info={"source": str(path), "max_len": max_len})
