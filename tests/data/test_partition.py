"""Partitions, per-client federation splits and partition reports."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from fedfuse.data.dataset import Dataset
from fedfuse.data.federation import build_federation
from fedfuse.data.partition import PARTITIONS, Partition, make_partition, partition_options
from fedfuse.data.report import label_histograms, partition_table, plot_partition


def synthetic(
    n_train: int = 1000,
    n_test: int = 300,
    num_classes: int = 10,
    seed: int = 0,
    users: int | None = None,
    domains: int | None = None,
) -> Dataset:
    """Random 1×4×4 images with random labels (and optional users / domains)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    ds = Dataset(
        name="synthetic",
        task="classification",
        train_x=torch.randn(n_train, 1, 4, 4, generator=g),
        train_y=torch.randint(0, num_classes, (n_train,), generator=g),
        test_x=torch.randn(n_test, 1, 4, 4, generator=g),
        test_y=torch.randint(0, num_classes, (n_test,), generator=g),
        num_classes=num_classes,
        input_shape=(1, 4, 4),
    )
    if users:
        ds.train_groups = rng.integers(0, users, n_train)
        ds.test_groups = rng.integers(0, users, n_test)
    if domains:
        ds.train_domains = rng.integers(0, domains, n_train)
        ds.test_domains = rng.integers(0, domains, n_test)
    return ds


@pytest.fixture(scope="module")
def digits() -> Dataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
    x, y = x[perm], y[perm]
    return Dataset(
        "digits",
        "classification",
        x[:1400],
        y[:1400],
        x[1400:],
        y[1400:],
        10,
        (1, 8, 8),
        class_names=[str(i) for i in range(10)],
    )


def lm_dataset(n_train: int = 200, n_test: int = 60, vocab: int = 50, length: int = 8) -> Dataset:
    g = torch.Generator().manual_seed(0)
    tr = torch.randint(0, vocab, (n_train, length + 1), generator=g)
    te = torch.randint(0, vocab, (n_test, length + 1), generator=g)
    return Dataset("toy-lm", "lm", tr[:, :-1], tr[:, 1:], te[:, :-1], te[:, 1:], vocab, (length,))


def check_disjoint(part: Partition, n: int, cover: bool) -> None:
    allidx = np.concatenate(part.train_indices)
    assert len(np.unique(allidx)) == len(allidx), "clients share samples"
    assert allidx.min() >= 0 and allidx.max() < n
    for idx in part.train_indices:
        assert idx.dtype == np.int64 and np.all(np.diff(idx) > 0)
    if cover:
        assert len(allidx) == n


def entropy(part: Partition, labels: np.ndarray, num_classes: int) -> float:
    ent = []
    for idx in part.train_indices:
        p = np.bincount(labels[idx], minlength=num_classes) / len(idx)
        p = p[p > 0]
        ent.append(-(p * np.log(p)).sum())
    return float(np.mean(ent))


# ------------------------------------------------------------------------------------------- partitions


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


def test_lm_partitions_and_federation() -> None:
    ds = lm_dataset()
    with pytest.raises(ValueError, match="contiguous"):
        make_partition("dirichlet", ds, 4, seed=0)
    part = make_partition("contiguous", ds, 4, seed=0)
    check_disjoint(part, 200, cover=True)
    assert np.array_equal(np.concatenate(part.train_indices), np.arange(200))
    fed = build_federation(ds, part, seed=0)
    assert fed.task == "lm" and [len(c.test) for c in fed.clients] == [15] * 4
    assert label_histograms(fed).shape == (4, 0)
    assert "client" in partition_table(fed)
    fed_iid = build_federation(ds, make_partition("iid", ds, 4, seed=0), seed=0)
    assert sum(len(c.test) for c in fed_iid.clients) == 60


# ------------------------------------------------------------------------------------------- federation


