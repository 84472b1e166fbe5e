"""Algorithm registry: name → class.  One file per algorithm holds its math."""

from __future__ import annotations

from fedfuse.algorithms.base import Algorithm, RoundInfo, RunContext
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.algorithms.fedavg_ft import FedAvgFT
from fedfuse.algorithms.fedprox import FedProx
from fedfuse.algorithms.local import Local

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FedAvg, FedProx, Local, FedAvgFT)}


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of: {', '.join(sorted(ALGORITHMS))}") from None


__all__ = ["ALGORITHMS", "Algorithm", "RoundInfo", "RunContext", "get_algorithm"]
