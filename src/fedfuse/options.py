"""Declared options: one place for an option's default, type, help line, choices and range.

Algorithm ``Options`` dataclasses (and other option namespaces) declare fields with :func:`opt`::

    @dataclass
    class Options:
        mu: float = opt(0.01, "proximal coefficient μ of FedProx's local objective", ge=0.0)
        topology: str = opt("full", "peer graph", choices=("full", "ring"))

The same declaration drives validation (:func:`check_value`) and discovery (:func:`describe`, used by
``fedfuse show``), so help text and the accepted values cannot drift apart.  Fields declared without
:func:`opt` still work; they simply have no help line and only their type is checked.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_MISSING = dataclasses.MISSING


def opt(default: Any, help: str = "", *, choices: Sequence[Any] | None = None, ge: float | None = None,
        gt: float | None = None, le: float | None = None, lt: float | None = None) -> Any:
    """A dataclass field with its help line, choices and numeric bounds in ``metadata``.

    Mutable defaults (lists, dicts) are copied per instance.
    """
    meta = {"help": help, "choices": tuple(choices) if choices is not None else None,
            "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, list | dict | set):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class OptionInfo:
    """What ``fedfuse show`` prints for one option."""

    name: str
    type: str
    default: Any
    help: str
    choices: tuple[Any, ...] | None
    bounds: str  # e.g. ">= 0", "(0, 1]", "" when unbounded


def _default(f: dataclasses.Field) -> Any:
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _bounds(meta: dict[str, Any]) -> str:
    lo = (f">= {meta['ge']}" if meta.get("ge") is not None else f"> {meta['gt']}" if meta.get("gt") is not None
          else "")
    hi = (f"<= {meta['le']}" if meta.get("le") is not None else f"< {meta['lt']}" if meta.get("lt") is not None
          else "")
    return ", ".join(x for x in (lo, hi) if x)


def describe(options_cls: type) -> list[OptionInfo]:
    """Every field of an options dataclass with its type, default, help, choices and bounds."""
    if not dataclasses.is_dataclass(options_cls):
        return []
    hints = typing.get_type_hints(options_cls)
    out = []
    for f in dataclasses.fields(options_cls):
        meta = dict(f.metadata)
        out.append(OptionInfo(f.name, _type_name(hints.get(f.name, f.type)), _default(f), meta.get("help", ""),
                              meta.get("choices"), _bounds(meta)))
    return out


def check_value(options_cls: type, name: str, value: Any) -> str | None:
    """None when ``value`` is allowed for option ``name``; otherwise a message saying what is allowed."""
    fields = {f.name: f for f in dataclasses.fields(options_cls)} if dataclasses.is_dataclass(options_cls) else {}
    if name not in fields:
        return None
    meta = fields[name].metadata
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        return f"must be one of {', '.join(map(str, choices))}; got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    for key, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                          ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
        bound = meta.get(key)
        if bound is not None and not ok(value, bound):
            return f"must be {word} {bound}; got {value!r}"
    return None
