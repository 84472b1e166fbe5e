"""Neuron / channel permutations applied consistently to a network's named tensors.

A hidden representation (an MLP layer's neurons, a conv layer's channels, a transformer's residual stream or
attention head dimensions) can be reordered without changing the function a network computes, provided every
tensor that produces or consumes it is reordered the same way.  A :class:`PermGroup` lists those tensors:
``(key, axis, block)`` members, where ``block > 1`` means each unit occupies ``block`` consecutive entries on
that axis (a conv channel flattened into ``H·W`` inputs of the next linear layer, a whole attention head).

Pure functions on state dicts:

* :func:`permute` — reorder a group by a permutation (``new[i] = old[perm[i]]`` on every member axis);
* :func:`scatter_units` — FedMA's patching: scatter a client's units into a wider global layer by an assignment map
  ``assign[l] = global index of local unit l`` (zeros for global units the client does not hold);
* :func:`gather` — the inverse: rebuild a client's original-size layer from a global one.

BatchNorm: a conv channel's BN ``weight``, ``bias``, ``running_mean`` and ``running_var`` are members of the
channel's group; ``num_batches_tracked`` is a scalar and never permuted.  :func:`scatter_units` fills the running
variance of absent units with 1 (a neutral BN), every other absent entry with 0.

Specs: :func:`chain_spec` derives the groups of any feed-forward chain of linear/conv layers (MLP, CNN, CIFAR
CNN, VGG; BN attached to its conv) from the torch module types alone; any other model declares its own
(``perm_groups()``, a list of :class:`~fedfuse.structure.PermGroup`: fedfuse's transformer does, with the
residual stream, per-head Q/K, V and MLP hidden, heads as whole blocks).  :func:`perm_spec` takes the
declaration when there is one.  ResNets are not chains (the residual stream ties every block of a stage); they
are not covered here.  This module never looks at a model's class or name.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from fedfuse.errors import UnsupportedModel
from fedfuse.structure import Member, PermGroup
from fedfuse.types import TensorDict


def _index(perm: torch.Tensor, block: int) -> torch.Tensor:
    if block == 1:
        return perm
    return (perm[:, None] * block + torch.arange(block, device=perm.device)).reshape(-1)


def permute(state: Mapping[str, torch.Tensor], group: PermGroup, perm: Sequence[int] | torch.Tensor) -> TensorDict:
    """A copy of ``state`` with ``group`` reordered: unit ``i`` of the result is unit ``perm[i]`` of ``state``."""
    perm = torch.as_tensor(np.asarray(perm), dtype=torch.long)
    if sorted(perm.tolist()) != list(range(group.size)):
        raise ValueError(f"{group.name}: not a permutation of {group.size} units")
    out = dict(state)
    for m in group.members:
        if m.key in out:
            t = out[m.key]
            out[m.key] = t.index_select(m.axis, _index(perm.to(t.device), m.block)).clone()
    return out


def permute_all(
    state: Mapping[str, torch.Tensor], spec: Sequence[PermGroup], perms: Mapping[str, Sequence[int]]
) -> TensorDict:
    """Apply several groups' permutations (groups are independent, so the order does not matter)."""
    out = dict(state)
    for g in spec:
        if g.name in perms:
            out = permute(out, g, perms[g.name])
    return out


def scatter_units(
    state: Mapping[str, torch.Tensor], group: PermGroup, assign: Sequence[int], size: int, roles=("in", "stat", "out")
) -> TensorDict:
    """Scatter ``group``'s units into ``size`` global slots: local unit ``l`` goes to ``assign[l]``.

    Global slots no local unit maps to are zero (``running_var``: one).  ``roles`` restricts which members
    are expanded (FedMA patches only the next layer's input, ``roles=("out",)``, when the layer itself is
    replaced by the global one).
    """
    idx = torch.as_tensor(np.asarray(assign), dtype=torch.long)
    if len(set(idx.tolist())) != len(idx):
        raise ValueError(f"{group.name}: assignment maps two local units to one global unit")
    out = dict(state)
    for m in group.members:
        if m.key not in out or m.role not in roles:
            continue
        t = out[m.key]
        shape = list(t.shape)
        shape[m.axis] = size * m.block
        fill = 1.0 if m.key.endswith("running_var") else 0.0
        new = torch.full(shape, fill, dtype=t.dtype, device=t.device)
        new.index_copy_(m.axis, _index(idx.to(t.device), m.block), t)
        out[m.key] = new
    return out


def gather(
    state: Mapping[str, torch.Tensor], group: PermGroup, assign: Sequence[int], roles=("in", "stat", "out")
) -> TensorDict:
    """The inverse of :func:`scatter_units`: local unit ``l`` takes global unit ``assign[l]`` (FedMA's rebuild)."""
    idx = torch.as_tensor(np.asarray(assign), dtype=torch.long)
    out = dict(state)
    for m in group.members:
        if m.key in out and m.role in roles:
            t = out[m.key]
            out[m.key] = t.index_select(m.axis, _index(idx.to(t.device), m.block)).clone()
    return out


