"""Fixtures of the data tests: the bundled digits as a Dataset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfuse.data.dataset import Dataset


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
