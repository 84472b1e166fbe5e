"""Run checkpoints: ``checkpoint.pt`` in the run directory, written atomically, read back with checks; and the
one safe way fedfuse reads a torch file that someone else may have written (:func:`safe_load`).

A checkpoint holds everything a resumed run needs to continue bit-identically (``engine/loop.py`` builds the
record): the server and client states, the running totals, the best record, the history, the sampler's state,
late replies in flight, the config, the (possibly halved) learning rate and the executor the run used.

**Safe loading.**  A checkpoint, a LoRA base or any other torch file can be altered by whoever can write the run
directory or the file (a shared disk, a downloaded base, a tampered record's base).  ``torch.load`` with
``weights_only=False`` runs any code the file's pickle names, so fedfuse never uses it on such files: every load
is ``weights_only=True`` (tensors, numbers, strings, lists, tuples, sets, dicts), and a file naming anything else
is refused with one line, before any of it runs.  To make that possible a checkpoint stores only plain types:
:func:`plain` turns NumPy arrays into tensors and fedfuse :class:`~fedfuse.types.Message` /
:class:`~fedfuse.types.FitStats` objects into tagged dicts at save time, and :func:`unplain` turns them back on
load; any other object is refused when the checkpoint is written (naming where it was), not when it is read.
Checkpoints written before this (NumPy arrays pickled as such) stay readable: NumPy arrays of numbers are
allowed as safe globals (:data:`NUMPY_GLOBALS`; object arrays, which could hold anything, are not).
"""

from __future__ import annotations

import os
import re
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.errors import ConfigError
from fedfuse.runfiles import CHECKPOINT as CHECKPOINT  # the file's name (fedfuse.runfiles)
from fedfuse.types import FitStats, Message

#: entries every checkpoint has
REQUIRED = ("round", "state", "client_states", "totals", "best", "history")
TAG = "__fedfuse__"  # the key that marks a dict :func:`plain` made out of a non-plain object

#: globals a NumPy array of numbers needs when it was pickled as such (checkpoints written before :func:`plain`)
NUMPY_GLOBALS: list[Any] = [np.ndarray, np.dtype, np._core.multiarray._reconstruct,
                            *(type(np.dtype(t)) for t in ("bool", "int8", "int16", "int32", "int64", "uint8",
                                                          "uint16", "uint32", "uint64", "float16", "float32",
                                                          "float64", "complex64", "complex128"))]
_PLAIN_LEAVES = (bool, int, float, complex, str, bytes, bytearray, type(None))  # exactly these (np.float64 is a float)
_TORCH_LEAVES = (torch.Tensor, torch.Size, torch.device, torch.dtype)


