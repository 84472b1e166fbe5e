"""Neuron matching: Hungarian weight matching and FedMA's BBP-MAP, as pure functions on named tensors.

Usable on its own ("as a black box")::

    spec = chain_spec(model)                       # fedfuse.fusion.permute
    gm = match_group([s1, s2, s3], spec[0])        # BBP-MAP on the first hidden layer of three clients
    gm.tensors, gm.assign, gm.size                 # matched global layer, local->global maps, global width
    state, sizes, assigns = match_network(states, spec, head_keys, class_counts=counts)   # one-shot matching

**Atoms.**  A unit's atom is the concatenation of its group's ``role="in"`` members: the incoming weight row
(conv: ``in·k·k``), its bias and, after a conv, its BatchNorm scale and shift.  BN running statistics
(``role="stat"``) are not part of the atom: a global unit's statistics are the (client-weighted) average over
the local units matched to it.  ``num_batches_tracked`` takes the maximum.

**BBP-MAP** (Wang et al. 2020, after Yurochkin et al. 2019, PFNM), following ``IBM/FedMA``
``matching/pfnm.py``: precisions ``s = 1/σ``, ``s0 = 1/σ0`` (σ, σ0 are variances), prior mean ``μ0`` (0 for
weights, 0.1 for biases as in the code; 1 for a BatchNorm scale — the code has no BN).  A global atom keeps
``g_i = μ0·s0 + Σ s·w`` and ``p_i = s0 + n_i·s``.  Client ``j``'s unit ``l`` is scored against existing atoms by
``Σ_d[(g_i + s w_l)²/(p_i + s) − g_i²/p_i] + log(min(n_i,10)/(J − min(n_i,10)))`` and against new atoms
``k = 1..K`` by ``Σ_d[(s w_l + μ0 s0)²/(s0 + s) − (μ0 s0)²/s0] − 2 log k + 2 log(γ/J)`` with
``K = min(L_j, max(cap − L, 1))`` (raised to ``L_j − L`` if needed so every unit has a column); the
assignment maximising the total is solved by ``scipy.optimize.linear_sum_assignment``.  Clients are added
largest first, then ``iters`` passes each remove and re-match every client in a random order.  The global
unit is the posterior mean ``g_i / p_i`` (paper and code agree); ``estimator="mean"`` gives the plain
(client-weighted) mean of the matched units instead.  The cost matrices are built with matrix products
(no loop over units × atoms).

**Hungarian** weight matching: each client's atoms are aligned to a reference client (the first) by
``linear_sum_assignment`` on the L1 or squared-L2 distance between atoms (``iters > 0``: then re-aligned to the
current average, repeatedly); the global layer is the weighted average of the aligned atoms (no growth).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from fedfuse.fusion.permute import PermGroup, expand
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


def hungarian(ref: np.ndarray | torch.Tensor, other: np.ndarray | torch.Tensor, metric: str = "l2") -> np.ndarray:
    """The permutation ``perm`` with ``other[perm]`` best aligned to ``ref`` (``ref[i]`` ↔ ``other[perm[i]]``).

    ``metric``: ``"l2"`` (squared Euclidean distance, equivalently maximal inner product) or ``"l1"``.
    """
    a = torch.as_tensor(np.asarray(ref), dtype=torch.float64)
    b = torch.as_tensor(np.asarray(other), dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"hungarian needs equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")
    if metric == "l2":
        cost = torch.cdist(a, b, p=2.0) ** 2
    elif metric == "l1":
        cost = torch.cdist(a, b, p=1.0)
    else:
        raise ValueError(f"unknown metric {metric!r}; choose l1 or l2")
    rows, cols = linear_sum_assignment(cost.numpy())
    perm = np.empty(len(rows), dtype=np.int64)
    perm[rows] = cols
    return perm


@dataclass
class BBPResult:
    """BBP-MAP output: global atoms (posterior means), natural parameters, counts and local→global maps."""

    atoms: np.ndarray  # (L, D) posterior means g / p
    g: np.ndarray  # (L, D) precision-weighted sums
    p: np.ndarray  # (L, D) precisions
    counts: np.ndarray  # (L,) number of local units matched to each global atom
    assign: list[np.ndarray]  # per client: local unit l -> global atom


def bbp_cost(swj, g, p, counts, s, s0, prior_norm, gamma, J, cap=700, popularity_cap=10) -> np.ndarray:
    """The (L_j, L + K) BBP-MAP score matrix (to maximise) of one client's scaled atoms ``swj = s·w``.

    Columns ``< L`` score existing global atoms (``g``, ``p``, ``counts``), the others the ``K`` new atoms.
    """
    L, Lj = g.shape[0], swj.shape[0]
    cols = []
    if L:
        denom = p + s
        base = (g * g / denom).sum(1) - (g * g / p).sum(1)
        param = base[None, :] + 2.0 * swj @ (g / denom).T + (swj * swj) @ (1.0 / denom).T
        cnt = np.minimum(counts, popularity_cap).astype(np.float64)
        param += np.log(cnt / np.maximum(J - cnt, 1e-12))[None, :]
        cols.append(param)
    K = min(Lj, max(cap - L, Lj - L, 1))
    new = ((swj + prior_norm) ** 2 / (s0 + s)).sum(1) - (prior_norm**2 / s0).sum()
    cols.append(new[:, None] - 2.0 * np.log(np.arange(1, K + 1))[None, :] + 2.0 * np.log(gamma / J))
    return np.hstack(cols)


def _bbp_update(swj, g, p, counts, s, s0, prior_norm, gamma, J, cap, pop_cap):
    """Match one client's (scaled) atoms into the global model; returns the updated model and its assignment."""
    L, Lj = g.shape[0], swj.shape[0]
    full = bbp_cost(swj, g, p, counts, s, s0, prior_norm, gamma, J, cap, pop_cap)
    rows, picked = linear_sum_assignment(full, maximize=True)
    assign = np.empty(Lj, dtype=np.int64)
    old = picked < L
    assign[rows[old]] = picked[old]
    g, p, counts = g.copy(), p.copy(), counts.copy()
    g[picked[old]] += swj[rows[old]]
    p[picked[old]] += s
    counts[picked[old]] += 1
    new_rows = rows[~old]  # rows are sorted: new atoms are appended in unit order (as the code does)
    if len(new_rows):
        assign[new_rows] = L + np.arange(len(new_rows))
        g = np.vstack([g, prior_norm[None, :] + swj[new_rows]])
        p = np.vstack([p, np.broadcast_to(s0 + s, (len(new_rows), g.shape[1]))])
        counts = np.concatenate([counts, np.ones(len(new_rows), dtype=np.int64)])
    return g, p, counts, assign


