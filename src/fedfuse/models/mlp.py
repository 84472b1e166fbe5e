"""Multi-layer perceptron (FedMA's SimpleMLP 784-20-100-120-84-10 is ``widths=(20, 100, 120, 84)``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.errors import UserError
from fedfuse.models.base import FedModel
from fedfuse.structure import UnitGroupBuilder, UnitGroups, axis


class MLP(FedModel):
    """Flatten -> [Linear -> ReLU] per hidden width (``hidden.{i}``) -> Linear head ``fc``."""

    def __init__(self, in_features: int, num_classes: int, widths: Sequence[int] = (200, 200)) -> None:
        super().__init__("classification")
        dims = [int(in_features), *(int(w) for w in widths)]
        if min(dims) < 1:
            raise UserError(f"MLP widths must be positive, got {tuple(widths)}")
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.fc = nn.Linear(dims[-1], num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)  # also an empty batch (a DP-SGD Poisson batch may be): reshape(0, -1) is ambiguous
        for linear in self.hidden:
            x = F.relu(linear(x))
        return x

    def unit_groups(self) -> UnitGroups:
        """Width slicing: one group per hidden layer (``hidden.{i}``); input and head are not split."""
        b = UnitGroupBuilder(self.state_dict())
        prev = None
        for i, lin in enumerate(self.hidden):
            b.group(f"hidden.{i}", lin.out_features)
            b.layer(f"hidden.{i}", axis(f"hidden.{i}"), prev)
            prev = axis(f"hidden.{i}")
        b.layer("fc", None, prev)
        return b.build(f"hidden.{len(self.hidden) - 1}")

    @staticmethod
    def width_options(sizes: Sequence[int]) -> dict | None:
        """``model_options`` rebuilding the MLP with hidden widths ``sizes`` (one per permutation group)."""
        return {"widths": [int(s) for s in sizes]}
