"""Paper reproductions: ``fedfuse reproduce NAME [--quick]``.

Each module here defines ``DESCRIPTION`` (one line), ``add_arguments(parser)`` (optional) and
``run(args) -> int``.  They are discovered by file name (``fedmerge.py`` → ``fedfuse reproduce fedmerge``).
Shared helpers for grids of runs live in :mod:`fedfuse.reproduce.common`.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def available() -> dict[str, ModuleType]:
    out = {}
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name.startswith("_") or mod.name == "common":
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        if hasattr(module, "run"):
            out[mod.name.replace("_", "-")] = module
    return out