def bbp_map(
    atoms: Sequence[np.ndarray],
    *,
    sigma: float | np.ndarray = 1.0,
    sigma0: float | np.ndarray = 1.0,
    gamma: float = 7.0,
    mu0: float | np.ndarray = 0.0,
    iters: int = 5,
    cap: int = 700,
    popularity_cap: int = 10,
    rng: np.random.Generator | None = None,
) -> BBPResult:
    """FedMA's BBP-MAP matching of ``J`` clients' atoms ((L_j, D) arrays); see the module docstring."""
    J = len(atoms)
    if J == 0:
        raise ValueError("bbp_map needs at least one client")
    rng = rng if rng is not None else np.random.default_rng(0)
    D = atoms[0].shape[1]
    s = np.broadcast_to(1.0 / np.asarray(sigma, dtype=np.float64), (D,)).copy()
    s0 = np.broadcast_to(1.0 / np.asarray(sigma0, dtype=np.float64), (D,)).copy()
    prior_norm = np.broadcast_to(np.asarray(mu0, dtype=np.float64), (D,)) * s0
    sw = [np.asarray(a, dtype=np.float64) * s for a in atoms]
    order = sorted(range(J), key=lambda j: -sw[j].shape[0])  # stable: ties keep client order
    first = order[0]
    g = prior_norm[None, :] + sw[first]
    p = np.tile(s0 + s, (g.shape[0], 1))
    counts = np.ones(g.shape[0], dtype=np.int64)
    assign: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * J
    assign[first] = np.arange(g.shape[0])
    for j in order[1:]:
        g, p, counts, assign[j] = _bbp_update(sw[j], g, p, counts, s, s0, prior_norm, gamma, J, cap, popularity_cap)
    for _ in range(iters):
        for j in rng.permutation(J):
            a = assign[j]
            counts = counts.copy()
            counts[a] -= 1
            g = g.copy()
            p = p.copy()
            g[a] -= sw[j]
            p[a] -= s
            keep = counts > 0
            if not keep.all():
                remap = np.cumsum(keep) - 1
                for k in range(J):
                    if k != j:
                        assign[k] = remap[assign[k]]
                g, p, counts = g[keep], p[keep], counts[keep]
            g, p, counts, assign[j] = _bbp_update(
                sw[j], g, p, counts, s, s0, prior_norm, gamma, J, cap, popularity_cap
            )
    return BBPResult(g / p, g, p, counts, [np.asarray(a) for a in assign])


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
            raise ValueError(f"unknown estimator {estimator!r}; choose posterior or mean")
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
        raise ValueError(f"unknown matching method {method!r}; choose bbp or hungarian")
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
    width (:func:`~fedfuse.fusion.permute.expand` of the ``out`` members).  The head is class-weighted
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
        cur = [expand(s, g, a, gm.size, roles=("out",)) for s, a in zip(cur, gm.assign)]
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


