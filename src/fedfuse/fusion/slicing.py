"""Width slicing: hidden-unit index sets, sub-model extraction / write-back, and holder-averaging.

A *unit group* is a set of hidden units that must be selected together: the output neurons of an MLP layer,
the filters of a conv layer, the channels of a ResNet stage's residual stream (the stem, every block output
and every shortcut of a stage share one group so the additions stay consistent), the per-head units of an
attention layer (the same within-head positions in every head of Q, K, V and the input columns of the output
projection), or the hidden units of a transformer feed-forward net.  Input and output layers are never split;
a layer's input dimension follows the previous group's selection.

:func:`slice_spec` returns the model's own declaration (``model.unit_groups()``, a
:class:`fedfuse.structure.UnitGroups`): for every state-dict key (parameters *and* buffers), which group indexes
each tensor dimension.  This module never looks at a model's class; fedfuse's ``MLP``, ``CNN`` (McMahan),
``ResNet`` (incl. resnet18) and ``TransformerModel`` declare their groups, and so can any user model.
A selection is ``{group: LongTensor of global unit indices}``; from it
:func:`dim_indices` gives the global index list of every dimension of every tensor (unsliced dimensions get
``arange``).  All fusion operators below are pure functions on named tensors built on one primitive,
:func:`accumulate`, which scatters a source tensor (with its global index lists) into a target tensor
(with its own index lists), adding where both hold an element.

BatchNorm: ``running_mean`` / ``running_var`` are per-channel and are sliced, written back and averaged exactly
like the channel's weights.  ``num_batches_tracked`` is a scalar counter: every operator takes the **max** over
the holders (never an average of integers); an element nobody holds keeps its previous value.

Sub-models are real, smaller ``nn.Module`` s (:func:`build_submodel`): the FLOPs and memory of local training
shrink.  The model classes have no per-layer width option, so the builder here deep-copies a full model once
per width signature and swaps every tensor for one of the sliced shape (the cached skeleton is then only
``load_state_dict``-ed).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from fedfuse.errors import UnsupportedModel
from fedfuse.structure import DimSpec, Selection, UnitGroups
from fedfuse.types import TensorDict

SliceSpec = UnitGroups  # the declaration a sliceable model returns from ``unit_groups()``


# ---------------------------------------------------------------------------------------------------------
# Index sets: DSS (MSfusion Eq. 3-4), static (HeteroFL), rolling (FedRolex)


def split_size(k: int, mu: float, rounding: str = "floor") -> int:
    """Units kept of a layer of ``k``: ⌊μK⌋ (MSfusion Eq. 4) or ⌈μK⌉ (HeteroFL); at least 1, at most K."""
    raw = mu * k
    n = math.floor(raw + 1e-9) if rounding == "floor" else math.ceil(raw - 1e-9)
    return int(min(max(n, 1), k))


def dss_start(k: int, n: int, num: int, c: float, r: int, zeta: int = 1) -> int:
    """G_{n,i,r} = ⌊n·G_i⌋ + r·ζ mod K with G_i = K·c/N (Eq. 3); the floor is taken of n·G_i, not of G_i."""
    return (math.floor(n * k * c / num + 1e-9) + r * zeta) % k


def dss_indices(k: int, mu: float, n: int, num: int, c: float, r: int, zeta: int = 1) -> torch.Tensor:
    """φ_{n,i}^{(r)} of Eq. 4: ⌊μ_n K⌋ consecutive indices from G_{n,i,r}, wrapping around K (Eq. 4 order)."""
    start = dss_start(k, n, num, c, r, zeta)
    return (start + torch.arange(split_size(k, mu, "floor"))) % k


def static_indices(k: int, mu: float) -> torch.Tensor:
    """HeteroFL: the first ⌈μK⌉ units."""
    return torch.arange(split_size(k, mu, "ceil"))


def rolling_indices(k: int, mu: float, t: int) -> torch.Tensor:
    """FedRolex: ``roll(arange(K), t)[:⌈μK⌉]`` (the window's start moves down one unit per round, wraps)."""
    return torch.roll(torch.arange(k), t % k)[: split_size(k, mu, "ceil")]


def selection(spec: SliceSpec, fn) -> Selection:
    """``{group: fn(K_group)}`` for every group of ``spec``."""
    return {g: torch.as_tensor(fn(k), dtype=torch.long) for g, k in spec.groups.items()}


def widths_of(sel: Mapping[str, torch.Tensor]) -> dict[str, int]:
    return {g: int(v.numel()) for g, v in sel.items()}


# ---------------------------------------------------------------------------------------------------------
# Model structure


def slice_spec(model: nn.Module) -> SliceSpec:
    """The unit groups ``model`` declares (its ``unit_groups()`` method; see :mod:`fedfuse.structure`)."""
    declare = getattr(model, "unit_groups", None)
    if declare is None:
        raise UnsupportedModel(f"width slicing needs a model that declares its unit groups (a unit_groups() method, "
                               f"see fedfuse.structure); {type(model).__name__} does not (fedfuse's MLP, CNNs, ResNet "
                               "and TransformerModel do)")
    spec = declare()
    if not isinstance(spec, UnitGroups):
        raise UnsupportedModel(f"{type(model).__name__}.unit_groups() must return a fedfuse.structure.UnitGroups")
    return spec


def global_indices(dim: DimSpec, sel: Mapping[str, torch.Tensor], size: int) -> torch.Tensor:
    """Global indices along one tensor dimension of full size ``size`` for selection ``sel``."""
    if dim is None:
        return torch.arange(size)
    group, outer, inner = dim
    idx = sel[group].long()
    k = size // (outer * inner)
    o = torch.arange(outer).view(-1, 1, 1) * (k * inner)
    i = torch.arange(inner).view(1, 1, -1)
    return (o + idx.view(1, -1, 1) * inner + i).reshape(-1)


def dim_indices(spec: SliceSpec, sel: Mapping[str, torch.Tensor], key: str, full_shape: Sequence[int]):
    """Per-dimension global index lists of ``key`` under selection ``sel``."""
    return [global_indices(d, sel, int(s)) for d, s in zip(spec.dims[key], full_shape)]


# ---------------------------------------------------------------------------------------------------------
# Pure operators on named tensors


def _take(t: torch.Tensor, pos: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``t`` restricted to positions ``pos[d]`` along every dimension ``d`` (``None``: the whole dimension)."""
    for d, p in enumerate(pos):
        if p is not None:
            t = t.index_select(d, p.to(t.device))
    return t


def slice_state(full: Mapping[str, torch.Tensor], spec: SliceSpec, sel: Mapping[str, torch.Tensor]) -> TensorDict:
    """The sub-model's state: every tensor restricted to the selected units (copies)."""
    return {k: _take(v, dim_indices(spec, sel, k, v.shape)).clone() for k, v in full.items()}


def _positions(src_idx: torch.Tensor, tgt_idx: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (in source, in target) of the global indices both lists hold, in source order."""
    where = torch.full((size,), -1, dtype=torch.long)
    where[tgt_idx] = torch.arange(tgt_idx.numel())
    tgt = where[src_idx]
    keep = tgt >= 0
    return torch.nonzero(keep).flatten(), tgt[keep]


#: per unit group, (positions in the source's units, positions in the target's units) of the units both hold
GroupPositions = dict[str, tuple[np.ndarray, np.ndarray]]


def _index_array(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.int64, copy=False)


def _np_positions(src_idx: np.ndarray, tgt_idx: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_positions` on index arrays (NumPy: a microsecond a step where a small torch op costs ~10)."""
    where = np.full(size, -1, dtype=np.int64)
    where[tgt_idx] = np.arange(tgt_idx.size, dtype=np.int64)
    tgt = where[src_idx]
    keep = np.flatnonzero(tgt >= 0)
    return keep, tgt[keep]


def group_positions(spec: SliceSpec, src: Mapping[str, torch.Tensor], tgt: Mapping[str, torch.Tensor]
                    ) -> GroupPositions:
    """:func:`_positions` of every unit group, computed once per (source, target) pair: every dimension of every
    tensor indexed by a group derives its positions from these (:func:`dim_positions`)."""
    return {g: _np_positions(_index_array(src[g]), _index_array(tgt[g]), k) for g, k in spec.groups.items()}


def _dim_positions(spec: SliceSpec, key: str, gpos: GroupPositions, src: Mapping[str, torch.Tensor],
                   tgt: Mapping[str, torch.Tensor]) -> tuple[list[np.ndarray | None], list[np.ndarray | None]]:
    spos: list[np.ndarray | None] = []
    tpos: list[np.ndarray | None] = []
    for dim in spec.dims[key]:
        if dim is None:
            spos.append(None)
            tpos.append(None)
            continue
        group, outer, inner = dim
        ps, pt = gpos[group]
        if outer == 1 and inner == 1:
            spos.append(ps)
            tpos.append(pt)
            continue
        o = np.arange(outer, dtype=np.int64).reshape(-1, 1, 1)
        i = np.arange(inner, dtype=np.int64).reshape(1, 1, -1)
        spos.append((o * (src[group].numel() * inner) + ps.reshape(1, -1, 1) * inner + i).reshape(-1))
        tpos.append((o * (tgt[group].numel() * inner) + pt.reshape(1, -1, 1) * inner + i).reshape(-1))
    return spos, tpos


def dim_positions(spec: SliceSpec, key: str, gpos: GroupPositions, src: Mapping[str, torch.Tensor],
                  tgt: Mapping[str, torch.Tensor]) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Per dimension of ``key``, the positions (in the source's, in the target's sliced tensor) of the elements
    both hold; ``None`` for an unsliced dimension (every position, on both sides).

    Equal to :func:`_positions` of the two :func:`dim_indices` lists, without building them: a dimension
    ``(group, outer, inner)`` holds global element ``o·K·inner + unit·inner + i``, so a common unit at positions
    (p, q) gives source position ``o·|src|·inner + p·inner + i`` and target position ``o·|tgt|·inner + q·inner + i``
    (in source order, as :func:`_positions` returns them)."""
    spos, tpos = _dim_positions(spec, key, gpos, src, tgt)
    as_t = [None if p is None else torch.from_numpy(p) for p in spos]
    return as_t, [None if p is None else torch.from_numpy(p) for p in tpos]


def _flat(pos: Sequence[np.ndarray | None], shape: Sequence[int]) -> np.ndarray:
    """Row-major flat indices of the grid ``pos[0] × pos[1] × …`` in a contiguous array of ``shape``."""
    flat = np.zeros((), dtype=np.int64)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        p = np.arange(shape[d], dtype=np.int64) if pos[d] is None else pos[d]
        view = [1] * len(shape)
        view[d] = -1
        flat = flat + p.reshape(view) * stride
        stride *= int(shape[d])
    return flat.reshape(-1)


def _as_array(t: torch.Tensor) -> np.ndarray:
    """A CPU NumPy view of ``t`` (float64 for dtypes NumPy lacks, e.g. bfloat16: exact)."""
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.double()
    return t.contiguous().numpy()


def accumulate(
    total: torch.Tensor,
    count: torch.Tensor,
    src: torch.Tensor,
    src_idx: Sequence[torch.Tensor],
    tgt_idx: Sequence[torch.Tensor],
    full_shape: Sequence[int],
) -> None:
    """Add ``src`` into ``total`` (and 1 into ``count``) where source and target hold the same global element.

    Integer tensors (``num_batches_tracked``) take the max instead of a sum.
    """
    if not src.dim():  # a scalar (num_batches_tracked, or a 0-d parameter)
        if total.is_floating_point():
            total += src.to(total.dtype)
        else:
            total.copy_(torch.maximum(total, src.to(total.dtype)))
        count += 1
        return
    spos, tpos = zip(*(_positions(s, t, n) for s, t, n in zip(src_idx, tgt_idx, full_shape)))
    if any(p.numel() == 0 for p in spos):
        return
    vals = _take(src, spos).to(total.dtype)
    grid = torch.meshgrid(*tpos, indexing="ij")
    if total.is_floating_point():
        total.index_put_(grid, vals, accumulate=True)
    else:  # integer counters: max over holders (counters are >= 0, total starts at 0)
        total[grid] = torch.maximum(total[grid], vals)
    count.index_put_(grid, torch.ones_like(vals, dtype=count.dtype), accumulate=True)


def combine(
    base: Mapping[str, torch.Tensor],
    base_sel: Mapping[str, torch.Tensor],
    spec: SliceSpec,
    shapes: Mapping[str, Sequence[int]],
    sources: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]],
    restrict: Sequence[Mapping[str, Sequence[torch.Tensor | None]] | None] | None = None,
) -> tuple[TensorDict, TensorDict]:
    """Element-wise unweighted average over the sources that hold each element of the target.

    ``base`` is the target's current state (under selection ``base_sel``; full model: the full selection);
    ``sources`` are ``(state, selection)`` pairs.  An element held by no source keeps its ``base`` value;
    ``num_batches_tracked`` takes the max over holders.  ``restrict[j][key]`` may narrow source ``j``'s global
    indices per dimension (``None`` = no narrowing), e.g. HeteroFL's classifier rows of the client's classes.
    Returns (new state, holder counts).
    """
    out: TensorDict = {}
    counts: TensorDict = {}
    gpos = [group_positions(spec, sel, base_sel) for _, sel in sources]
    for key, b in base.items():
        full_shape = shapes[key]
        if b.dim() and b.is_floating_point() and not (restrict and any((r or {}).get(key) for r in restrict)):
            out[key], counts[key] = _average_onto(b, key, spec, base_sel, sources, gpos)
            continue
        total = torch.zeros(b.shape, dtype=b.dtype if not b.is_floating_point() else torch.float64, device=b.device)
        cnt = torch.zeros(b.shape, dtype=torch.long, device=b.device)
        for j, (st, sel) in enumerate(sources):
            if key not in st:
                continue
            narrow = (restrict[j] or {}).get(key) if restrict else None
            if narrow is None:
                accumulate(total, cnt, st[key], dim_indices(spec, sel, key, full_shape),
                           dim_indices(spec, base_sel, key, full_shape), full_shape)
                continue
            src = dim_indices(spec, sel, key, full_shape)
            pos = []
            for d, nar in enumerate(narrow):
                if nar is None:
                    pos.append(torch.arange(src[d].numel()))
                else:
                    keep = torch.isin(src[d], nar.long())
                    pos.append(torch.nonzero(keep).flatten())
                    src[d] = src[d][keep]
            accumulate(total, cnt, _take(st[key], pos), src, dim_indices(spec, base_sel, key, full_shape),
                       full_shape)
        if b.is_floating_point():
            avg = (total / cnt.clamp_min(1).to(total.dtype)).to(b.dtype)
            out[key] = torch.where(cnt > 0, avg, b)
        else:
            out[key] = torch.where(cnt > 0, total.to(b.dtype), b)
        counts[key] = cnt
    return out, counts


def _average_onto(b: torch.Tensor, key: str, spec: SliceSpec, base_sel: Mapping[str, torch.Tensor],
                  sources: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]],
                  gpos: Sequence[GroupPositions]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`combine` of one floating tensor without narrowing: every source's common elements gathered by flat
    position, summed in float64 in source order (``bincount`` adds sequentially, as one ``index_add_`` per source
    would) and divided by the holder count; unheld elements keep ``b``'s value."""
    flats, vals = [], []
    for (st, sel), gp in zip(sources, gpos):
        if key not in st:
            continue
        spos, tpos = _dim_positions(spec, key, gp, sel, base_sel)
        if any(p is not None and p.size == 0 for p in spos):
            continue
        src = _as_array(st[key]).reshape(-1)
        if all(p is None for p in spos):  # an unsliced tensor: every element, in order
            flats.append(np.arange(b.numel(), dtype=np.int64))
            vals.append(src)
        else:
            flats.append(_flat(tpos, b.shape))
            vals.append(src[_flat(spos, st[key].shape)])
    n = b.numel()
    if flats:
        flat = np.concatenate(flats)
        total = np.bincount(flat, weights=np.concatenate(vals).astype(np.float64, copy=False), minlength=n)
        cnt = torch.from_numpy(np.bincount(flat, minlength=n)).view(b.shape).to(b.device)
    else:
        total, cnt = np.zeros(n), torch.zeros(b.shape, dtype=torch.long, device=b.device)
    total_t = torch.from_numpy(total).view(b.shape).to(b.device)
    avg = (total_t / cnt.clamp_min(1).to(total_t.dtype)).to(b.dtype)
    return torch.where(cnt > 0, avg, b), cnt


def write_back(
    full: Mapping[str, torch.Tensor], sub: Mapping[str, torch.Tensor], spec: SliceSpec, sel: Mapping[str, torch.Tensor]
) -> TensorDict:
    """The full state with the sub-model's elements replaced (all other elements unchanged)."""
    out: TensorDict = {}
    for key, f in full.items():
        t = f.clone()
        pos = dim_indices(spec, sel, key, f.shape)
        if f.dim():
            t[torch.meshgrid(*pos, indexing="ij")] = sub[key].to(t.dtype)
        else:
            t = sub[key].clone()
        out[key] = t
    return out


def overlap_part(
    state: Mapping[str, torch.Tensor],
    sel: Mapping[str, torch.Tensor],
    other: Mapping[str, torch.Tensor],
    spec: SliceSpec,
    shapes: Mapping[str, Sequence[int]],
) -> TensorDict:
    """What a participant holding ``state`` (selection ``sel``) sends to a peer whose selection is ``other``:
    the elements both hold (the product of the per-dimension intersections), in the sender's unit order.
    Tensors with no common element are omitted; scalars (``num_batches_tracked``) are sent.
    """
    out: TensorDict = {}
    gpos = group_positions(spec, sel, other)
    for key, v in state.items():
        if not v.dim():
            out[key] = v.clone()
            continue
        pos, _ = _dim_positions(spec, key, gpos, sel, other)
        if any(p is not None and p.size == 0 for p in pos):
            continue
        part = _take(v, [None if p is None else torch.from_numpy(p) for p in pos])
        out[key] = part.clone() if part is v else part
    return out


def intersect_selection(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> Selection:
    """Per group, the indices of ``a`` also in ``b`` (in ``a``'s order)."""
    out: Selection = {}
    for g in a:
        ag, bg = _index_array(a[g]), _index_array(b[g])
        if not (ag.size and bg.size):
            out[g] = torch.from_numpy(ag[:0].copy())
            continue
        table = np.zeros(int(max(ag.max(), bg.max())) + 1, dtype=bool)
        table[bg] = True
        out[g] = torch.from_numpy(ag[table[ag]])
    return out


def overlap_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a ∩ b| / |a| for two index sets of one layer."""
    return float(torch.isin(a, b).sum()) / max(int(a.numel()), 1)


# ---------------------------------------------------------------------------------------------------------
# Real sub-models

_SKELETONS: dict[str, nn.Module] = {}


def _resize_module(module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    old = getattr(owner, attr)
    new = torch.empty(shape, dtype=old.dtype, device=old.device)
    if isinstance(old, nn.Parameter):
        setattr(owner, attr, nn.Parameter(new, requires_grad=old.requires_grad))
    else:
        owner._buffers[attr] = new
    if isinstance(owner, nn.Linear) and attr == "weight":
        owner.out_features, owner.in_features = shape
    elif isinstance(owner, nn.modules.conv._ConvNd) and attr == "weight":
        owner.out_channels, owner.in_channels = shape[0], shape[1] * owner.groups
    elif isinstance(owner, nn.modules.batchnorm._BatchNorm) and attr in ("weight", "running_mean"):
        owner.num_features = shape[0]


def build_submodel(full_model: nn.Module, spec: SliceSpec, widths: Mapping[str, int], tag: str = "") -> nn.Module:
    """A (cached) module of the full model's architecture with every group ``g`` narrowed to ``widths[g]`` units.

    Its state has exactly the shapes of :func:`slice_state`; load a sliced state into it with
    ``load_state_dict``.  ``tag`` separates caches of different full architectures.
    """
    cls = type(full_model)  # a cache key only: which class it is never changes what is built
    sig = json.dumps([tag, f"{cls.__module__}.{cls.__qualname__}", getattr(full_model, "options", {}),
                      sorted(spec.groups.items()), sorted(widths.items())], default=str)
    if sig not in _SKELETONS:
        sub = copy.deepcopy(full_model)
        sel = {g: torch.arange(w) for g, w in widths.items()}
        seen: set[int] = set()
        for key, v in full_model.state_dict(keep_vars=True).items():
            if id(v) in seen:  # tied weights: resize once
                continue
            seen.add(id(v))
            shape = tuple(int(p.numel()) for p in dim_indices(spec, sel, key, v.shape))
            if shape != tuple(v.shape):
                _resize_module(sub, key, shape)
        _SKELETONS[sig] = sub
    return _SKELETONS[sig]


def load_submodel(
    full_model: nn.Module, spec: SliceSpec, sub_state: Mapping[str, torch.Tensor], sel: Mapping[str, torch.Tensor],
    tag: str = "",
) -> nn.Module:
    """The cached sub-module for ``sel``'s widths with ``sub_state`` loaded (strict)."""
    m = build_submodel(full_model, spec, widths_of(sel), tag)
    m.load_state_dict(sub_state, strict=True)
    return m


def zero_unselected(
    full: Mapping[str, torch.Tensor], spec: SliceSpec, sel: Mapping[str, torch.Tensor]
) -> TensorDict:
    """The full state with every unselected unit silenced: its weights, biases, BN affine parameters and
    running mean set to 0 (running variance to 1).  With ReLU/BN(eval) networks the full model's forward then
    equals the sub-model's forward (the identity tested in ``tests/fusion/test_slicing.py``)."""
    out: TensorDict = {}
    for key, f in full.items():
        if not f.dim() or not f.is_floating_point():
            out[key] = f.clone()
            continue
        keep = torch.zeros(f.shape, dtype=torch.bool)
        pos = dim_indices(spec, sel, key, f.shape)
        keep[torch.meshgrid(*pos, indexing="ij")] = True
        fill = 1.0 if key.endswith("running_var") else 0.0
        out[key] = torch.where(keep, f, torch.full_like(f, fill))
    return out


def unheld_value(key: str, like: torch.Tensor) -> torch.Tensor:
    """What an element nobody holds contributes to a model assembled from sub-models only: 0, and 1 for a BN
    running variance (with its weight and bias 0 the channel outputs 0 either way; 1 avoids dividing by √eps)."""
    return torch.ones_like(like) if key.endswith("running_var") else torch.zeros_like(like)


def fill_unheld(
    state: Mapping[str, torch.Tensor], counts: Mapping[str, torch.Tensor],
    fill: Mapping[str, torch.Tensor] | None = None,
) -> TensorDict:
    """``state`` with every element whose holder count (from :func:`combine`) is 0 replaced by ``fill[key]``
    (default :func:`unheld_value`); held elements are unchanged.  Scalars (``num_batches_tracked``) are held
    by every source that has the key."""
    out: TensorDict = {}
    for key, v in state.items():
        f = unheld_value(key, v) if fill is None else fill[key].to(v.dtype)
        out[key] = torch.where(counts[key] > 0, v, f)
    return out


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    return int(sum(v.numel() * v.element_size() for v in state.values()))


def param_count(model: nn.Module) -> int:
    return int(sum(p.numel() for p in model.parameters()))
