"""The model base class and the structure every fusion method relies on.

A :class:`FedModel` is an ordinary ``nn.Module`` that also says

* which state-dict keys form its classification head (:meth:`FedModel.head_keys`; FedMerge's inner product),
* how its state splits into module-level layers, input to output (:meth:`FedModel.layers`; FedMR recombines
  layers, FedMA matches neurons layer by layer, MSfusion slices hidden widths),
* what its penultimate representation is (:meth:`FedModel.features`; MOON-style contrastive losses, pFedMoE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from fedfuse.errors import UserError

NORMS = ("bn", "bn-static", "none")


@dataclass(frozen=True)
class Layer:
    """A module-level unit of a model's state, in input-to-output order.

    ``keys`` holds *all* state-dict keys of the unit: parameters and persistent buffers (a BatchNorm's
    ``running_mean``, ``running_var`` and ``num_batches_tracked`` stay with its ``weight`` and ``bias``).
    """

    name: str
    keys: tuple[str, ...]
    kind: str


def module_kind(module: nn.Module) -> str:
    """The layer kind of ``module``: linear, conv, bn, ln, gn, embedding, rnn, attention, or its own tag."""
    kinds: tuple[tuple[type[nn.Module], str], ...] = (
        (nn.Linear, "linear"),
        (nn.modules.conv._ConvNd, "conv"),
        (nn.modules.batchnorm._BatchNorm, "bn"),
        (nn.LayerNorm, "ln"),
        (nn.GroupNorm, "gn"),
        (nn.Embedding, "embedding"),
        (nn.RNNBase, "rnn"),
        (nn.MultiheadAttention, "attention"),
    )
    for cls, kind in kinds:
        if isinstance(module, cls):
            return kind
    return str(getattr(module, "layer_kind", type(module).__name__.lower()))


class FedModel(nn.Module):
    """Base class of every fedfuse model.

    Subclasses implement :meth:`features` (input -> penultimate representation) and name their head module in
    ``head_name``; ``forward`` is ``head(features(x))``.  Register submodules in forward order: the default
    :meth:`layers` follows registration order.
    """

    head_name: ClassVar[str] = "fc"

    def __init__(self, task: str = "classification") -> None:
        super().__init__()
        self.task = task
        # Filled in by build_model so a model can be rebuilt (e.g. at another width).
        self.name = ""
        self.options: dict[str, Any] = {}
        self.input_shape: tuple[int, ...] = ()
        self.num_classes = 0

    @property
    def head(self) -> nn.Module:
        """The classification head (final linear / decoder)."""
        return self.get_submodule(self.head_name)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate representation, the head's input: (B, D), or (B, L, D) for per-token (LM) models."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits: (B, C), or (B, L, V) for language models."""
        return self.head(self.features(x))

    def features_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both the representation and the logits from one forward pass."""
        z = self.features(x)
        return z, self.head(z)

    def head_keys(self) -> list[str]:
        """State-dict keys (parameters and buffers) of the classification head."""
        prefix = self.head_name + "."
        return [k for k in self.state_dict(keep_vars=True) if k.startswith(prefix)]

    def layer_kind(self, name: str, module: nn.Module) -> str:
        """Kind of the layer owned by ``module`` (override to tag special layers)."""
        return module_kind(module)

    def layers(self) -> list[Layer]:
        """Every state-dict key, grouped by owning module, in registration (= forward) order.

        A key that aliases a tensor already seen (tied weights, e.g. a decoder tied to the embedding) goes
        into the layer of its first owner, so tied tensors always travel together.
        """
        state = self.state_dict(keep_vars=True)
        groups: dict[str, list[str]] = {}
        owner_of: dict[int, str] = {}
        for key, tensor in state.items():
            owner = owner_of.setdefault(id(tensor), key.rpartition(".")[0])
            groups.setdefault(owner, []).append(key)
        return [
            Layer(name, tuple(keys), self.layer_kind(name, self.get_submodule(name)))
            for name, keys in groups.items()
        ]


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of (distinct) parameters; tied parameters count once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def layer_index(model: FedModel) -> dict[str, int]:
    """Map each state-dict key to the position of its layer in ``model.layers()``."""
    return {key: i for i, layer in enumerate(model.layers()) for key in layer.keys}


# ---------------------------------------------------------------------------------------------------------
# Small helpers shared by the model files.


def scaled(channels: int, width_mult: float) -> int:
    """Width ``channels`` scaled by ``width_mult``, rounded up (HeteroFL convention), at least 1."""
    if width_mult <= 0:
        raise UserError(f"width_mult must be > 0, got {width_mult}")
    return max(1, math.ceil(channels * width_mult - 1e-9))


def image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(C, H, W) for an image model: (C,H,W) as is, (H,W) -> (1,H,W), a square (F,) -> (1,√F,√F)."""
    if len(input_shape) == 3:
        c, h, w = input_shape
        return int(c), int(h), int(w)
    if len(input_shape) == 2:
        return 1, int(input_shape[0]), int(input_shape[1])
    if len(input_shape) == 1:
        side = math.isqrt(int(input_shape[0]))
        if side * side == input_shape[0]:
            return 1, side, side
    raise UserError(f"an image model needs input_shape (C, H, W) (or a square (F,)), got {input_shape}")


def as_images(x: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """View a batch as (B, C, H, W) (accepts flat (B, C·H·W) batches)."""
    return x.reshape(x.shape[0], *shape)


def norm2d(norm: str, channels: int) -> nn.Module:
    """2-d normalisation: "bn", "bn-static" (no running statistics, HeteroFL's static BN) or "none"."""
    if norm == "bn":
        return nn.BatchNorm2d(channels)
    if norm == "bn-static":
        return nn.BatchNorm2d(channels, track_running_stats=False)
    if norm == "none":
        return nn.Identity()
    raise UserError(f"unknown norm {norm!r}; choose one of {NORMS}")


def check_task(task: str, allowed: tuple[str, ...], model: str) -> None:
    if task not in allowed:
        raise UserError(f"model {model!r} supports task(s) {allowed}, got {task!r}")
