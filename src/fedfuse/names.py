"""Forgiving names: case-insensitive lookup and "did you mean" suggestions for every registry and option name.

Every error about an unknown name (algorithm, dataset, partition, model, option, config key) goes through
:func:`unknown`, so each one reads the same way: the name, the closest known names, and where to see the rest —
never a dump of every name on one line.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def canonical(name: str, choices: Iterable[str]) -> str | None:
    """``name`` itself when it is a choice, else the one choice equal to it ignoring case (and ``_``/``-``), else
    None (no match, or several that differ only in case)."""
    choices = list(choices)
    if name in choices:
        return name
    key = _fold(name)
    hits = [c for c in choices if _fold(c) == key]
    return hits[0] if len(hits) == 1 else None


def _fold(s: str) -> str:
    return s.lower().replace("_", "-")


def closest(name: str, choices: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """Up to ``n`` choices closest to ``name`` (difflib ratio, case-insensitive), best first; prefix matches
    (``fedprox`` for ``fedpro``) count as close too."""
    choices = list(dict.fromkeys(choices))
    folded = {_fold(c): c for c in choices}
    key = _fold(name)
    hits = [folded[k] for k in difflib.get_close_matches(key, list(folded), n=n, cutoff=cutoff)]
    if len(hits) < n and len(key) >= 3:
        hits += [c for c in choices if _fold(c).startswith(key) and c not in hits][: n - len(hits)]
    return hits


def did_you_mean(name: str, choices: Iterable[str], n: int = 3) -> str:
    """``"did you mean X?"`` / ``"did you mean X, Y or Z?"``, or ``""`` when nothing is close."""
    hits = closest(name, choices, n)
    if not hits:
        return ""
    if len(hits) == 1:
        return f"did you mean {hits[0]}?"
    return f"did you mean {', '.join(hits[:-1])} or {hits[-1]}?"


def unknown(what: str, name: str, choices: Iterable[str], *, listing: str = "", max_list: int = 16) -> str:
    """The one-line message for an unknown ``name`` of kind ``what``: the closest names when some are close,
    else the choices themselves when they are few (at most ``max_list``), and ``listing`` (e.g. "fedfuse list
    algorithms") as the place to see all of them.

    >>> unknown("algorithm", "fedproxx", ["fedavg", "fedprox"], listing="fedfuse list algorithms")
    "unknown algorithm 'fedproxx'; did you mean fedprox? (all: fedfuse list algorithms)"
    """
    choices = list(choices)
    hint = did_you_mean(name, choices)
    msg = f"unknown {what} {name!r}"
    if hint:
        msg += f"; {hint}"
    elif choices and len(choices) <= max_list:
        return f"{msg}; choose one of: {', '.join(choices)}"
    elif not choices:
        return f"{msg} (there are none)"
    return f"{msg} (all: {listing})" if listing else msg
