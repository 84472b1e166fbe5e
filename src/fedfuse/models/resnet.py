"""CIFAR-style ResNets: FedMerge's narrow ResNet-9, ResNet-18 (HeteroFL / MSfusion) and ResNet-20.

The structure is kept plain (separate conv / BN modules, no fused ops) so width-slicing methods can cut
channels: stem ``conv1``/``bn1``, stages ``layer{i}`` of :class:`BasicBlock` (``conv1, bn1, conv2, bn2`` and a
``shortcut`` = 1x1 conv + BN projection when the shape changes), global average pool, linear head ``fc``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.models.base import FedModel, as_images, norm2d
from fedfuse.structure import UnitGroupBuilder, UnitGroups, axis


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (He et al. 2016)."""

    def __init__(self, in_channels: int, channels: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm2d(norm, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = norm2d(norm, channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), norm2d(norm, channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(FedModel):
    """A CIFAR ResNet: 3x3 stem, stages of BasicBlocks (first block of a stage strided), avg-pool, linear."""

    def __init__(
        self,
        image: tuple[int, int, int],
        num_classes: int,
        stem: int,
        widths: Sequence[int],
        blocks: Sequence[int],
        strides: Sequence[int],
        norm: str = "bn",
    ) -> None:
        super().__init__("classification")
        self.image = image
        self.norm = norm
        self.conv1 = nn.Conv2d(image[0], stem, 3, stride=1, padding=1, bias=False)
        self.bn1 = norm2d(norm, stem)
        in_channels = stem
        self.num_stages = len(widths)
        for i, (width, n, stride) in enumerate(zip(widths, blocks, strides), start=1):
            stage = []
            for j in range(n):
                stage.append(BasicBlock(in_channels, width, stride if j == 0 else 1, norm))
                in_channels = width
            self.add_module(f"layer{i}", nn.Sequential(*stage))
        self.feature_dim = in_channels
        self.fc = nn.Linear(in_channels, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(as_images(x, self.image))))
        for i in range(1, self.num_stages + 1):
            x = self.get_submodule(f"layer{i}")(x)
        return F.adaptive_avg_pool2d(x, 1).flatten(1)

    def unit_groups(self) -> UnitGroups:
        """Width slicing: the stem, every block's inner width (``layer{s}.{b}.mid``) and each stage's residual
        stream; the stem, every block output and every shortcut of a stage share one group so the additions stay
        consistent (a stage keeps the stem's group when the stem feeds it without a projection)."""
        b = UnitGroupBuilder(self.state_dict())
        stem = self.conv1.out_channels
        b.group("stem", stem)
        b.layer("conv1", axis("stem"), None)
        b.norm("bn1", axis("stem"))
        stream, stream_w = "stem", stem
        for s in range(1, self.num_stages + 1):
            stage = self.get_submodule(f"layer{s}")
            width = stage[0].conv2.out_channels
            cur = stream if (width == stream_w and len(stage[0].shortcut) == 0) else f"layer{s}"
            b.groups.setdefault(cur, width)
            for i, block in enumerate(stage):
                p = f"layer{s}.{i}"
                mid = b.group(f"{p}.mid", block.conv1.out_channels)
                b.layer(f"{p}.conv1", axis(mid), axis(stream))
                b.norm(f"{p}.bn1", axis(mid))
                b.layer(f"{p}.conv2", axis(cur), axis(mid))
                b.norm(f"{p}.bn2", axis(cur))
                if len(block.shortcut):
                    b.layer(f"{p}.shortcut.0", axis(cur), axis(stream))
                    b.norm(f"{p}.shortcut.1", axis(cur))
                stream, stream_w = cur, width
        b.layer("fc", None, axis(stream))
        return b.build(stream)
