"""Partitions (data/partition.py): the registry and its errors, iid, Dirichlet, shards, label clusters, natural and
domain splits, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from fedfuse.data.partition import PARTITIONS, Partition, make_partition, partition_options
from support import check_disjoint, synthetic


def entropy(part: Partition, labels: np.ndarray, num_classes: int) -> float:
    ent = []
    for idx in part.train_indices:
        p = np.bincount(labels[idx], minlength=num_classes) / len(idx)
        p = p[p > 0]
        ent.append(-(p * np.log(p)).sum())
    return float(np.mean(ent))


def test_registry_and_errors() -> None:
    ds = synthetic()
    assert set(PARTITIONS) >= {
        "iid",
        "dirichlet",
        "shards",
        "label-cluster",
        "natural",
        "domain",
        "contiguous",
    }
    assert partition_options("dirichlet")["alpha"] == 0.5
    with pytest.raises(ValueError, match="valid choices"):
        make_partition("nope", ds, 5, 0)
    with pytest.raises(ValueError, match="valid options"):
        make_partition("iid", ds, 5, 0, alpha=1.0)
    with pytest.raises(ValueError, match="at most"):
        make_partition("iid", ds, 2000, 0)
    with pytest.raises(ValueError, match="classes_per_client"):
        make_partition("shards", ds, 5, 0, classes_per_client=11)


def test_iid() -> None:
    ds = synthetic(n_train=1003)
    part = make_partition("iid", ds, 10, seed=1)
    check_disjoint(part, 1003, cover=True)
    sizes = part.sizes()
    assert sizes.max() - sizes.min() <= 1
    assert part.info["name"] == "iid" and part.test_indices is None


def test_dirichlet_min_size_and_skew() -> None:
    ds = synthetic(n_train=3000)
    labels = ds.train_labels
    low = make_partition("dirichlet", ds, 20, seed=0, alpha=0.1, min_size=10)
    high = make_partition("dirichlet", ds, 20, seed=0, alpha=100.0, min_size=10)
    for p in (low, high):
        check_disjoint(p, 3000, cover=True)
        assert p.sizes().min() >= 10
    assert entropy(low, labels, 10) < entropy(high, labels, 10) - 0.3
    assert low.info["alpha"] == 0.1
    with pytest.raises(ValueError, match="min_size"):
        make_partition("dirichlet", ds, 20, seed=0, min_size=200)
    with pytest.raises(ValueError, match="smaller min_size"):
        make_partition("dirichlet", ds, 100, seed=0, alpha=0.01, min_size=29, max_attempts=3)


def test_shards() -> None:
    ds = synthetic(n_train=2000)
    labels = ds.train_labels
    part = make_partition("shards", ds, 20, seed=3, classes_per_client=3)  # 60 slots over 10 classes
    check_disjoint(part, 2000, cover=True)
    assert part.client_classes is not None
    usage = np.bincount(np.concatenate(part.client_classes), minlength=10)
    assert usage.max() - usage.min() <= 1
    for idx, classes in zip(part.train_indices, part.client_classes):
        assert len(set(classes)) == 3
        assert set(np.unique(labels[idx]).tolist()) == set(classes)


def test_label_cluster_disjoint() -> None:
    ds = synthetic(n_train=3000, num_classes=100)
    labels = ds.train_labels
    sizes = (6, 5, 8, 13, 18)
    part = make_partition("label-cluster", ds, 50, seed=0, clusters=5, group_sizes=sizes)
    check_disjoint(part, 3000, cover=True)
    assert part.client_groups == [g for g, s in enumerate(sizes) for _ in range(s)]
    clusters = part.info["clusters_classes"]
    assert sorted(c for cl in clusters for c in cl) == list(range(100))  # disjoint and complete
    assert all(len(cl) == 20 for cl in clusters)
    for idx, g, classes in zip(part.train_indices, part.client_groups, part.client_classes):
        assert classes == clusters[g]
        assert set(np.unique(labels[idx]).tolist()) <= set(clusters[g])
    with pytest.raises(ValueError, match="sum to"):
        make_partition("label-cluster", ds, 50, seed=0, group_sizes=(6, 5, 8, 13, 17))
    with pytest.raises(ValueError, match="clusters"):
        make_partition("label-cluster", synthetic(num_classes=4), 10, seed=0, clusters=5)


def test_label_cluster_overlapping() -> None:
    ds = synthetic(n_train=4000, num_classes=100)
    labels = ds.train_labels
    part = make_partition("label-cluster", ds, 50, seed=0, overlapping=True, group_sizes=(6, 5, 8, 13, 18))
    check_disjoint(part, 4000, cover=True)  # 5 × 30 ≥ 100 classes: every class is held by some cluster
    clusters = [set(c) for c in part.info["clusters_classes"]]
    assert all(len(c) == 30 for c in clusters)
    assert any(clusters[i] & clusters[j] for i in range(5) for j in range(i + 1, 5))
    for idx, g in zip(part.train_indices, part.client_groups):
        assert set(np.unique(labels[idx]).tolist()) <= clusters[g]
    with pytest.raises(ValueError, match="no cluster"):
        make_partition("label-cluster", ds, 50, seed=0, overlapping=True, classes_per_cluster=10)


def test_natural() -> None:
    ds = synthetic(users=12)
    part = make_partition("natural", ds, 0, seed=0)
    assert part.num_clients == 12 and part.test_indices is not None
    check_disjoint(part, 1000, cover=True)
    for user, tr, te in zip(part.info["users"], part.train_indices, part.test_indices):
        assert np.all(ds.train_groups[tr] == user) and np.all(ds.test_groups[te] == user)
    sub = make_partition("natural", ds, 5, seed=0)
    assert sub.num_clients == 5 and len(set(sub.info["users"])) == 5
    assert make_partition("natural", ds, 5, seed=1).info["users"] != sub.info["users"]
    with pytest.raises(ValueError, match="femnist"):
        make_partition("natural", synthetic(), 5, seed=0)
    with pytest.raises(ValueError, match="12 users"):
        make_partition("natural", ds, 20, seed=0)


def test_domain() -> None:
    ds = synthetic(domains=3)
    part = make_partition("domain", ds, 7, seed=0)
    check_disjoint(part, 1000, cover=True)
    assert part.client_groups == [0, 0, 0, 1, 1, 2, 2]
    assert part.test_indices is not None
    for g, tr, te in zip(part.client_groups, part.train_indices, part.test_indices):
        assert np.all(ds.train_domains[tr] == g) and np.all(ds.test_domains[te] == g)
    assert make_partition("domain", ds, 6, seed=0, group_sizes=[1, 2, 3]).client_groups == [0, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="rotate_domains"):
        make_partition("domain", synthetic(), 4, seed=0)
    with pytest.raises(ValueError, match="at least one client"):
        make_partition("domain", ds, 2, seed=0)


@pytest.mark.parametrize(
    ("name", "opts"),
    [
        ("iid", {}),
        ("dirichlet", {"alpha": 0.5}),
        ("shards", {}),
        ("label-cluster", {}),
        ("label-cluster", {"overlapping": True}),
        ("domain", {}),
        ("natural", {}),
    ],
)
def test_determinism(name: str, opts: dict) -> None:
    ds = synthetic(users=20, domains=2)
    k = 8 if name == "natural" else 10
    a = make_partition(name, ds, k, seed=5, **opts)
    b = make_partition(name, ds, k, seed=5, **opts)
    c = make_partition(name, ds, k, seed=6, **opts)
    assert all(np.array_equal(x, y) for x, y in zip(a.train_indices, b.train_indices))
    assert not all(np.array_equal(x, y) for x, y in zip(a.train_indices, c.train_indices))