# ------------------------------------------------------------------------------------------------- alignment


def _pair_cost(a: np.ndarray, b: np.ndarray, metric: str) -> np.ndarray:
    ta, tb = torch.as_tensor(a), torch.as_tensor(b)
    if metric == "l2":
        return (torch.cdist(ta, tb, p=2.0) ** 2).numpy()
    if metric == "l1":
        return torch.cdist(ta, tb, p=1.0).numpy()
    raise ValueError(f"unknown metric {metric!r}; choose l1 or l2")


def _within(a: np.ndarray, b: np.ndarray, metric: str) -> tuple[np.ndarray, float]:
    cost = _pair_cost(a, b, metric)
    rows, cols = linear_sum_assignment(cost)
    perm = np.empty(len(rows), dtype=np.int64)
    perm[rows] = cols
    return perm, float(cost[rows, cols].sum())


def align_heads(
    ref: Sequence[np.ndarray], other: Sequence[np.ndarray], head_dim: int, metric: str = "l1"
) -> list[np.ndarray]:
    """Align multi-head groups that share one head order (a block's Q/K group and V group).

    ``ref[k]``/``other[k]`` are the (units, D_k) atoms of group ``k``.  The cost of pairing reference head ``a``
    with head ``b`` is the sum over groups of the optimal within-head matching cost; heads are assigned by
    ``linear_sum_assignment``, then each group keeps its own within-head permutation.  Returns one unit
    permutation per group (``other[perm]`` ≈ ``ref``).
    """
    n_heads = ref[0].shape[0] // head_dim
    blk = [slice(h * head_dim, (h + 1) * head_dim) for h in range(n_heads)]
    within = [[[None] * n_heads for _ in range(n_heads)] for _ in ref]
    cost = np.zeros((n_heads, n_heads))
    for k, (r, o) in enumerate(zip(ref, other)):
        for a in range(n_heads):
            for b in range(n_heads):
                perm, c = _within(r[blk[a]], o[blk[b]], metric)
                within[k][a][b] = perm
                cost[a, b] += c
    rows, cols = linear_sum_assignment(cost)
    head_perm = np.empty(n_heads, dtype=np.int64)
    head_perm[rows] = cols
    out = []
    for k in range(len(ref)):
        out.append(np.concatenate([head_perm[a] * head_dim + within[k][a][head_perm[a]] for a in range(n_heads)]))
    return out


def align_to(
    ref: Mapping[str, torch.Tensor],
    other: Mapping[str, torch.Tensor],
    spec: Sequence[PermGroup],
    metric: str = "l1",
) -> tuple[TensorDict, dict[str, np.ndarray]]:
    """Simple-FedMA: permute ``other`` so its units line up with ``ref`` (hard permutations, no growth).

    Groups are processed in ``spec`` order; each is determined by its determining members
    (:meth:`PermGroup.determining`) of the *already permuted* ``other``, with the L1 (default, as in L46) or
    squared-L2 distance and ``linear_sum_assignment``.  Multi-head groups of one block (same name prefix,
    ``head_dim`` set) are aligned jointly by :func:`align_heads`.  Returns the permuted state and the
    permutations (``other_aligned`` unit ``i`` = ``other`` unit ``perm[i]``).
    """
    from fedfuse.fusion.permute import permute

    cur = dict(other)
    perms: dict[str, np.ndarray] = {}
    done: set[str] = set()
    for g in spec:
        if g.name in done:
            continue
        if g.head_dim and g.size // g.head_dim > 1:
            prefix = g.name.rsplit(".", 1)[0]
            mates = [h for h in spec if h.head_dim and h.name.rsplit(".", 1)[0] == prefix]
            found = align_heads([atoms_of(ref, h, True) for h in mates], [atoms_of(cur, h, True) for h in mates],
                                g.head_dim, metric)
            for h, pm in zip(mates, found):
                cur = permute(cur, h, pm)
                perms[h.name] = pm
                done.add(h.name)
            continue
        pm, _ = _within(atoms_of(ref, g, True), atoms_of(cur, g, True), metric)
        cur = permute(cur, g, pm)
        perms[g.name] = pm
        done.add(g.name)
    return cur, perms
