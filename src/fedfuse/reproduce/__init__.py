"""Paper reproductions: ``fedfuse reproduce NAME [--quick]``.

Each module here defines ``FAMILY`` (:class:`fedfuse.reproduce.preset.Family`): a description, its flags and
the preset they select as data (tables of labelled run configurations), run by the ``Sweep``/``ResultTable``
machinery of ``fedfuse compare`` (:func:`fedfuse.reproduce.preset.run`).  Families are discovered by file name
(``fedmerge_lora.py`` → ``fedfuse reproduce fedmerge-lora``).
"""

from __future__ import annotations

import importlib
import pkgutil

from fedfuse.reproduce.preset import Family

_HELPERS = ("common", "preset")


def available() -> dict[str, Family]:
    """Every reproduction by its command name."""
    out = {}
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name.startswith("_") or mod.name in _HELPERS:
            continue
        out[mod.name.replace("_", "-")] = importlib.import_module(f"{__name__}.{mod.name}").FAMILY
    return out
