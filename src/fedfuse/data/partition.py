"""Seeded ways of splitting a dataset's training samples among clients.

Every partitioner returns a :class:`Partition` of per-client index arrays into the dataset's train arrays
(sorted, int64).  All random draws come from ``numpy_rng(seed, "partition", ...)`` so a partition depends on
the seed only.  Use :func:`make_partition`; :data:`PARTITIONS` lists the names and :func:`partition_options`
the options with their defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fedfuse.data.dataset import Dataset, Partition
from fedfuse.errors import UserError
from fedfuse.rng import numpy_rng

PARTITIONS: dict[str, str] = {
    "iid": "uniform random split into equal sizes (differing by at most one)",
    "dirichlet": "per class, Dir(alpha) proportions over clients; resampled until each client has min_size",
    "shards": "each client gets classes_per_client distinct classes, each split evenly among its holders",
    "label-cluster": "classes grouped into K clusters, one per client group (FedMerge 'Cluster non-IID')",
    "natural": "one client per natural user of the dataset (LEAF writers / roles)",
    "domain": "one client group per domain; a group's clients share that domain's samples iid",
    "contiguous": "each client gets a contiguous block of samples (a stretch of text for language models)",
}

_OPTIONS: dict[str, dict[str, object]] = {
    "iid": {},
    "dirichlet": {"alpha": 0.5, "min_size": 10, "balance": True, "max_attempts": 1000},
    "shards": {"classes_per_client": 2},
    "label-cluster": {
        "clusters": 5,
        "group_sizes": None,
        "overlapping": False,
        "classes_per_cluster": None,
        "cluster_alpha": 10.0,
        "within": None,
    },
    "natural": {"max_clients": None},
    "domain": {"group_sizes": None},
    "contiguous": {},
}

#: type and one help line of every partition option (``fedfuse show PARTITION``), by option name
OPTION_HELP: dict[str, tuple[str, str]] = {
    "alpha": ("float", "Dirichlet concentration: smaller gives each client fewer classes (0.1 very skewed, 100 ~ IID)"),
    "min_size": ("int", "resample until every client holds at least this many training samples"),
    "balance": ("bool", "stop giving samples to a client that already holds an equal share (the usual FL code)"),
    "max_attempts": ("int", "resampling attempts before min_size is given up as impossible"),
    "classes_per_client": ("int", "classes each client receives (2 = the pathological non-IID split)"),
    "clusters": ("int", "number of label clusters, one per client group"),
    "group_sizes": ("list[int] | none", "clients in each group, e.g. [2,3,4,5,6]; none = equal groups"),
    "overlapping": ("bool", "clusters draw their classes from a shared pool (may overlap) instead of disjoint sets"),
    "classes_per_cluster": ("int | none", "classes per cluster with overlapping (none = 30 % of the classes)"),
    "cluster_alpha": ("float", "Dirichlet concentration of a cluster's samples over its clients (within=dirichlet)"),
    "within": ("str | none", "how a group's clients share its cluster's samples: equal or dirichlet (none = "
                             "equal when disjoint, dirichlet when overlapping)"),
    "max_clients": ("int | none", "keep at most this many natural clients (writers, roles); none = all"),
    "shuffle": ("bool", "shuffle the samples before partitioning (Flower Datasets partitioner option)"),
    "min_partition_size": ("int", "resample until every partition holds at least this many samples"),
    "self_balancing": ("bool", "stop assigning samples to a partition above the average size"),
    "num_shards_per_partition": ("int", "shards each partition receives"),
    "shard_size": ("int | none", "samples per shard; none = as many as fit"),
    "keep_incomplete_shard": ("bool", "also hand out the last, smaller shard"),
    "num_classes_per_partition": ("int", "classes each partition receives"),
    "class_assignment_mode": ("str", "how classes are assigned: random, deterministic or first-deterministic"),
    "partition_sizes": ("list[int] | none", "samples in each partition; none = equal"),
}

_LM_PARTITIONS = ("iid", "contiguous")

#: (kind, lower bound, whether the bound is inclusive) of every numeric partition option; None may mean "auto"
_BOUNDS: dict[str, tuple[type, float, bool]] = {
    "alpha": (float, 0.0, False),
    "min_size": (int, 0, True),
    "max_attempts": (int, 1, True),
    "classes_per_client": (int, 1, True),
    "clusters": (int, 1, True),
    "classes_per_cluster": (int, 1, True),
    "cluster_alpha": (float, 0.0, False),
    "max_clients": (int, 1, True),
}
_CHOICES: dict[str, tuple[object, ...]] = {"within": (None, "equal", "dirichlet")}

#: a non-natural partition needs on average this many training samples per client
MIN_SAMPLES_PER_CLIENT = 5


def check_partition_options(name: str, options: dict[str, Any]) -> None:
    """Raise ValueError naming the option, its value and the allowed range, for any bad partition option."""
    _check_name(name)
    unknown = sorted(set(options) - set(_OPTIONS[name]))
    if unknown:
        raise UserError(f"unknown option(s) {unknown} for partition {name!r}; valid: {', '.join(_OPTIONS[name])}")
    for key, v in options.items():
        _check_option(key, v)


def _check_option(key: str, v: Any) -> None:
    """Raise UserError when one option's value is outside its declared type, range or choices."""
    if key in _BOUNDS and v is not None:
        _check_bound(key, v)
    if key in _CHOICES and v not in _CHOICES[key]:
        raise UserError(f"{key} must be one of {', '.join(map(str, _CHOICES[key]))}, got {v!r}")
    if key in ("balance", "overlapping") and not isinstance(v, bool):
        raise UserError(f"{key} must be true or false, got {v!r}")
    if key == "group_sizes" and v is not None and (
        not isinstance(v, list | tuple) or not v
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v)
    ):
        raise UserError(f"group_sizes must be a list of positive integers (or none), got {v!r}")


