"""Flower Datasets' partitioners as fedfuse partitions ``flwr:NAME``.

``flwr:NAME`` is Flower Datasets' partitioner ``NAME`` (``flwr:dirichlet`` = ``DirichletPartitioner`` ...)
applied to the training labels of *any* fedfuse dataset.  As ``flwr_datasets.FederatedDataset(shuffle=True,
seed=SEED)`` does, the training split is first shuffled with ``Dataset.shuffle(seed=SEED)`` (option
``shuffle``), and the partitioner gets ``seed=SEED``: with the same seed a Flower pipeline over the same data
gets the same clients.  :mod:`fedfuse.data.partition` registers them; ``datasets`` and ``flwr_datasets`` (extra
``fedfuse[flower]``) are imported only when one is used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedfuse.data.dataset import Dataset, Partition
from fedfuse.data.flower_datasets import _need
from fedfuse.errors import UserError

__all__ = ["FLWR_PARTITIONS", "FLWR_PREFIX", "flwr_partition", "register_partitions"]

FLWR_PREFIX = "flwr:"

@dataclass(frozen=True)
class FlowerPartitioner:
    """A Flower Datasets partitioner exposed as partition ``flwr:<name>``: its class, help and options."""

    cls: str
    description: str
    options: dict[str, object]
    by_label: bool = True  # gets partition_by="label"
    sized: bool = True  # gets num_partitions


_SHUFFLE = {"shuffle": True}
FLWR_PARTITIONS: dict[str, FlowerPartitioner] = {
    "iid": FlowerPartitioner("IidPartitioner", "Flower Datasets IidPartitioner: equal contiguous shards",
                             dict(_SHUFFLE), by_label=False),
    "dirichlet": FlowerPartitioner(
        "DirichletPartitioner", "Flower Datasets DirichletPartitioner: per-class Dir(alpha) over clients",
        {"alpha": 0.5, "min_partition_size": 10, "self_balancing": False, **_SHUFFLE}),
    "shard": FlowerPartitioner(
        "ShardPartitioner", "Flower Datasets ShardPartitioner: label-sorted shards, num_shards_per_partition each",
        {"num_shards_per_partition": 2, "shard_size": None, "keep_incomplete_shard": False, **_SHUFFLE}),
    "pathological": FlowerPartitioner(
        "PathologicalPartitioner", "Flower Datasets PathologicalPartitioner: num_classes_per_partition classes each",
        {"num_classes_per_partition": 2, "class_assignment_mode": "random", **_SHUFFLE}),
    "inner-dirichlet": FlowerPartitioner(
        "InnerDirichletPartitioner", "Flower Datasets InnerDirichletPartitioner: given sizes, Dir(alpha) classes",
        {"partition_sizes": None, "alpha": 0.5, **_SHUFFLE}, sized=False),
    "linear": FlowerPartitioner("LinearPartitioner", "Flower Datasets LinearPartitioner: sizes ∝ client id + 1",
                                dict(_SHUFFLE), by_label=False),
    "square": FlowerPartitioner("SquarePartitioner", "Flower Datasets SquarePartitioner: sizes ∝ (id + 1)²",
                                dict(_SHUFFLE), by_label=False),
    "exponential": FlowerPartitioner("ExponentialPartitioner",
                                     "Flower Datasets ExponentialPartitioner: sizes ∝ exp(id)", dict(_SHUFFLE),
                                     by_label=False),
    "natural-id": FlowerPartitioner(
        "NaturalIdPartitioner", "Flower Datasets NaturalIdPartitioner: one client per value of the group column "
        "(hf: option group_column; partition_id when present)", {"shuffle": False}, by_label=False, sized=False),
}

_FLWR_BOUNDS: dict[str, tuple[type, float, bool]] = {
    "min_partition_size": (int, 0, True),
    "num_shards_per_partition": (int, 1, True),
    "shard_size": (int, 1, True),
    "num_classes_per_partition": (int, 1, True),
}
_FLWR_CHOICES: dict[str, tuple[object, ...]] = {"class_assignment_mode": ("random", "deterministic",
                                                                          "first-deterministic")}


def register_partitions(partitions: dict[str, str], options: dict[str, dict[str, object]],
                        partitioners: dict[str, Callable[..., Partition]],
                        bounds: dict[str, tuple[type, float, bool]], choices: dict[str, tuple[object, ...]]) -> None:
    """Add every ``flwr:NAME`` to fedfuse's partition registry (called by :mod:`fedfuse.data.partition`)."""
    for name, spec in FLWR_PARTITIONS.items():
        key = FLWR_PREFIX + name
        partitions[key] = spec.description
        options[key] = dict(spec.options)
        partitioners[key] = _flwr_partitioner(name)
    bounds.update(_FLWR_BOUNDS)
    choices.update(_FLWR_CHOICES)


