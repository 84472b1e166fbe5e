"""Registry packages that can also be called: ``fedfuse.algorithms()`` / ``fedfuse.models()`` list their entries.

``fedfuse.algorithms`` and ``fedfuse.models`` are packages (their modules hold the code), yet the Python API
promises ``fedfuse.algorithms()`` → {name: description}.  A module's class may be replaced by a subclass of
``ModuleType`` (Python ≥ 3.5), which is all this does; the package behaves as before in every other way.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any


class CallableModule(types.ModuleType):
    """A module whose call returns its registry listing."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_listing"](*args, **kwargs)


def make_callable(module_name: str, listing: Callable[[], Any]) -> None:
    mod = sys.modules[module_name]
    mod._listing = listing  # type: ignore[attr-defined]
    mod.__class__ = CallableModule