def _check_bound(key: str, v: Any) -> None:
    """Raise UserError unless ``v`` is a finite number of the option's kind above its lower bound."""
    kind, lo, inclusive = _BOUNDS[key]
    ok_type = not isinstance(v, bool) and isinstance(v, int | float)
    ok_type = ok_type and (kind is float or float(v).is_integer())
    if not ok_type or not math.isfinite(float(v)) or (v < lo if inclusive else v <= lo):
        what = "an integer" if kind is int else "a number"
        raise UserError(f"{key} must be {what} {'>=' if inclusive else '>'} {lo}, got {v!r}")


def partition_options(name: str) -> dict[str, object]:
    """The options of partition ``name`` with their defaults."""
    _check_name(name)
    return dict(_OPTIONS[name])


def make_partition(
    name: str, dataset: Dataset, num_clients: int | None, seed: int, **options: Any
) -> Partition:
    """Split ``dataset``'s training samples among ``num_clients`` clients with partition ``name``.

    ``num_clients`` may be 0 / None only for ``natural`` (one client per user).  Raises ValueError for
    unknown names or options and for impossible requests.
    """
    _check_name(name)
    unknown = sorted(set(options) - set(_OPTIONS[name]))
    if unknown:
        valid = ", ".join(_OPTIONS[name]) or "none"
        raise UserError(f"unknown option(s) {unknown} for partition {name!r}; valid options: {valid}")
    if dataset.task == "lm" and name not in _LM_PARTITIONS:
        raise UserError(
            f"partition {name!r} needs real labels; dataset {dataset.name!r} is a language model, "
            f"use one of {list(_LM_PARTITIONS)}"
        )
    opts = {**_OPTIONS[name], **options}
    check_partition_options(name, opts)
    if name != "natural":
        if num_clients is None or int(num_clients) < 1:
            raise UserError(f"num_clients must be >= 1, got {num_clients}")
        num_clients = int(num_clients)
        n = len(dataset.train_y)
        if num_clients * MIN_SAMPLES_PER_CLIENT > n:
            raise UserError(
                f"clients: {num_clients} clients for {n} training samples of {dataset.name!r} leaves fewer than "
                f"{MIN_SAMPLES_PER_CLIENT} samples per client; use at most {n // MIN_SAMPLES_PER_CLIENT} clients"
            )
    part = _PARTITIONERS[name](dataset, num_clients, int(seed), opts)
    part.train_indices = [np.sort(np.asarray(i, dtype=np.int64)) for i in part.train_indices]
    if part.test_indices is not None:
        part.test_indices = [np.sort(np.asarray(i, dtype=np.int64)) for i in part.test_indices]
    empty = [c for c, idx in enumerate(part.train_indices) if len(idx) == 0]
    if empty:
        raise UserError(
            f"partition {name!r} left client(s) {empty[:10]} without training samples; use fewer clients"
        )
    part.info = {
        "name": name,
        "num_clients": part.num_clients,
        "seed": int(seed),
        **_jsonable(opts),
        **part.info,
    }
    return part


