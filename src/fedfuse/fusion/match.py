"""Neuron matching: layer-wise matching of clients' networks (Hungarian or FedMA's BBP-MAP), as pure functions on
named tensors.

Usable on its own ("as a black box")::

    spec = chain_spec(model)                       # fedfuse.fusion.permute
    gm = match_group([s1, s2, s3], spec[0])        # BBP-MAP on the first hidden layer of three clients
    gm.tensors, gm.assign, gm.size                 # matched global layer, local->global maps, global width
    state, sizes, assigns = match_network(states, spec, head_keys, class_counts=counts)   # one-shot matching

**Atoms.**  A unit's atom is the concatenation of its group's ``role="in"`` members: the incoming weight row
(conv: ``in·k·k``), its bias and, after a conv, its BatchNorm scale and shift.  BN running statistics
(``role="stat"``) are not part of the atom: a global unit's statistics are the (client-weighted) average over
the local units matched to it.  ``num_batches_tracked`` takes the maximum.

**BBP-MAP** (:mod:`fedfuse.fusion.bbp`) matches the atoms of one layer, possibly growing it; the global unit is
the posterior mean (``estimator="posterior"``, paper and code) or the plain (client-weighted) mean of the
matched units (``estimator="mean"``).

**Hungarian** weight matching: each client's atoms are aligned to a reference client (the first) by
``linear_sum_assignment`` on the L1 or squared-L2 distance between atoms (``iters > 0``: then re-aligned to the
current average, repeatedly); the global layer is the weighted average of the aligned atoms (no growth).
Simple-FedMA's alignment of whole networks is :mod:`fedfuse.fusion.align`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from fedfuse.errors import UserError
from fedfuse.fusion.bbp import bbp_map
from fedfuse.fusion.permute import PermGroup, scatter_units
from fedfuse.options import opt
from fedfuse.types import TensorDict

# ------------------------------------------------------------------------------------------------- atoms


def atoms_of(state: Mapping[str, torch.Tensor], group: PermGroup, determining: bool = False) -> np.ndarray:
    """(units, D) float64 array: each unit's ``role="in"`` members concatenated (weight row, bias, BN affine).

    ``determining=True`` uses the group's determining members instead (``PermGroup.by``, e.g. the embedding
    columns for a transformer's residual stream); units of ``block`` entries are flattened.
    """
    members = group.determining() if determining else [m for m in group.members if m.role == "in"]
    parts = []
    for m in members:
        t = state[m.key].detach().to(torch.float64).movedim(m.axis, 0)
        t = t.reshape(group.size, -1) if m.block > 1 else t.reshape(t.shape[0], -1)
        parts.append(t.cpu().numpy())
    return np.concatenate(parts, axis=1)


def prior_mean(state: Mapping[str, torch.Tensor], group: PermGroup, mu0: float = 0.0, mu0_bias: float = 0.1,
               mu0_scale: float = 1.0) -> np.ndarray:
    """The per-dimension prior mean of an atom: ``mu0`` for weights, ``mu0_bias`` for biases, ``mu0_scale`` for a
    normalisation scale (a 1-D ``weight``)."""
    parts = []
    for m in group.members:
        if m.role != "in":
            continue
        t = state[m.key]
        width = int(t.numel() // t.shape[m.axis])
        value = (mu0_scale if m.key.endswith("weight") else mu0_bias) if t.dim() == 1 else mu0
        parts.append(np.full(width, value))
    return np.concatenate(parts)


def _write_atoms(atoms: np.ndarray, group: PermGroup, like: Mapping[str, torch.Tensor]) -> TensorDict:
    out: TensorDict = {}
    col = 0
    for m in group.members:
        if m.role != "in":
            continue
        t = like[m.key].movedim(m.axis, 0)
        width = int(np.prod(t.shape[1:]))
        block = torch.as_tensor(atoms[:, col : col + width], dtype=t.dtype, device=t.device)
        out[m.key] = block.reshape(atoms.shape[0], *t.shape[1:]).movedim(0, m.axis).contiguous()
        col += width
    return out


# ------------------------------------------------------------------------------------------------- solvers


def pair_cost(ref: np.ndarray | torch.Tensor, other: np.ndarray | torch.Tensor, metric: str = "l2") -> np.ndarray:
    """The (len(ref), len(other)) float64 matrix of distances between atoms: squared Euclidean (``"l2"``,
    equivalently maximal inner product) or ``"l1"``."""
    a = torch.as_tensor(np.asarray(ref), dtype=torch.float64)
    b = torch.as_tensor(np.asarray(other), dtype=torch.float64)
    if metric == "l2":
        return (torch.cdist(a, b, p=2.0) ** 2).numpy()
    if metric == "l1":
        return torch.cdist(a, b, p=1.0).numpy()
    raise UserError(f"unknown metric {metric!r}; choose l1 or l2")


def hungarian(ref: np.ndarray | torch.Tensor, other: np.ndarray | torch.Tensor, metric: str = "l2") -> np.ndarray:
    """The permutation ``perm`` with ``other[perm]`` best aligned to ``ref`` (``ref[i]`` ↔ ``other[perm[i]]``)
    under :func:`pair_cost`."""
    if np.shape(ref) != np.shape(other):
        raise ValueError(f"hungarian needs equal shapes, got {tuple(np.shape(ref))} and {tuple(np.shape(other))}")
    rows, cols = linear_sum_assignment(pair_cost(ref, other, metric))
    perm = np.empty(len(rows), dtype=np.int64)
    perm[rows] = cols
    return perm


@dataclass
class MatchingOptions:
    """The matching options shared by every algorithm that matches neurons (FedMA, one-shot matching)."""

    matching: str = opt("bbp", "layer matching: BBP-MAP (paper, code; may grow layers) or Hungarian "
                        "permutations (no growth)", choices=("bbp", "hungarian"))
    sigma: float = opt(1.0, "BBP-MAP noise variance σ (code: 1)", gt=0.0)
    sigma0: float = opt(1.0, "BBP-MAP prior variance σ0 (code: 1)", gt=0.0)
    gamma: float = opt(7.0, "BBP-MAP new-neuron rate γ (code: 7)", gt=0.0)
    iters: int = opt(5, "BBP-MAP passes (code: 5) / Hungarian re-alignments", ge=0)
    cap: int = opt(700, "soft cap on a global layer's width (code: 700)", ge=1)
    estimator: str = opt("posterior", "global unit: posterior mean g/p (paper, code) or the plain mean of the "
                         "matched units", choices=("posterior", "mean"))
    metric: str = opt("l2", "Hungarian cost", choices=("l2", "l1"))


# ------------------------------------------------------------------------------------------------- groups


@dataclass
class GroupMatch:
    """A matched layer: global tensors of the group's ``in`` and ``stat`` members, maps, global width."""

    tensors: TensorDict
    assign: list[np.ndarray]
    size: int


