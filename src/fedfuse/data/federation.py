"""Build a :class:`~fedfuse.types.Federation` from a dataset and a partition."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedfuse.data.dataset import Dataset
from fedfuse.data.partition import Partition
from fedfuse.errors import UserError
from fedfuse.rng import numpy_rng
from fedfuse.types import ClientData, Federation, Split


def build_federation(
    dataset: Dataset,
    partition: Partition,
    *,
    seed: int,
    val_fraction: float = 0.1,
    test_fraction: float | None = None,
    device: torch.device | str = "cpu",
) -> Federation:
    """Give every client its own train / validation / test split.

    * val: a seeded ``val_fraction`` of the client's partition indices (at least one sample when the client
      has two or more, and never all of them).
    * test: the partition's ``test_indices`` when it defines them (natural, domain); otherwise, for
      classification, a sample of the global test set with the client's train class proportions
      (FedMerge) of size ``round(n_client * ratio)``, ``ratio = test_fraction`` or
      ``len(test) / len(train)``, at least one sample per present class where possible (capped by what the
      test set holds; clients may share test samples); for language models a
      slice of the test windows proportional to the client's size (contiguous, or a random subset for iid).

    ``Federation.test`` is the full global test set.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if test_fraction is not None and test_fraction < 0:
        raise UserError(f"test_fraction must be >= 0, got {test_fraction}")
    n_train, n_test = len(dataset.train_y), len(dataset.test_y)
    ratio = float(test_fraction) if test_fraction is not None else n_test / max(n_train, 1)
    name = str(partition.info.get("name", ""))
    for i, idx in enumerate(partition.train_indices):
        if len(idx) and (idx.min() < 0 or idx.max() >= n_train):
            raise ValueError(f"client {i}: train indices out of range for {n_train} training samples")

    if partition.test_indices is not None:
        if len(partition.test_indices) != partition.num_clients:
            raise ValueError("partition.test_indices must have one entry per client")
        tests = [np.asarray(t, dtype=np.int64) for t in partition.test_indices]
    elif dataset.task == "lm":
        tests = _lm_tests(partition, n_test, ratio, seed, shuffle=name == "iid")
    else:
        tests = _proportional_tests(dataset, partition, ratio, seed)

    clients: list[ClientData] = []
    for cid, idx in enumerate(partition.train_indices):
        idx = np.asarray(idx, dtype=np.int64)
        tr, va = _val_split(idx, val_fraction, seed, cid)
        group = None if partition.client_groups is None else int(partition.client_groups[cid])
        both = torch.from_numpy(np.concatenate([tr, va]))
        x, y = dataset.train_x[both].to(device), dataset.train_y[both].to(device)
        t = torch.from_numpy(tests[cid])
        test = Split(dataset.test_x[t].to(device), dataset.test_y[t].to(device))
        n = len(tr)
        clients.append(ClientData(cid, Split(x[:n], y[:n]), Split(x[n:], y[n:]), test, group))

    info: dict[str, Any] = dict(partition.info)
    info.update(val_fraction=val_fraction, test_ratio=ratio, build_seed=int(seed))
    if partition.client_classes is not None:
        info["client_classes"] = [list(c) for c in partition.client_classes]
    return Federation(
        clients=clients,
        test=Split(dataset.test_x.to(device).contiguous(), dataset.test_y.to(device).contiguous()),
        num_classes=int(dataset.num_classes),
        input_shape=tuple(dataset.input_shape),
        task=dataset.task,
        dataset=dataset.name,
        partition=name,
        class_names=None if dataset.class_names is None else list(dataset.class_names),
        info=info,
    )


def _val_split(idx: np.ndarray, val_fraction: float, seed: int, cid: int) -> tuple[np.ndarray, np.ndarray]:
    n = len(idx)
    n_val = round(n * val_fraction)
    n_val = min(max(n_val, 1), n - 1) if val_fraction > 0 and n >= 2 else 0
    perm = numpy_rng(seed, "partition", "val", cid).permutation(n)
    return np.sort(idx[perm[n_val:]]), np.sort(idx[perm[:n_val]])


def _proportional_tests(dataset: Dataset, partition: Partition, ratio: float, seed: int) -> list[np.ndarray]:
    """Per client, test samples drawn with the client's train class proportions."""
    train_labels = dataset.train_labels.astype(np.int64)
    test_labels = dataset.test_labels.astype(np.int64)
    num_classes = max(
        int(dataset.num_classes), int(train_labels.max(initial=-1)) + 1, int(test_labels.max(initial=-1)) + 1
    )
    order = np.argsort(test_labels, kind="stable")
    bounds = np.searchsorted(test_labels[order], np.arange(num_classes + 1))
    available = np.diff(bounds)
    out: list[np.ndarray] = []
    for cid, idx in enumerate(partition.train_indices):
        counts = np.bincount(train_labels[idx], minlength=num_classes)
        present = (counts > 0) & (available > 0)
        m = round(len(idx) * ratio)
        want = np.zeros(num_classes, dtype=np.int64)
        if m > 0 and present.any():
            raw = counts * present / counts[present].sum() * m
            want = np.floor(raw).astype(np.int64)
            rest = m - int(want.sum())
            if rest > 0:
                want[np.argsort(-(raw - want), kind="stable")[:rest]] += 1
            want[present] = np.maximum(want[present], 1)
        want = np.minimum(want, available)
        rng = numpy_rng(seed, "partition", "test", cid)
        parts = [
            order[bounds[c] : bounds[c + 1]][rng.choice(available[c], size=want[c], replace=False)]
            for c in np.flatnonzero(want)
        ]
        out.append(np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64))
    return out


def _lm_tests(partition: Partition, n_test: int, ratio: float, seed: int, shuffle: bool) -> list[np.ndarray]:
    """Per client, a slice of the test windows proportional to its size, at the matching position."""
    sizes = partition.sizes()
    total = max(int(sizes.sum()), 1)
    pos = np.arange(n_test) if not shuffle else numpy_rng(seed, "partition", "lm-test").permutation(n_test)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = []
    for n, s in zip(sizes, starts):
        m = min(max(round(int(n) * ratio), 1 if n_test else 0), n_test)
        begin = min(round(n_test * int(s) / total), n_test - m)
        out.append(np.sort(pos[begin : begin + m]))
    return out
