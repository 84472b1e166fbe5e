"""Multi-layer perceptron (FedMA's SimpleMLP 784-20-100-120-84-10 is ``widths=(20, 100, 120, 84)``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.models.base import FedModel


class MLP(FedModel):
    """Flatten -> [Linear -> ReLU] per hidden width (``hidden.{i}``) -> Linear head ``fc``."""

    def __init__(self, in_features: int, num_classes: int, widths: Sequence[int] = (200, 200)) -> None:
        super().__init__("classification")
        dims = [int(in_features), *(int(w) for w in widths)]
        if min(dims) < 1:
            raise ValueError(f"MLP widths must be positive, got {tuple(widths)}")
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.fc = nn.Linear(dims[-1], num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1)
        for linear in self.hidden:
            x = F.relu(linear(x))
        return x