def _stats(states, group, assign, size, weights) -> TensorDict:
    """Running statistics of global units: weighted mean over the local units matched to them."""
    out: TensorDict = {}
    for m in group.members:
        if m.role != "stat" or m.key not in states[0]:
            continue
        ref = states[0][m.key]
        acc = torch.zeros((size, *ref.shape[1:]), dtype=torch.float64)
        tot = torch.zeros(size, dtype=torch.float64)
        for st, a, w in zip(states, assign, weights):
            idx = torch.as_tensor(a, dtype=torch.long)
            acc.index_add_(0, idx, st[m.key].detach().to(torch.float64) * w)
            tot.index_add_(0, idx, torch.full((len(a),), float(w), dtype=torch.float64))
        fill = 1.0 if m.key.endswith("running_var") else 0.0
        val = torch.where(tot > 0, acc / tot.clamp_min(1e-300), torch.full_like(acc, fill))
        out[m.key] = val.to(ref.dtype)
    return out


def match_group(
    states: Sequence[Mapping[str, torch.Tensor]],
    group: PermGroup,
    *,
    method: str = "bbp",
    weights: Sequence[float] | None = None,
    estimator: str = "posterior",
    metric: str = "l2",
    iters: int = 5,
    sigma: float = 1.0,
    sigma0: float = 1.0,
    gamma: float = 7.0,
    cap: int = 700,
    mu0: float = 0.0,
    mu0_bias: float = 0.1,
    rng: np.random.Generator | None = None,
) -> GroupMatch:
    """Match one layer (``group``) across clients whose inputs to that layer are already aligned.

    ``method="bbp"`` (BBP-MAP, may grow the layer) or ``"hungarian"`` (permutations only; ``iters`` re-alignments
    to the running average, 0 = align to the first client once).  ``weights`` (default uniform) weight the
    Hungarian average, the ``estimator="mean"`` average and the running statistics.
    """
    J = len(states)
    w = np.ones(J) if weights is None else np.asarray(weights, dtype=np.float64)
    if len(w) != J or (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights must be non-negative, one per client, not all zero")
    atoms = [atoms_of(s, group) for s in states]
    if method == "bbp":
        res = bbp_map(atoms, sigma=sigma, sigma0=sigma0, gamma=gamma, mu0=prior_mean(states[0], group, mu0, mu0_bias),
                      iters=iters, cap=cap, rng=rng)
        assign, size = res.assign, res.atoms.shape[0]
        if estimator == "posterior":
            glob = res.atoms
        elif estimator == "mean":
            acc = np.zeros_like(res.atoms)
            tot = np.zeros(size)
            for a, x, wj in zip(assign, atoms, w):
                np.add.at(acc, a, wj * x)
                np.add.at(tot, a, wj)
            glob = acc / np.maximum(tot, 1e-300)[:, None]
        else:
            raise UserError(f"unknown estimator {estimator!r}; choose posterior or mean")
    elif method == "hungarian":
        ref = atoms[0]
        for it in range(max(iters, 0) + 1):
            perms = [hungarian(ref, x, metric) for x in atoms]
            glob = sum(wj * x[pm] for wj, x, pm in zip(w, atoms, perms)) / w.sum()
            if it < iters:
                ref = glob
        assign = [np.argsort(pm) for pm in perms]  # local unit perm[i] -> global i
        size = atoms[0].shape[0]
    else:
        raise UserError(f"unknown matching method {method!r}; choose bbp or hungarian")
    tensors = _write_atoms(glob, group, states[0])
    tensors.update(_stats(states, group, assign, size, w))
    return GroupMatch(tensors, [np.asarray(a, dtype=np.int64) for a in assign], int(size))


# ------------------------------------------------------------------------------------------------- heads


def class_weighted_average(
    states: Sequence[Mapping[str, torch.Tensor]],
    keys: Sequence[str],
    class_counts: Sequence[Sequence[float]],
    fallback: Sequence[float] | None = None,
) -> TensorDict:
    """FedMA's last layer: row ``c`` of every head tensor is averaged with weights ``n_jc / Σ_j n_jc``.

    A class no client has is averaged with ``fallback`` weights (default uniform).
    """
    n = torch.as_tensor(np.asarray(class_counts, dtype=np.float64))  # (J, C)
    J = n.shape[0]
    fb = torch.as_tensor(np.ones(J) if fallback is None else np.asarray(fallback, dtype=np.float64))
    tot = n.sum(0)
    wts = torch.where(tot[None, :] > 0, n / tot.clamp_min(1e-300)[None, :], (fb / fb.sum())[:, None])  # (J, C)
    out: TensorDict = {}
    for k in keys:
        ref = states[0][k]
        if ref.shape[0] != n.shape[1]:
            raise ValueError(f"{k}: first dimension {ref.shape[0]} is not the number of classes {n.shape[1]}")
        shape = (J, -1) + (1,) * (ref.dim() - 1)
        stack = torch.stack([s[k].detach().to(torch.float64) for s in states])
        out[k] = (wts.reshape(shape) * stack).sum(0).to(ref.dtype)
    return out


def match_network(
    states: Sequence[Mapping[str, torch.Tensor]],
    spec: Sequence[PermGroup],
    head_keys: Sequence[str],
    *,
    class_counts: Sequence[Sequence[float]] | None = None,
    weights: Sequence[float] | None = None,
    **match_options,
) -> tuple[TensorDict, list[int], list[list[np.ndarray]]]:
    """One-shot matched averaging of whole networks (no retraining), layer by layer, input to output.

    Each group is matched (:func:`match_group`), then every client's next layer is patched to the global
    width (:func:`~fedfuse.fusion.permute.scatter_units` of the ``out`` members).  The head is class-weighted
    (``class_counts``) or, without counts, weighted by ``weights``.  Keys in no group and not in the head are
    averaged with ``weights``; integer tensors (``num_batches_tracked``) take the maximum.
    Returns (global state, global widths, assignments per group and client).
    """
    cur = [dict(s) for s in states]
    w = [1.0] * len(states) if weights is None else list(weights)
    out: TensorDict = {}
    sizes: list[int] = []
    assigns: list[list[np.ndarray]] = []
    for g in spec:
        gm = match_group(cur, g, weights=w, **match_options)
        out.update(gm.tensors)
        sizes.append(gm.size)
        assigns.append(gm.assign)
        cur = [scatter_units(s, g, a, gm.size, roles=("out",)) for s, a in zip(cur, gm.assign)]
    if class_counts is not None:
        out.update(class_weighted_average(cur, list(head_keys), class_counts, w))
    for k in cur[0]:
        if k in out:
            continue
        ts = [s[k] for s in cur]
        if ts[0].is_floating_point():
            acc = sum(float(wj) * t.to(torch.float64) for wj, t in zip(w, ts)) / float(sum(w))
            out[k] = acc.to(ts[0].dtype)
        else:
            out[k] = torch.stack(ts).amax(0)
    return {k: out[k] for k in cur[0]}, sizes, assigns