def _flwr_partitioner(name: str) -> Callable[[Dataset, int | None, int, dict[str, Any]], Partition]:
    def run(dataset: Dataset, num_clients: int | None, seed: int, opts: dict[str, Any]) -> Partition:
        return flwr_partition(name, dataset, num_clients, seed, opts)

    run.__doc__ = FLWR_PARTITIONS[name].description
    return run


def _flower_kwargs(name: str, num_clients: int, n: int, seed: int, opts: dict[str, Any]) -> dict[str, Any]:
    spec = FLWR_PARTITIONS[name]
    kw: dict[str, Any] = {k: v for k, v in opts.items() if k != "shuffle"}
    if spec.sized:
        kw["num_partitions"] = num_clients
    if spec.by_label:
        kw["partition_by"] = "label"
        kw["seed"] = seed
    if name == "inner-dirichlet":
        sizes = kw["partition_sizes"]
        if sizes is None:  # equal sizes, as fedfuse's iid
            sizes = [len(a) for a in np.array_split(np.arange(n), num_clients)]
        if len(sizes) != num_clients or sum(sizes) > n or any(isinstance(s, bool) or s < 1 for s in sizes):
            raise UserError(f"partition_sizes must be {num_clients} positive integers summing to at most {n}, "
                            f"got {sizes!r}")
        kw["partition_sizes"] = [int(s) for s in sizes]
    if name == "shard" and kw.get("shard_size") is None:
        kw.pop("shard_size")
    if name == "natural-id":
        kw["partition_by"] = "group"
    return kw


def flwr_partition(name: str, dataset: Dataset, num_clients: int | None, seed: int,
                   opts: dict[str, Any]) -> Partition:
    """Partition ``dataset``'s training samples with Flower Datasets' partitioner ``name``.

    The partitioner sees a table of the training labels (column ``label``, plus ``group`` for natural-id), shuffled
    first with ``Dataset.shuffle(seed=seed)`` when ``shuffle`` (as ``FederatedDataset`` does); client ``i`` is
    ``load_partition(i)`` mapped back to fedfuse's sample indices.
    """

    hf = _need("datasets")
    fp = _need("flwr_datasets.partitioner")
    labels = dataset.train_labels.astype(np.int64)
    n = len(labels)
    columns: dict[str, Any] = {"label": labels, "index": np.arange(n, dtype=np.int64)}
    if name == "natural-id":
        if dataset.train_groups is None:
            raise UserError(f"partition 'flwr:natural-id' needs a group column: dataset {dataset.name!r} has none "
                            "(hf: datasets: option group_column; a partition_id column is used when present)")
        columns["group"] = np.asarray(dataset.train_groups, dtype=np.int64)
        k = len(np.unique(columns["group"]))
        if num_clients and int(num_clients) != k:
            raise UserError(f"partition 'flwr:natural-id': the group column has {k} distinct values, "
                            f"so clients must be {k}, got {num_clients}")
        num_clients = k
    assert num_clients is not None
    table = hf.Dataset.from_dict(columns)
    if opts.get("shuffle"):
        table = table.shuffle(seed=seed)
    kwargs = _flower_kwargs(name, int(num_clients), n, seed, opts)
    partitioner = getattr(fp, FLWR_PARTITIONS[name].cls)(**kwargs)
    partitioner.dataset = table
    try:
        parts = [np.asarray(partitioner.load_partition(i)["index"], dtype=np.int64)
                 for i in range(partitioner.num_partitions)]
    except ValueError as e:
        raise UserError(f"partition 'flwr:{name}' ({FLWR_PARTITIONS[name].cls}): {e}") from None
    if name == "natural-id":  # Flower numbers natural ids by first appearance; fedfuse by sorted group id
        parts.sort(key=lambda p: int(columns["group"][p[0]]) if len(p) else -1)
    covered = int(sum(len(p) for p in parts))
    info: dict[str, Any] = {
        "flower_partitioner": FLWR_PARTITIONS[name].cls,
        "flower_kwargs": {k: v for k, v in kwargs.items() if k != "partition_sizes"},
        "pre_shuffle_seed": seed if opts.get("shuffle") else None,
        "unassigned_samples": n - covered,
    }
    return Partition(parts, info=info)