def test_federation_splits(digits: Dataset) -> None:
    part = make_partition("shards", digits, 10, seed=0, classes_per_client=2)
    fed = build_federation(digits, part, seed=0, val_fraction=0.1)
    assert fed.num_clients == 10 and len(fed.test) == len(digits.test_y)
    assert fed.dataset == "digits" and fed.partition == "shards" and fed.num_classes == 10
    assert fed.info["client_classes"] == part.client_classes
    ratio = len(digits.test_y) / len(digits.train_y)
    for c, idx, classes in zip(fed.clients, part.train_indices, part.client_classes):
        n = len(idx)
        assert len(c.train) + len(c.val) == n
        assert len(c.val) == max(1, round(0.1 * n))
        assert set(c.test.y.unique().tolist()) == set(classes)  # only (and all) the client's classes
        assert abs(len(c.test) - round(n * ratio)) <= len(classes)
        tr = np.bincount(c.train.y.numpy(), minlength=10) + np.bincount(c.val.y.numpy(), minlength=10)
        te = np.bincount(c.test.y.numpy(), minlength=10)
        assert np.abs(tr / tr.sum() - te / te.sum()).max() < 0.1
        assert c.train.x.is_contiguous() and c.test.x.is_contiguous()
    # train + val of every client are exactly its partition samples
    merged = torch.cat([torch.cat([c.train.y, c.val.y]) for c in fed.clients])
    assert len(merged) == len(digits.train_y)

    again = build_federation(digits, part, seed=0)
    other = build_federation(digits, part, seed=1)
    assert all(
        torch.equal(a.val.x, b.val.x) and torch.equal(a.test.y, b.test.y)
        for a, b in zip(fed.clients, again.clients)
    )
    assert not all(torch.equal(a.val.x, b.val.x) for a, b in zip(fed.clients, other.clients))

    fixed = build_federation(digits, part, seed=0, test_fraction=0.1, val_fraction=0.0)
    for c, idx in zip(fixed.clients, part.train_indices):
        assert len(c.val) == 0 and abs(len(c.test) - round(0.1 * len(idx))) <= 2


def test_federation_uses_partition_tests_and_groups() -> None:
    ds = synthetic(domains=2)
    part = make_partition("domain", ds, 4, seed=0)
    fed = build_federation(ds, part, seed=0)
    assert fed.groups() == [0, 0, 1, 1]
    assert sum(len(c.test) for c in fed.clients) == 300
    tiny = Partition([np.array([0]), np.array([1, 2])], info={"name": "custom"})
    fed2 = build_federation(ds, tiny, seed=0)
    assert len(fed2.clients[0].val) == 0 and len(fed2.clients[1].val) == 1


def test_federation_is_fast() -> None:
    n = 60_000
    ds = Dataset(
        "mnist-like",
        "classification",
        torch.zeros(n, 1, 28, 28),
        torch.from_numpy(np.random.default_rng(0).integers(0, 10, n)),
        torch.zeros(10_000, 1, 28, 28),
        torch.from_numpy(np.random.default_rng(1).integers(0, 10, 10_000)),
        10,
        (1, 28, 28),
    )
    part = make_partition("iid", ds, 100, seed=0)
    t0 = time.process_time()  # CPU time: robust to other jobs on the machine
    fed = build_federation(ds, part, seed=0)
    assert time.process_time() - t0 < 2.0
    assert fed.num_clients == 100 and len(fed.clients[0].train) == 540


# ------------------------------------------------------------------------------------------- reports


def test_reports(digits: Dataset, tmp_path) -> None:
    part = make_partition("dirichlet", digits, 12, seed=0, alpha=0.3)
    fed = build_federation(digits, part, seed=0)
    hist = label_histograms(fed)
    assert hist.shape == (12, 10) and hist.sum() == sum(len(c.train) for c in fed.clients)
    table = partition_table(fed)
    rows = table.splitlines()
    for c in fed.clients:
        assert any(r.split()[0] == str(c.cid) for r in rows[2:])
    short = partition_table(fed, max_rows=5)
    assert "more clients" in short
    png = plot_partition(fed, tmp_path / "sub" / "partition.png")
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
