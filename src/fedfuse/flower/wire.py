"""The wire format: fedfuse payloads, replies and client states as Flower records, without pickle.

A value is split into its tensors and a JSON skeleton.  Tensors (and numpy arrays) go into one
:class:`flwr.app.ArrayRecord` under numbered keys; everything else (dicts, lists, tuples, strings, numbers,
``None``, fedfuse :class:`~fedfuse.types.Message` objects) becomes JSON in a :class:`flwr.app.ConfigRecord`, with
each tensor replaced by a reference to its key.  Decoding rebuilds exactly the same structure: tensors keep
dtype, shape and values bit for bit (bfloat16 travels as its 16-bit pattern), tuples stay tuples, integer dict
keys stay integers.  Any other Python object is refused with the path where it was found, so nothing arbitrary
is ever executed on load.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

from fedfuse.types import FitStats, Message

ARRAYS = "fedfuse.arrays"
SKELETON = "fedfuse.skeleton"
PAYLOAD_ARRAYS = "fedfuse.payload.arrays"  # a job's payload, kept apart so a broadcast payload is encoded once
PAYLOAD_SKELETON = "fedfuse.payload.skeleton"

_VIEW_AS = {torch.bfloat16: torch.int16}  # dtypes numpy cannot hold: sent as their bit pattern


class WireError(TypeError):
    """A value that cannot travel as Flower records (an arbitrary Python object)."""


def split(value: Any) -> tuple[dict[str, np.ndarray], Any]:
    """``value`` → (numbered arrays, JSON-able skeleton)."""
    arrays: dict[str, np.ndarray] = {}

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            t = v.detach()
            tag = None
            if t.dtype in _VIEW_AS:
                tag = str(t.dtype).removeprefix("torch.")
                t = t.view(_VIEW_AS[t.dtype])
            key = str(len(arrays))
            arrays[key] = t.cpu().contiguous().numpy()
            return {"__t__": key, "dtype": tag} if tag else {"__t__": key}
        if isinstance(v, np.ndarray):
            key = str(len(arrays))
            arrays[key] = np.ascontiguousarray(v)
            return {"__np__": key}
        if isinstance(v, Message):
            stats = walk(v.stats.as_dict(), path + ".stats") if v.stats is not None else None
            return {"__msg__": [walk(v.tensors, path + ".tensors"), walk(v.meta, path + ".meta"), stats]}
        if isinstance(v, dict):
            if all(isinstance(k, str) for k in v) and not any(k.startswith("__") for k in v):
                return {k: walk(x, f"{path}.{k}") for k, x in v.items()}
            return {"__dict__": [[walk(k, path + "<key>"), walk(x, f"{path}[{k!r}]")] for k, x in v.items()]}
        if isinstance(v, tuple):
            return {"__tuple__": [walk(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [walk(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, bool | int | str) or v is None:
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"__float__": repr(v)}
        if isinstance(v, np.generic):
            return walk(v.item(), path)
        if isinstance(v, torch.device | torch.dtype):
            return {"__torch__": str(v), "kind": type(v).__name__}
        raise WireError(f"cannot send {type(v).__name__} at {path or 'the top level'} as Flower records "
                        "(only tensors, arrays, numbers, strings, lists, tuples, dicts and fedfuse Messages travel)")

    return arrays, walk(value, "")


def join(arrays: dict[str, np.ndarray], skeleton: Any) -> Any:
    """Inverse of :func:`split`."""

    def walk(v: Any) -> Any:
        if isinstance(v, list):
            return [walk(x) for x in v]
        if not isinstance(v, dict):
            return v
        if "__t__" in v:
            t = torch.from_numpy(np.array(arrays[v["__t__"]], copy=True))
            dtype = v.get("dtype")
            return t.view(getattr(torch, dtype)) if dtype else t
        if "__np__" in v:
            return np.array(arrays[v["__np__"]], copy=True)
        if "__msg__" in v:
            tensors, meta, stats = v["__msg__"]
            return Message(walk(tensors), walk(meta), FitStats(**walk(stats)) if stats is not None else None)
        if "__dict__" in v:
            return {_hashable(walk(k)): walk(x) for k, x in v["__dict__"]}
        if "__tuple__" in v:
            return tuple(walk(x) for x in v["__tuple__"])
        if "__float__" in v:
            return float(v["__float__"])
        if "__torch__" in v:
            return torch.device(v["__torch__"]) if v["kind"] == "device" else getattr(torch, v["__torch__"][6:])
        return {k: walk(x) for k, x in v.items()}

    return walk(skeleton)


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list | tuple) else k


def to_records(value: Any) -> tuple[Any, Any]:
    """``value`` → (``ArrayRecord``, ``ConfigRecord``) ready to put in a Flower ``RecordDict``."""
    from flwr.app import Array, ArrayRecord, ConfigRecord

    arrays, skeleton = split(value)
    record = ArrayRecord(array_dict={k: Array(ndarray=a) for k, a in arrays.items()}) if arrays else ArrayRecord()
    return record, ConfigRecord({"json": json.dumps(skeleton, allow_nan=False)})


def from_records(arrays: Any, config: Any) -> Any:
    """Inverse of :func:`to_records`."""
    return join({k: a.numpy() for k, a in arrays.items()}, json.loads(str(config["json"])))


def pack(value: Any, content: Any | None = None) -> Any:
    """``value`` stored in a Flower ``RecordDict`` (``content``, new if None) under fedfuse's two record names."""
    from flwr.app import RecordDict

    content = RecordDict() if content is None else content
    content[ARRAYS], content[SKELETON] = to_records(value)
    return content


def unpack(content: Any) -> Any:
    """The value :func:`pack` stored in ``content``."""
    return from_records(content[ARRAYS], content[SKELETON])
