"""What a model declares about its own structure, so fusion operators never need to know model classes.

Two declarations, both plain data built from the model's state-dict keys:

* **Unit groups** (:class:`UnitGroups`, a model's ``unit_groups()`` method) — for width slicing
  (:mod:`fedfuse.fusion.slicing`: MSfusion, HeteroFL, FedRolex).  A *group* is a set of hidden units selected
  together (an MLP layer's neurons, a conv layer's filters, a ResNet stage's residual channels, the per-head
  units of an attention layer); ``dims[key]`` says which group indexes each dimension of every state tensor.
* **Permutation groups** (:class:`PermGroup`, a model's ``perm_groups(**options)`` method) — for neuron
  matching and permutation (:mod:`fedfuse.fusion.permute`: FedMA, Simple-FedMA).  A plain feed-forward chain
  of Linear/Conv layers needs no declaration: :func:`fedfuse.fusion.permute.chain_spec` derives its groups from
  the torch module types.

A third kind of structure needs no declaration: the model's **BatchNorm layers**, found by module type
(:func:`is_batchnorm`, :func:`batchnorm_modules`, :func:`batchnorm_keys`: FedBN keeps them on the client, HeteroFL
recomputes their statistics, SAM restores their buffers, the batched executor buckets them).

Any ``nn.Module`` may declare them (``tests/system/test_layers.py`` slices a custom module), not only fedfuse's models.
This module sits at the bottom of the layers (it imports only torch), next to :mod:`fedfuse.types`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

# A tensor dimension is either unsliced (None) or (group, outer, inner): the dimension is laid out as
# [outer][K_group][inner] (heads: outer = n_heads; a conv output flattened into a linear layer: inner = H·W).
DimSpec = tuple[str, int, int] | None
Selection = dict[str, torch.Tensor]


@dataclass(frozen=True)
class UnitGroups:
    """Unit groups (name -> size K) and, for every state key, the group of each dimension."""

    groups: dict[str, int]
    dims: dict[str, tuple[DimSpec, ...]]
    feature_group: str | None  # the group of the penultimate representation (None: not sliced, e.g. LMs)

    def full_selection(self) -> Selection:
        return {g: torch.arange(k) for g, k in self.groups.items()}


def axis(group: str, outer: int = 1, inner: int = 1) -> DimSpec:
    """A dimension indexed by ``group`` (laid out ``[outer][K][inner]``)."""
    return (group, int(outer), int(inner))


class UnitGroupBuilder:
    """Builds a :class:`UnitGroups` declaration from a state dict, layer by layer (in the model's forward order).

    ``group(name, K)`` declares a group; ``layer(prefix, out, inp)`` says which groups index a Linear/Conv
    module's output and input dimensions (``weight`` is (out, in, ...), ``bias`` (out,)); ``norm(prefix, ch)``
    attaches a normalisation module's per-channel tensors to a group.  Every key not mentioned is unsliced.
    """

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state
        self.groups: dict[str, int] = {}
        self.dims: dict[str, tuple[DimSpec, ...]] = {}

    def group(self, name: str, size: int) -> str:
        self.groups[name] = int(size)
        return name

    def layer(self, prefix: str, out: DimSpec, inp: DimSpec) -> None:
        w = self.state[prefix + ".weight"]
        self.dims[prefix + ".weight"] = (out, inp) + (None,) * (w.dim() - 2)
        if prefix + ".bias" in self.state:
            self.dims[prefix + ".bias"] = (out,)

    def norm(self, prefix: str, ch: DimSpec) -> None:
        for key in self.state:
            if key.startswith(prefix + ".") and key.count(".") == prefix.count(".") + 1:
                self.dims[key] = () if key.endswith("num_batches_tracked") else (ch,)

    def build(self, feature_group: str | None) -> UnitGroups:
        for key, t in self.state.items():  # everything else (input layer, head, ...) is unsliced
            self.dims.setdefault(key, (None,) * t.dim())
        return UnitGroups(dict(self.groups), dict(self.dims), feature_group)


@dataclass(frozen=True)
class Member:
    """One tensor axis carried by a permutation group.

    ``role``: ``"in"`` (the producing layer's own rows, e.g. weight/bias/BN affine: FedMA's atom),
    ``"stat"`` (running statistics, permuted and averaged but not part of the atom) or ``"out"`` (the
    consuming layer's input axis).
    """

    key: str
    axis: int
    block: int = 1
    role: str = "in"


@dataclass(frozen=True)
class PermGroup:
    """Tensors that share one permutation of ``size`` units (``head_dim`` > 0: units are grouped in heads)."""

    name: str
    size: int
    members: tuple[Member, ...]
    head_dim: int = 0
    by: tuple[str, ...] = ()  # keys whose unit axis determines the permutation (default: the "in" members)
    tags: dict = field(default_factory=dict, compare=False)

    def keys(self, role: str | None = None) -> list[str]:
        return [m.key for m in self.members if role is None or m.role == role]

    def determining(self) -> list[Member]:
        """Members used to compute a matching cost: ``by`` if given, else the ``in`` members."""
        if self.by:
            return [m for m in self.members if m.key in self.by]
        return [m for m in self.members if m.role == "in"]


def is_batchnorm(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm layer (1d, 2d, 3d, lazy or synchronised)."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def batchnorm_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The BatchNorm layers of ``model`` with their names, in registration order."""
    return [(name, m) for name, m in model.named_modules() if is_batchnorm(m)]


def batchnorm_keys(model: nn.Module) -> frozenset[str]:
    """Every state-dict key of ``model``'s BatchNorm layers: the affine ``weight``/``bias`` and the buffers
    ``running_mean``, ``running_var`` and ``num_batches_tracked``."""
    prefixes = tuple(f"{name}." if name else "" for name, _ in batchnorm_modules(model))
    if not prefixes:
        return frozenset()
    return frozenset(k for k in model.state_dict() if any(k.startswith(p) and "." not in k[len(p):]
                                                          for p in prefixes))


__all__ = ["DimSpec", "Member", "PermGroup", "Selection", "UnitGroupBuilder", "UnitGroups", "axis", "batchnorm_keys",
           "batchnorm_modules", "is_batchnorm"]