def safe_load(path: str | Path, *, what: str, kind: str = "torch file", hint: str = "",
              map_location: torch.device | str = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``: the file's tensors and plain values, never its code.

    A file whose pickle names anything else (a class, a function — what a tampered file uses to run code) is a
    :class:`ConfigError` of one line naming ``what``, the file and the refused name; nothing of it has run.  A file
    that is not a readable ``kind`` at all is one too (``hint``: what to do then)."""
    try:
        with torch.serialization.safe_globals(NUMPY_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # UnpicklingError (an unsafe global), truncated zip, not a torch file at all
        raise ConfigError(f"{what}: {path} {_why(e, kind)}{hint}") from None


#: how torch's weights-only unpickler names what it refused (a global, or a class it was asked to build)
_REFUSED = r"(?:Unsupported global: |unsupported )GLOBAL (\S+)|allowlisted.*but got <class '([^']+)'>"


def _why(e: Exception, kind: str) -> str:
    text = str(e)
    found = re.search(_REFUSED, text)
    if found:
        return (f"names {found.group(1) or found.group(2)}, which a fedfuse file never holds: refused to load it "
                "(torch.load weights_only; nothing in it ran). Was the file altered?")
    inner = re.search(r"WeightsUnpickler error:\s*(\S.*)", text)
    first = inner.group(1) if inner else (text.strip().splitlines() or ["corrupt"])[0]
    return f"is not a readable {kind} ({type(e).__name__}: {first.strip()})"


# ---- plain types ----------------------------------------------------------------------------------------------
def plain(value: Any, path: str = "") -> Any:
    """``value`` as types ``torch.load(weights_only=True)`` reads; :func:`unplain` inverts it exactly.  Raises
    ``TypeError`` naming the path of any object it cannot store."""
    if type(value) in _PLAIN_LEAVES or isinstance(value, _TORCH_LEAVES):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError(f"checkpoint: a NumPy object array at {path or 'the top level'} cannot be stored safely")
        return {TAG: "ndarray", "data": torch.from_numpy(np.ascontiguousarray(value).copy())}
    if isinstance(value, Message):
        return {TAG: "message", "tensors": plain(value.tensors, path + ".tensors"),
                "meta": plain(value.meta, path + ".meta"), "stats": plain(value.stats, path + ".stats")}
    if isinstance(value, FitStats):
        return {TAG: "fitstats", **value.as_dict()}
    return _plain_container(value, path)


def _plain_container(value: Any, path: str) -> Any:
    kind = type(value)
    if kind in (dict, OrderedDict, Counter):
        items = {k: plain(v, f"{path}[{k!r}]") for k, v in value.items()}
        if TAG in value:  # a dict that happens to use the tag as a key: stored as its item list
            return {TAG: "dict", "items": list(items.items())}
        return items if kind is dict else kind(items)
    if kind in (list, tuple, set):
        return kind(plain(v, f"{path}[{i}]") for i, v in enumerate(value))
    if kind is frozenset:
        return {TAG: "frozenset", "items": [plain(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    raise TypeError(f"checkpoint: cannot store a {kind.__name__} at {path or 'the top level'} safely (only "
                    "tensors, NumPy arrays, numbers, strings, lists, tuples, sets, dicts and fedfuse Messages)")


def unplain(value: Any) -> Any:
    """Inverse of :func:`plain`."""
    kind = type(value)
    if kind in (dict, OrderedDict, Counter):
        tag = value.get(TAG) if kind is dict else None
        if tag is None:
            items = {k: unplain(v) for k, v in value.items()}
            return items if kind is dict else kind(items)
        return _untag(tag, value)
    if kind in (list, tuple, set):
        return kind(unplain(v) for v in value)
    return value


def _untag(tag: str, value: dict[str, Any]) -> Any:
    if tag == "ndarray":
        return value["data"].numpy()
    if tag == "message":
        return Message(unplain(value["tensors"]), unplain(value["meta"]), unplain(value["stats"]))
    if tag == "fitstats":
        return FitStats(**{k: v for k, v in value.items() if k != TAG})
    if tag == "dict":
        return {k: unplain(v) for k, v in value["items"]}
    if tag == "frozenset":
        return frozenset(unplain(v) for v in value["items"])
    raise ConfigError(f"checkpoint: unknown entry kind {tag!r} (written by a newer fedfuse?)")


# ---- checkpoints ----------------------------------------------------------------------------------------------
def save_checkpoint(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` (as :func:`plain` types) to ``path`` atomically (a temporary file, then a rename): a kill
    leaves the old one."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(plain(record), tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """A run checkpoint, read with :func:`safe_load`; an empty, truncated, foreign or tampered file is a
    :class:`ConfigError` naming it."""
    if not path.is_file():
        raise ConfigError(f"--resume: {path} does not exist (nothing to resume)")
    if path.stat().st_size == 0:
        raise ConfigError(f"--resume: {path} is empty (the run was stopped while writing it?); start the run "
                          "again with --overwrite")
    ck = unplain(safe_load(path, what="--resume", kind="checkpoint", map_location=device,
                           hint="; start the run again with --overwrite"))
    if not isinstance(ck, dict) or any(k not in ck for k in REQUIRED):
        raise ConfigError(f"--resume: {path} is not a fedfuse run checkpoint (missing entries)")
    return ck


def checkpoint_round(path: Path) -> int | None:
    """The number of rounds the checkpoint at ``path`` has done (None when there is none)."""
    if not path.is_file():
        return None
    return int(safe_load(path, what="checkpoint")["round"])
