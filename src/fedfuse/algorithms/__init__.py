"""Algorithm registry: name → class.  One file per algorithm holds its math.

Every module in this package is imported once and each :class:`Algorithm` subclass with a ``name``
is registered, so adding an algorithm means adding one file.
"""

from __future__ import annotations

import importlib
import pkgutil

from fedfuse.algorithms.base import Algorithm, RoundInfo, RunContext

#: modules of this package that are not algorithms but what algorithms share (every algorithm may import them)
COMMONS = ("base", "lora_base", "mean_base")


def _discover() -> dict[str, type[Algorithm]]:
    found: dict[str, type[Algorithm]] = {}
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name.startswith("_") or mod.name in COMMONS:
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        for obj in vars(module).values():
            is_algo = isinstance(obj, type) and issubclass(obj, Algorithm) and obj.__module__ == module.__name__
            if is_algo and obj.name:
                if obj.name in found and found[obj.name] is not obj:
                    raise RuntimeError(f"two algorithms are named {obj.name!r}")
                found[obj.name] = obj
    return dict(sorted(found.items()))


ALGORITHMS: dict[str, type[Algorithm]] = _discover()


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        from fedfuse.names import unknown

        raise ConfigError(unknown("algorithm", name, sorted(ALGORITHMS), listing="fedfuse list algorithms")) from None


__all__ = ["ALGORITHMS", "Algorithm", "RoundInfo", "RunContext", "get_algorithm"]

from fedfuse.config import ConfigError, register_algorithm_source  # noqa: E402  (config reads it, never imports it)

register_algorithm_source(lambda: ALGORITHMS)

from fedfuse._callable import make_callable  # noqa: E402  (fedfuse.algorithms() → name: description)

make_callable(__name__, lambda: {k: v.description for k, v in sorted(ALGORITHMS.items())})
