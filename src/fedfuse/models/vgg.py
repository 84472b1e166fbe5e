"""CIFAR VGG-16, with or without BatchNorm.

Convolutions: cfg 64,64,M,128,128,M,256,256,256,M,512,512,512,M,512,512,512,M (3x3, padding 1, bias),
each followed by BN (``vgg16-bn``) and ReLU, in ``body`` (an ``nn.Sequential``: ``body.0`` conv, ``body.1``
BN, ...).  Pools use ``ceil_mode`` and are followed by a global average pool, so any input of at least 1x1
works; on 32x32 this is exactly the usual network.  Classifier: ``fc_hidden=()`` (default) is the common CIFAR
head 512 -> C; ``fc_hidden=(512, 512)`` gives 512 -> 512 -> 512 -> C and ``(4096, 4096)`` FedMR's code (ReLU +
dropout between hidden layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.models.base import FedModel, as_images, norm2d, scaled

VGG16_CFG: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip


class VGG(FedModel):
    """VGG body -> global avg-pool -> ``classifier`` (optional hidden Linear+ReLU+Dropout) -> head ``fc``."""

    def __init__(
        self,
        image: tuple[int, int, int],
        num_classes: int,
        cfg: Sequence[int | str] = VGG16_CFG,
        norm: str = "none",
        width_mult: float = 1.0,
        fc_hidden: Sequence[int] = (),
        dropout: float = 0.5,
    ) -> None:
        super().__init__("classification")
        self.image = image
        body: list[nn.Module] = []
        in_channels = image[0]
        for item in cfg:
            if item == "M":
                body.append(nn.MaxPool2d(2, ceil_mode=True))
                continue
            out = scaled(int(item), width_mult)
            body.append(nn.Conv2d(in_channels, out, 3, padding=1))
            if norm != "none":
                body.append(norm2d(norm, out))
            body.append(nn.ReLU())
            in_channels = out
        self.body = nn.Sequential(*body)
        classifier: list[nn.Module] = []
        for width in fc_hidden:
            classifier += [nn.Linear(in_channels, int(width)), nn.ReLU(), nn.Dropout(dropout)]
            in_channels = int(width)
        self.classifier = nn.Sequential(*classifier)
        self.feature_dim = in_channels
        self.fc = nn.Linear(in_channels, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(as_images(x, self.image))
        return self.classifier(F.adaptive_avg_pool2d(x, 1).flatten(1))