# ------------------------------------------------------------------------------------------------- specs


def chain_spec(model: nn.Module) -> list[PermGroup]:
    """Permutation groups of a feed-forward chain of Linear/Conv layers (BN attached to the conv before it).

    Works for ``mlp``/``simple-mlp``, ``cnn``, ``cnn-cifar`` and ``vgg16``/``vgg16-bn``: every Linear or Conv
    layer except the last produces a group consumed by the next one; a conv feeding a Linear layer
    contributes ``in_features / channels`` consecutive inputs per channel (flattened H·W, or 1 after global
    pooling).  Raises ``ValueError`` for models that are not chains (residual, recurrent, attention).
    """
    mods = list(model.named_modules())
    if any(isinstance(m, nn.RNNBase | nn.MultiheadAttention | nn.Embedding) for _, m in mods):
        raise UnsupportedModel("chain_spec needs a feed-forward chain; use transformer_spec for transformers")
    if any("shortcut" in n or "downsample" in n for n, _ in mods):
        raise UnsupportedModel("residual networks are not chains; chain_spec does not cover them")
    chain: list[tuple[str, nn.Module, list[tuple[str, nn.Module]]]] = []
    for name, m in mods:
        if isinstance(m, nn.Linear | nn.Conv2d | nn.Conv1d):
            chain.append((name, m, []))
        elif isinstance(m, nn.modules.batchnorm._BatchNorm) and chain:
            chain[-1][2].append((name, m))
    groups: list[PermGroup] = []
    for (name, m, norms), (nname, nxt, _) in itertools.pairwise(chain):
        units = int(m.weight.shape[0])
        members = [Member(f"{name}.weight", 0)]
        if m.bias is not None:
            members.append(Member(f"{name}.bias", 0))
        for bname, bn in norms:
            if bn.affine:
                members += [Member(f"{bname}.weight", 0), Member(f"{bname}.bias", 0)]
            if bn.track_running_stats:
                members += [Member(f"{bname}.{b}", 0, role="stat") for b in ("running_mean", "running_var")]
        fan_in = int(nxt.weight.shape[1])
        if fan_in % units:
            raise ValueError(f"{nname} has {fan_in} inputs, not a multiple of {name}'s {units} units")
        members.append(Member(f"{nname}.weight", 1, fan_in // units, role="out"))
        groups.append(PermGroup(name, units, tuple(members), tags={"layer": name, "next": nname}))
    return groups


def perm_spec(model: nn.Module, **options) -> list[PermGroup]:
    """The permutation groups of ``model``: its own declaration (``model.perm_groups(**options)``, e.g. fedfuse's
    transformer) when it has one, else the groups of a feed-forward chain (:func:`chain_spec`)."""
    declare = getattr(model, "perm_groups", None)
    if declare is not None:
        return list(declare(**options))
    if options:
        raise UnsupportedModel(f"{type(model).__name__} declares no perm_groups(); options {sorted(options)} do not "
                               "apply")
    return chain_spec(model)


def transformer_spec(model: nn.Module, residual: bool | None = None) -> list[PermGroup]:
    """The permutation groups a transformer declares (``model.perm_groups(residual=...)``; fedfuse's
    :meth:`~fedfuse.models.transformer.TransformerModel.perm_groups` documents them).  Raises ``ValueError`` for
    a model that declares none."""
    declare = getattr(model, "perm_groups", None)
    if declare is None:
        raise UnsupportedModel(f"{type(model).__name__} declares no permutation groups (a perm_groups() method)")
    return list(declare(residual=residual))


def head_structured(head_perm: Sequence[int], within: Sequence[Sequence[int]], head_dim: int) -> np.ndarray:
    """The unit permutation that moves head ``head_perm[h]`` to slot ``h`` and permutes inside it by ``within[h]``.

    ``within[h]`` is applied to the moved head (indices 0..head_dim-1 of source head ``head_perm[h]``).
    """
    out = [int(head_perm[h]) * head_dim + int(j) for h in range(len(head_perm)) for j in within[h]]
    return np.asarray(out, dtype=np.int64)


def random_group_permutations(spec: Sequence[PermGroup], gen: torch.Generator) -> dict[str, np.ndarray]:
    """A valid random permutation for every group (head-structured where needed; Q/K and V of a block share
    the head order, as the attention output concatenates heads in one order)."""
    perms: dict[str, np.ndarray] = {}
    head_orders: dict[str, np.ndarray] = {}
    for g in spec:
        if g.head_dim:
            block = g.name.rsplit(".", 1)[0]
            n_heads = g.size // g.head_dim
            if block not in head_orders:
                head_orders[block] = torch.randperm(n_heads, generator=gen).numpy()
            within = [torch.randperm(g.head_dim, generator=gen).numpy() for _ in range(n_heads)]
            perms[g.name] = head_structured(head_orders[block], within, g.head_dim)
        else:
            perms[g.name] = torch.randperm(g.size, generator=gen).numpy()
    return perms


def group_sizes(spec: Sequence[PermGroup]) -> list[int]:
    return [g.size for g in spec]
