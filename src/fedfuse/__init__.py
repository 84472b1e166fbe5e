"""fedfuse: federated learning beyond plain averaging.

The Python API (see ``docs/api.md``)::

    import fedfuse
    res = fedfuse.run(algorithm="fedprox", rounds=5, mu=0.1)       # -> Result (res.metrics is a DataFrame)
    table = fedfuse.compare(["fedavg", "fedprox"], seeds=3)        # -> ResultTable (mean ± std, paired test)
    fedfuse.load("runs/...")                                       # -> Result of a run directory
    fedfuse.algorithms(); fedfuse.show("msfusion")                 # discovery

Submodules are imported lazily, so ``import fedfuse`` stays fast.  ``fedfuse.algorithms()``, ``fedfuse.models()``,
``fedfuse.datasets()`` and ``fedfuse.partitions()`` return name → description (the first two are also the
registry packages; ``list_algorithms()`` etc. are the same functions under plain names).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP reads its wait policy once, when torch loads it: a passive policy keeps idle torch threads from spinning
# against other work on a busy machine (fedfuse.runtime.threads; a value the user set is kept).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def package_version() -> str:
    """fedfuse's version from the installed package's metadata (``pyproject.toml``'s ``version``); ``0+unknown``
    for a source tree that is on ``sys.path`` but not installed.  Also ``fedfuse.__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedfuse")
    except PackageNotFoundError:
        return "0+unknown"


_API = ("run", "compare", "sweep", "list_algorithms", "list_datasets", "list_models", "list_partitions", "show")
_OTHER = {"Component": "fedfuse.catalog",
          "ResultTable": "fedfuse.result_table", "Sweep": "fedfuse.sweep", "RunConfig": "fedfuse.config",
          "ConfigError": "fedfuse.config", "make_config": "fedfuse.config", "config_hash": "fedfuse.config",
          "Result": "fedfuse.result", "load": "fedfuse.result", "Callback": "fedfuse.engine.callbacks",
          "write_report": "fedfuse.report"}

__all__ = [  # noqa: RUF022 - grouped by kind
    "algorithms", "datasets", "models", "partitions",
    "Callback", "Component", "ConfigError", "Result", "ResultTable", "RunConfig", "Sweep", "__version__",
    "compare", "config_hash", "list_algorithms", "list_datasets", "list_models", "list_partitions", "load",
    "make_config", "run", "show", "sweep", "write_report",
]

if TYPE_CHECKING:  # pragma: no cover
    from fedfuse.api import (
        compare,
        list_algorithms,
        list_datasets,
        list_models,
        list_partitions,
        run,
        show,
        sweep,
    )
    from fedfuse.catalog import Component
    from fedfuse.config import ConfigError, RunConfig, config_hash, make_config
    from fedfuse.engine.callbacks import Callback
    from fedfuse.report import write_report
    from fedfuse.result import Result, load
    from fedfuse.result_table import ResultTable
    from fedfuse.sweep import Sweep


_ALIASES = {"datasets": "list_datasets", "partitions": "list_partitions"}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "__version__":  # read from the metadata on first use: importlib.metadata is not free to import
        return package_version()
    if name in ("algorithms", "models"):  # callable registry packages: fedfuse.algorithms() lists them
        return importlib.import_module(f"fedfuse.{name}")
    if name in _ALIASES:
        return getattr(importlib.import_module("fedfuse.api"), _ALIASES[name])
    if name in _API:
        return getattr(importlib.import_module("fedfuse.api"), name)
    if name in _OTHER:
        return getattr(importlib.import_module(_OTHER[name]), name)
    raise AttributeError(f"module 'fedfuse' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


# The composition root wires the layers: the configuration layer (below the engine) validates algorithm names and
# Options against the registry without importing it; it reads it through this lazy source, which
# ``fedfuse.algorithms`` replaces with itself when imported.
def _algorithm_registry() -> Any:
    import importlib

    return importlib.import_module("fedfuse.algorithms").ALGORITHMS


from fedfuse import config as _config  # noqa: E402

if _config._ALGORITHM_SOURCE is None:
    _config.register_algorithm_source(_algorithm_registry)