# ----------------------------------------------------------------------------------------------- helpers


def _check_name(name: str) -> None:
    if name not in PARTITIONS:
        raise UserError(f"unknown partition {name!r}; valid choices: {', '.join(PARTITIONS)}")


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, np.ndarray):
            v = v.tolist()
        elif isinstance(v, tuple):
            v = list(v)
        out[k] = v
    return out


def _check_enough(n: int, num_clients: int, what: str = "training samples") -> None:
    if num_clients > n:
        raise UserError(f"cannot split {n} {what} among {num_clients} clients; use at most {n} clients")


def _equal_sizes(n: int, k: int) -> np.ndarray:
    """``k`` sizes summing to ``n`` that differ by at most one."""
    return np.array([len(a) for a in np.array_split(np.arange(n), k)], dtype=np.int64)


def _alloc(n: int, props: np.ndarray) -> np.ndarray:
    """Integer counts summing to ``n`` proportional to ``props`` (largest remainder)."""
    props = np.asarray(props, dtype=np.float64)
    raw = props / props.sum() * n
    counts = np.floor(raw).astype(np.int64)
    rest = n - int(counts.sum())
    if rest > 0:
        order = np.argsort(-(raw - counts), kind="stable")
        counts[order[:rest]] += 1
    return counts


def _split_by_counts(idx: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    return np.split(idx, np.cumsum(counts)[:-1])


def _group_sizes(
    group_sizes: Sequence[int] | None, num_groups: int, num_clients: int, what: str
) -> np.ndarray:
    """Client-group sizes: the given ones (validated) or as equal as possible."""
    if group_sizes is None:
        if num_clients < num_groups:
            raise UserError(
                f"need at least one client per {what}: {num_groups} {what}s but {num_clients} clients"
            )
        return _equal_sizes(num_clients, num_groups)
    sizes = np.asarray(list(group_sizes), dtype=np.int64)
    if len(sizes) != num_groups:
        raise UserError(f"group_sizes has {len(sizes)} entries but there are {num_groups} {what}s")
    if (sizes < 1).any():
        raise UserError(f"group_sizes must all be >= 1, got {sizes.tolist()}")
    if int(sizes.sum()) != num_clients:
        raise UserError(
            f"group_sizes {sizes.tolist()} sum to {int(sizes.sum())}, not num_clients={num_clients}"
        )
    return sizes


def _class_indices(labels: np.ndarray, num_classes: int) -> list[np.ndarray]:
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(num_classes + 1))
    return [order[bounds[c] : bounds[c + 1]] for c in range(num_classes)]


def _num_classes(dataset: Dataset, labels: np.ndarray) -> int:
    return max(int(dataset.num_classes), int(labels.max()) + 1 if len(labels) else 0)


# ----------------------------------------------------------------------------------------------- partitioners


def _iid(dataset: Dataset, num_clients: int, seed: int, opts: dict[str, Any]) -> Partition:
    """A seeded permutation cut into equal blocks."""
    n = len(dataset.train_y)
    _check_enough(n, num_clients)
    perm = numpy_rng(seed, "partition", "iid").permutation(n)
    return Partition(list(np.array_split(perm, num_clients)))


def _contiguous(dataset: Dataset, num_clients: int, seed: int, opts: dict[str, Any]) -> Partition:
    """Consecutive blocks of samples in dataset order (no randomness: the seed is unused)."""
    n = len(dataset.train_y)
    _check_enough(n, num_clients)
    return Partition(list(np.array_split(np.arange(n), num_clients)))


