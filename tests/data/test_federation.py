"""Federations (data/federation.py): per-client train/val/test splits, the partition's own tests and groups,
language-model federations, and building one fast."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from fedfuse.data.dataset import Dataset
from fedfuse.data.federation import build_federation
from fedfuse.data.partition import Partition, make_partition
from fedfuse.data.report import label_histograms, partition_table
from support import check_disjoint, synthetic


def lm_dataset(n_train: int = 200, n_test: int = 60, vocab: int = 50, length: int = 8) -> Dataset:
    g = torch.Generator().manual_seed(0)
    tr = torch.randint(0, vocab, (n_train, length + 1), generator=g)
    te = torch.randint(0, vocab, (n_test, length + 1), generator=g)
    return Dataset("toy-lm", "lm", tr[:, :-1], tr[:, 1:], te[:, :-1], te[:, 1:], vocab, (length,))




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
