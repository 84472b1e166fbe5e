"""Small convolutional networks: McMahan et al. (2017)'s CNN, FedMR's LeNet-style CIFAR CNN and the FedMR
authors' FEMNIST / Fashion-MNIST CNN."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.errors import UserError
from fedfuse.models.base import FedModel, as_images
from fedfuse.structure import UnitGroupBuilder, UnitGroups, axis


def _conv_pool_size(size: int, kernel: int, padding: int) -> int:
    """Spatial size after a stride-1 conv and a 2x2 max-pool (floor)."""
    return (size + 2 * padding - kernel + 1) // 2


def _two_conv_pool_out(image: tuple[int, int, int], name: str, padding: int | None) -> tuple[int, int, int]:
    """(padding, height, width) after two 5x5 conv + 2x2 max-pool stages.

    ``padding=None`` picks 0 (the original models) when the input is large enough and 2 ('same') otherwise.
    """
    _, h, w = image

    def out_size(pad: int) -> tuple[int, int]:
        hh, ww = h, w
        for _ in range(2):
            hh, ww = _conv_pool_size(hh, 5, pad), _conv_pool_size(ww, 5, pad)
        return hh, ww

    if padding is None:
        padding = 0 if min(out_size(0)) >= 1 else 2
    oh, ow = out_size(padding)
    if min(oh, ow) < 1:
        raise UserError(f"input {image} is too small for {name} with padding={padding}")
    return padding, oh, ow


def _conv_fc_groups(model: nn.Module, hidden: Sequence[str]) -> UnitGroups:
    """The unit groups of two convolutions followed by the fully connected ``hidden`` layers and the head ``fc``:
    conv1 and conv2 filters and each hidden layer's neurons, one group each (a conv2 filter feeds the H·W
    inputs of the first hidden layer that its feature map flattens to); the last hidden layer is the feature."""
    conv2, first = model.conv2, getattr(model, hidden[0])
    b = UnitGroupBuilder(model.state_dict())
    b.group("conv1", model.conv1.out_channels)
    b.group("conv2", conv2.out_channels)
    for name in hidden:
        b.group(name, getattr(model, name).out_features)
    b.layer("conv1", axis("conv1"), None)
    b.layer("conv2", axis("conv2"), axis("conv1"))
    b.layer(hidden[0], axis(hidden[0]), axis("conv2", 1, first.in_features // conv2.out_channels))
    for prev, name in itertools.pairwise(hidden):
        b.layer(name, axis(name), axis(prev))
    b.layer("fc", None, axis(hidden[-1]))
    return b.build(hidden[-1])


class CNN(FedModel):
    """McMahan et al. 2017: conv5x5 32 -> ReLU -> pool -> conv5x5 64 -> ReLU -> pool -> fc 512 -> ReLU -> fc.

    Convolutions use 'same' padding (as in the paper's TensorFlow code), so 8x8 inputs work too.  With MNIST
    (1x28x28) and 10 classes this has 1,663,370 parameters.
    """

    def __init__(
        self,
        image: tuple[int, int, int],
        num_classes: int,
        channels: Sequence[int] = (32, 64),
        hidden: int = 512,
        kernel_size: int = 5,
    ) -> None:
        super().__init__("classification")
        if len(channels) != 2:
            raise UserError(f"cnn needs two conv widths, got {tuple(channels)}")
        c, h, w = image
        self.image = image
        pad = kernel_size // 2
        self.conv1 = nn.Conv2d(c, channels[0], kernel_size, padding=pad)
        self.conv2 = nn.Conv2d(channels[0], channels[1], kernel_size, padding=pad)
        for _ in range(2):
            h, w = _conv_pool_size(h, kernel_size, pad), _conv_pool_size(w, kernel_size, pad)
        if min(h, w) < 1:
            raise UserError(f"input {image} is too small for cnn (needs H, W >= 4)")
        self.fc1 = nn.Linear(channels[1] * h * w, hidden)
        self.fc = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = as_images(x, self.image)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return F.relu(self.fc1(x.flatten(1)))

    def unit_groups(self) -> UnitGroups:
        """Width slicing: conv1 and conv2 filters, fc1 neurons (a conv2 filter feeds H·W inputs of fc1)."""
        return _conv_fc_groups(self, ("fc1",))

    @staticmethod
    def width_options(sizes: Sequence[int]) -> dict | None:
        """``model_options`` for conv widths ``sizes[:2]`` and hidden width ``sizes[2]`` (None: not 3 sizes)."""
        sizes = [int(s) for s in sizes]
        return {"channels": sizes[:2], "hidden": sizes[2]} if len(sizes) == 3 else None


class CifarCNN(FedModel):
    """FedMR's CIFAR CNN (LeNet-5 style): conv5x5 6 -> pool -> conv5x5 16 -> pool -> fc 120 -> fc 84 -> fc C.

    ``padding=None`` picks 0 (the original, 62,006 parameters on 3x32x32 with 10 classes) when the input is
    large enough and 2 ('same') otherwise, so 8x8 inputs work.
    """

    def __init__(
        self,
        image: tuple[int, int, int],
        num_classes: int,
        channels: Sequence[int] = (6, 16),
        hidden: Sequence[int] = (120, 84),
        padding: int | None = None,
    ) -> None:
        super().__init__("classification")
        if len(channels) != 2 or len(hidden) != 2:
            raise UserError("cnn-cifar needs two conv widths and two hidden widths")
        c = image[0]
        self.image = image
        padding, oh, ow = _two_conv_pool_out(image, "cnn-cifar", padding)
        self.conv1 = nn.Conv2d(c, channels[0], 5, padding=padding)
        self.conv2 = nn.Conv2d(channels[0], channels[1], 5, padding=padding)
        self.fc1 = nn.Linear(channels[1] * oh * ow, hidden[0])
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.fc = nn.Linear(hidden[1], num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = as_images(x, self.image)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return F.relu(self.fc2(x))

    def unit_groups(self) -> UnitGroups:
        """Width slicing: conv1 and conv2 filters, fc1 and fc2 neurons (a conv2 filter feeds H·W inputs of fc1)."""
        return _conv_fc_groups(self, ("fc1", "fc2"))

    @staticmethod
    def width_options(sizes: Sequence[int]) -> dict | None:
        """``model_options`` for conv widths ``sizes[:2]`` and hidden widths ``sizes[2:]`` (None: not 4 sizes)."""
        sizes = [int(s) for s in sizes]
        return {"channels": sizes[:2], "hidden": sizes[2:]} if len(sizes) == 4 else None


class FemnistCNN(FedModel):
    """The FedMR/FedMut authors' FEMNIST and Fashion-MNIST CNN (``CNNFashionMnist`` in their ``models/Nets.py``).

    conv5x5 16 -> max-pool 2 -> ReLU -> conv5x5 32 -> max-pool 2 -> ReLU -> fc 256 -> ReLU -> fc C, no padding.
    On 1x28x28 inputs the flattened feature is 32x4x4 = 512 wide; with 62 classes the model has 160,510
    parameters (10 classes: 147,146).  The authors' class also creates a ``Dropout2d`` that its forward pass
    never calls, so there is no dropout here.  ``padding=None`` picks 0 (the original) when the input is large
    enough and 2 ('same') otherwise, so 8x8 inputs work too.
    """

    def __init__(
        self,
        image: tuple[int, int, int],
        num_classes: int,
        channels: Sequence[int] = (16, 32),
        hidden: int = 256,
        padding: int | None = None,
    ) -> None:
        super().__init__("classification")
        if len(channels) != 2:
            raise UserError(f"cnn-femnist needs two conv widths, got {tuple(channels)}")
        c = image[0]
        self.image = image
        padding, h, w = _two_conv_pool_out(image, "cnn-femnist", padding)
        self.conv1 = nn.Conv2d(c, channels[0], 5, padding=padding)
        self.conv2 = nn.Conv2d(channels[0], channels[1], 5, padding=padding)
        self.fc1 = nn.Linear(channels[1] * h * w, hidden)
        self.fc = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = as_images(x, self.image)
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return F.relu(self.fc1(x.flatten(1)))

    def unit_groups(self) -> UnitGroups:
        """Width slicing: conv1 and conv2 filters, fc1 neurons (a conv2 filter feeds H·W inputs of fc1)."""
        return _conv_fc_groups(self, ("fc1",))

    width_options = staticmethod(CNN.width_options)  # the same options: two conv widths and one hidden width