def _dirichlet(dataset: Dataset, num_clients: int, seed: int, opts: dict[str, Any]) -> Partition:
    """Hsu et al. (2019) as in the usual FL code (NIID-Bench, FedMR, FedMerge `separate_data`).

    With ``balance`` a client already holding ``N / num_clients`` samples gets no more of later classes.
    """
    alpha, min_size = float(opts["alpha"]), int(opts["min_size"])
    attempts = int(opts["max_attempts"])
    if alpha <= 0:
        raise UserError(f"alpha must be > 0, got {alpha}")
    labels = dataset.train_labels.astype(np.int64)
    n = len(labels)
    _check_enough(n, num_clients)
    if min_size * num_clients > n:
        raise UserError(
            f"min_size={min_size} is impossible: {num_clients} clients × {min_size} > {n} samples; "
            "lower min_size"
        )
    by_class = [c for c in _class_indices(labels, _num_classes(dataset, labels)) if len(c)]
    rng = numpy_rng(seed, "partition", "dirichlet")
    cap = n / num_clients
    best = -1
    for _ in range(max(1, attempts)):
        sizes = np.zeros(num_clients, dtype=np.int64)
        pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            if opts["balance"]:  # the usual FL code: stop feeding clients that already hold their fair share
                q = p * (sizes < cap)
                p = q if q.sum() > 0 else p
            cuts = (np.cumsum(p / p.sum()) * len(idx)).astype(np.int64)[:-1]
            for c, part in enumerate(np.split(idx, cuts)):
                pieces[c].append(part)
                sizes[c] += len(part)
        best = max(best, int(sizes.min()))
        if sizes.min() >= min_size:
            return Partition([np.concatenate(p) for p in pieces])
    raise UserError(
        f"dirichlet(alpha={alpha}) did not give every one of {num_clients} clients >= {min_size} samples in "
        f"{attempts} attempts (best minimum {best}); use a smaller min_size, a larger alpha or fewer clients"
    )


def _shards(dataset: Dataset, num_clients: int, seed: int, opts: dict[str, Any]) -> Partition:
    """Each client holds ``classes_per_client`` classes; a class is split evenly among its holders."""
    h = int(opts["classes_per_client"])
    labels = dataset.train_labels.astype(np.int64)
    num_classes = _num_classes(dataset, labels)
    if not 1 <= h <= num_classes:
        raise UserError(f"classes_per_client must be in [1, {num_classes}] (the number of classes), got {h}")
    rng = numpy_rng(seed, "partition", "shards")
    # Balanced seeded assignment: each client takes the h least-used classes, ties broken at random, so class
    # usage counts never differ by more than one and the class sets vary between clients.
    usage = np.zeros(num_classes, dtype=np.int64)
    client_classes: list[list[int]] = []
    for _ in range(num_clients):
        order = np.lexsort((rng.random(num_classes), usage))
        chosen = np.sort(order[:h])
        usage[chosen] += 1
        client_classes.append([int(c) for c in chosen])
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for cid, classes in enumerate(client_classes):
        for c in classes:
            holders[c].append(cid)
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, idx in enumerate(_class_indices(labels, num_classes)):
        if holders[c]:
            for cid, part in zip(holders[c], np.array_split(rng.permutation(idx), len(holders[c]))):
                pieces[cid].append(part)
    unused = [c for c in range(num_classes) if not holders[c]]
    info = {"unused_classes": unused} if unused else {}
    return Partition([_cat(p) for p in pieces], client_classes=client_classes, info=info)


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _label_cluster(dataset: Dataset, num_clients: int, seed: int, opts: dict[str, Any]) -> Partition:
    """FedMerge 'Cluster non-IID': client group g (consecutive ids) holds the classes of cluster g.

    Disjoint (default): a seeded permutation of the classes cut into ``clusters`` near-equal parts.
    Overlapping: each cluster draws ``classes_per_cluster`` classes (default 30 % of them) from a pool
    refilled when exhausted.  Within a class its samples go to all clients holding it: equally
    (``within='equal'``, the disjoint default) or with Dir(``cluster_alpha``) proportions
    (``within='dirichlet'``, the overlapping default, as in the author code).
    """
    labels = dataset.train_labels.astype(np.int64)
    num_classes = _num_classes(dataset, labels)
    k = int(opts["clusters"])
    if not 1 <= k <= num_classes:
        raise UserError(f"clusters must be in [1, {num_classes}] (the number of classes), got {k}")
    if k > num_clients:
        raise UserError(f"need at least one client per cluster: {k} clusters but {num_clients} clients")
    sizes = _group_sizes(opts["group_sizes"], k, num_clients, "cluster")
    overlapping = bool(opts["overlapping"])
    within = opts["within"] or ("dirichlet" if overlapping else "equal")
    if within not in ("equal", "dirichlet"):
        raise UserError(f"within must be 'equal' or 'dirichlet', got {within!r}")
    alpha = float(opts["cluster_alpha"])
    if alpha <= 0:
        raise UserError(f"cluster_alpha must be > 0, got {alpha}")
    rng = numpy_rng(seed, "partition", "label-cluster")

    clusters = _cluster_classes(rng, num_classes, k, overlapping, opts["classes_per_cluster"])
    client_groups = np.repeat(np.arange(k), sizes)
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for cid, g in enumerate(client_groups):
        for c in clusters[g]:
            holders[c].append(cid)
    return Partition(
        _spread_classes(labels, num_classes, holders, num_clients, within, alpha, rng),
        client_groups=[int(g) for g in client_groups],
        client_classes=[list(clusters[g]) for g in client_groups],
        info={"clusters_classes": clusters, "group_sizes": sizes.tolist(), "within": within},
    )


def _cluster_classes(rng: np.random.Generator, num_classes: int, k: int, overlapping: bool,
                     per: int | None) -> list[list[int]]:
    """The classes of each of the ``k`` clusters: disjoint parts of a seeded permutation, or (overlapping)
    ``per`` classes each (default 30 % of them) drawn from a pool refilled when exhausted."""
    if not overlapping:
        return [sorted(int(c) for c in part) for part in np.array_split(rng.permutation(num_classes), k)]
    per = num_classes * 3 // 10 if per is None else int(per)
    per = max(per, 1)
    if per > num_classes:
        raise UserError(f"classes_per_cluster={per} exceeds the {num_classes} classes")
    if per * k < num_classes:
        raise UserError(
            f"clusters × classes_per_cluster = {k}×{per} < {num_classes} classes: some classes would "
            "belong to no cluster; raise classes_per_cluster or clusters"
        )
    return _draw_with_refill(rng, num_classes, k, per)


def _spread_classes(labels: np.ndarray, num_classes: int, holders: list[list[int]], num_clients: int, within: str,
                    alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Every client's samples: each class's samples split among the clients holding it, equally or with
    Dir(``alpha``) proportions."""
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, idx in enumerate(_class_indices(labels, num_classes)):
        h = len(holders[c])
        if h == 0 or len(idx) == 0:
            continue
        idx = rng.permutation(idx)
        if within == "equal":
            counts = _equal_sizes(len(idx), h)
        else:
            counts = _alloc(len(idx), rng.dirichlet(np.full(h, alpha)))
            _at_least_one(counts)
        for cid, part in zip(holders[c], _split_by_counts(idx, counts)):
            pieces[cid].append(part)
    return [_cat(p) for p in pieces]


def _draw_with_refill(rng: np.random.Generator, num_classes: int, k: int, per: int) -> list[list[int]]:
    """FedMerge's picker: draw classes without replacement from a pool refilled when exhausted.

    Unlike the author code, a cluster never gets the same class twice (a refill excludes its own classes).
    """
    pool: list[int] = []
    clusters: list[list[int]] = []
    for _ in range(k):
        chosen: list[int] = []
        while len(chosen) < per:
            avail = [c for c in pool if c not in chosen]
            if not avail:
                pool = [c for c in range(num_classes) if c not in chosen]
                avail = pool
            pick = int(avail[rng.integers(len(avail))])
            pool.remove(pick)
            chosen.append(pick)
        clusters.append(sorted(chosen))
    return clusters


def _at_least_one(counts: np.ndarray) -> None:
    """Move samples from the largest holders so that every holder gets one (when possible), in place."""
    if counts.sum() < len(counts):
        return
    while (counts < 1).any():
        counts[np.argmax(counts)] -= 1
        counts[np.argmin(counts)] += 1


def _natural(dataset: Dataset, num_clients: int | None, seed: int, opts: dict[str, Any]) -> Partition:
    """One client per user; fewer clients than users takes a seeded random subset, ordered by user id."""
    if dataset.train_groups is None:
        raise UserError(
            f"dataset {dataset.name!r} has no natural users; the natural partition needs a LEAF dataset "
            "(femnist, shakespeare)"
        )
    groups = np.asarray(dataset.train_groups)
    users = np.unique(groups)
    wanted = [int(x) for x in (num_clients, opts["max_clients"]) if x]
    k = min(wanted) if wanted else len(users)
    if k > len(users):
        raise UserError(f"dataset {dataset.name!r} has {len(users)} users; cannot make {k} natural clients")
    if k < len(users):
        users = np.sort(numpy_rng(seed, "partition", "natural").permutation(users)[:k])
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    train = [
        order[np.searchsorted(sorted_groups, u) : np.searchsorted(sorted_groups, u, "right")] for u in users
    ]
    test = None
    if dataset.test_groups is not None:
        tg = np.asarray(dataset.test_groups)
        torder = np.argsort(tg, kind="stable")
        tsorted = tg[torder]
        test = [torder[np.searchsorted(tsorted, u) : np.searchsorted(tsorted, u, "right")] for u in users]
    info: dict[str, Any] = {"users": users.tolist(), "num_users": len(np.unique(groups))}
    if dataset.group_names is not None:
        info["user_names"] = [dataset.group_names[int(u)] for u in users]
    return Partition(train, test_indices=test, info=info)


def _domain(dataset: Dataset, num_clients: int, seed: int, opts: dict[str, Any]) -> Partition:
    """Client group g holds domain g; its clients split the domain's train and test samples iid."""
    if dataset.train_domains is None:
        raise UserError(
            f"dataset {dataset.name!r} has no domains; load an image dataset with rotate_domains=k or use "
            "shakespeare's plays as domains"
        )
    domains = np.asarray(dataset.train_domains).astype(np.int64)
    ids = np.unique(domains)
    sizes = _group_sizes(opts["group_sizes"], len(ids), num_clients, "domain")
    test_domains = None if dataset.test_domains is None else np.asarray(dataset.test_domains).astype(np.int64)
    train: list[np.ndarray] = []
    test: list[np.ndarray] | None = [] if test_domains is not None else None
    groups: list[int] = []
    for g, (d, s) in enumerate(zip(ids, sizes)):
        idx = np.flatnonzero(domains == d)
        _check_enough(len(idx), int(s), f"training samples of domain {int(d)}")
        train += np.array_split(numpy_rng(seed, "partition", "domain", g).permutation(idx), int(s))
        if test is not None and test_domains is not None:
            tidx = numpy_rng(seed, "partition", "domain-test", g).permutation(
                np.flatnonzero(test_domains == d)
            )
            test += np.array_split(tidx, int(s))
        groups += [int(d)] * int(s)
    info: dict[str, Any] = {"group_sizes": sizes.tolist(), "domains": ids.tolist()}
    if dataset.domain_names is not None:
        info["domain_names"] = list(dataset.domain_names)
    return Partition(train, test_indices=test, client_groups=groups, info=info)


_PARTITIONERS: dict[str, Callable[[Dataset, Any, int, dict[str, Any]], Partition]] = {
    "iid": _iid,
    "dirichlet": _dirichlet,
    "shards": _shards,
    "label-cluster": _label_cluster,
    "natural": _natural,
    "domain": _domain,
    "contiguous": _contiguous,
}

# Flower Datasets' partitioners as partitions flwr:NAME (flwr-datasets is imported only when one is used).
from fedfuse.data.flower_partitions import register_partitions  # noqa: E402

register_partitions(PARTITIONS, _OPTIONS, _PARTITIONERS, _BOUNDS, _CHOICES)
