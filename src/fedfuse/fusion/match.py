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
(client-weighted) mean of the matched units instead.  With scalar σ, σ0 (the code's setting) each client
update costs one float32 matrix product; per-client terms are reused across passes, the assignment solver
is skipped when a dual certificate proves the greedy assignment is the unique optimum, and passes after the
grouping of units has settled are not recomputed (:func:`bbp_map`).
``benchmarks/matching.py`` checks the assignments against a port of the code's matching and times both.

**Hungarian** weight matching: each client's atoms are aligned to a reference client (the first) by
``linear_sum_assignment`` on the L1 or squared-L2 distance between atoms (``iters > 0``: then re-aligned to the
current average, repeatedly); the global layer is the weighted average of the aligned atoms (no growth).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from fedfuse.errors import UserError
from fedfuse.fusion.permute import PermGroup, expand
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
        raise UserError(f"unknown metric {metric!r}; choose l1 or l2")
    rows, cols = linear_sum_assignment(cost.numpy())
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


@dataclass
class BBPResult:
    """BBP-MAP output: global atoms (posterior means), natural parameters, counts and local→global maps."""

    atoms: np.ndarray  # (L, D) posterior means g / p
    g: np.ndarray  # (L, D) precision-weighted sums
    p: np.ndarray  # (L, D) precisions (scalar σ: a read-only broadcast of one value per atom)
    counts: np.ndarray  # (L,) number of local units matched to each global atom
    assign: list[np.ndarray]  # per client: local unit l -> global atom
    solver_stats: dict[str, int] | None = None  # assignment problems solved by the solver / by certificate


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
    precision: str = "float32",
    certify: bool = True,
    skip_settled: bool = True,
) -> BBPResult:
    """FedMA's BBP-MAP matching of ``J`` clients' atoms ((L_j, D) arrays); see the module docstring.

    With scalar ``sigma`` and ``sigma0`` (the code's setting) a global atom's precision is the same in every
    dimension, ``p_i = s0 + n_i s``, so the score of unit ``l`` against atom ``i`` reduces to
    ``(|g_i|² + 2 g_i·x_l + |x_l|²)/(p_i + s) − |g_i|²/p_i`` (``x = s·w``): one matrix product per client
    update, computed in ``precision`` (``"float32"``, as the code computes its costs, or ``"float64"``); the
    natural parameters ``g`` are accumulated in float64, and each client's ``|x_l|²`` and new-atom scores are
    computed once and reused across the passes.  Per-dimension ``sigma``/``sigma0`` arrays use the general
    (elementwise) formula of :func:`bbp_cost`.

    ``skip_settled`` (scalar path): once every client has been re-matched without changing which units share an
    atom, the remaining passes cannot change it either (a client's choice depends only on the other clients'
    atoms, which are then fixed), so they only redo the index bookkeeping (a client's atoms that hold only its
    own units are deleted and re-appended, as the code does) without computing scores.  The client added last
    counts as re-matched, and with two clients of one size both do (see the code).  Assignments and counts
    are those of computing every pass; ``g`` differs by rounding only.
    """
    J = len(atoms)
    if J == 0:
        raise ValueError("bbp_map needs at least one client")
    if precision not in ("float32", "float64"):
        raise UserError(f"precision={precision!r}; choose float32 or float64")
    rng = rng if rng is not None else np.random.default_rng(0)
    D = atoms[0].shape[1]
    sig, sig0 = np.asarray(sigma, dtype=np.float64), np.asarray(sigma0, dtype=np.float64)
    mu = np.asarray(mu0, dtype=np.float64)
    if sig.ndim == 0 and sig0.ndim == 0:
        prior_norm = mu / float(sig0) if mu.ndim else np.full(D, float(mu) / float(sig0))
        return _bbp_map_scalar(atoms, 1.0 / float(sig), 1.0 / float(sig0), prior_norm, gamma, iters, cap,
                               popularity_cap, rng, np.dtype(precision), certify, skip_settled)
    prior_norm = np.broadcast_to(mu, (D,)) / np.broadcast_to(sig0, (D,))
    s = np.broadcast_to(1.0 / sig, (D,)).copy()
    s0 = np.broadcast_to(1.0 / sig0, (D,)).copy()
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


def _bbp_map_scalar(w, s, s0, prior_norm, gamma, iters, cap, pop_cap, rng, dtype, certify,
                    skip_settled=True) -> BBPResult:
    """BBP-MAP with scalar precisions (see :func:`bbp_map`): the same schedule, scores by one product each.

    Reused across the passes: each client's ``|x_l|²``, Gram matrix ``x_j x_jᵀ`` and new-atom scores; the
    global atoms' squared norms and low-precision copy are refreshed only for rows that change.  Everything
    that depends only on a count ``n_i ∈ 0..J`` (precisions, the popularity term) is tabulated once.  Removing
    client ``j`` before re-matching it is done on the score matrix (subtracting its Gram matrix from the
    products with the current atoms), so when ``j``'s assignment does not change no atom row is touched.
    ``settled`` holds the clients whose re-match would change nothing (see ``skip_settled`` in
    :func:`bbp_map`); when it holds every client only the atoms' order is tracked from then on.
    """
    J = len(w)
    # Per client, not stacked: large temporaries cost page faults, and each client's arrays are small.
    x = [np.asarray(a, dtype=np.float64) for a in w]
    sizes = [a.shape[0] for a in x]
    if s != 1.0:
        x = [a * s for a in x]
    # A unit's score for opening a new atom (before the offsets c_k): |x + μ0 s0|²/(s0 + s) − |μ0 s0|²/s0
    # = |x|² k + x·(2 μ0 s0 k) + |μ0 s0|² (k − 1/s0) with k = 1/(s0 + s).
    k_new = 1.0 / (s0 + s)
    pn2 = (2.0 * k_new) * prior_norm
    m2 = float(prior_norm @ prior_norm)
    c_new = m2 * k_new - m2 / s0
    # Per client, computed when the client is first matched (a client that never is needs none of them):
    # its units in ``dtype``, half squared norms, new-atom scores and Gram matrix x_j x_jᵀ (in ``dtype``).
    xc: list[np.ndarray | None] = [None] * J
    xxh: list[np.ndarray | None] = [None] * J
    new_score: list[np.ndarray | None] = [None] * J
    gram: dict[int, np.ndarray] = {}

    def prep(j: int) -> np.ndarray:
        """Client ``j``'s per-client terms (computed once); returns its units in ``dtype``."""
        if xc[j] is None:
            a = x[j]
            xc[j] = a if dtype == np.float64 else a.astype(dtype)
            sq = _sqnorms(a)
            xxh[j] = 0.5 * sq
            new_score[j] = sq * k_new + (a @ pn2 + c_new)
        return xc[j]
    # Everything that depends only on an atom's count n = 0..J, in one table (one gather per update):
    # 2/(p + s), |g|²(1/(p + s) − 1/p) per |g|², and the popularity term log(min(n,10)/(J − min(n,10))).
    rows_tab = []
    for n in range(J + 1):
        inv_ps2 = 2.0 / (s0 + (n + 1) * s)
        c_n = min(n, pop_cap)
        pop_n = math.log(c_n / max(J - c_n, 1e-12)) if c_n else -math.inf  # count 0: never a live atom
        rows_tab.append((inv_ps2, 0.5 * inv_ps2 - 1.0 / (s0 + n * s), pop_n))
    table = np.array(rows_tab).T.copy()  # (3, J + 1)
    log_new = 2.0 * math.log(gamma / J)
    new_block: dict[tuple[int, int], np.ndarray] = {}
    new_offsets: dict[int, np.ndarray] = {}
    aranges = {Lj: np.arange(Lj) for Lj in set(sizes)}
    stats = {"solver": 0, "certified": 0, "unchanged": 0, "settled": 0}
    order = sorted(range(J), key=lambda j: -sizes[j])  # stable: ties keep client order
    first = order[0]
    g = prior_norm + x[first]
    g32 = g.astype(dtype)
    gg = _sqnorms(g)
    counts = np.ones(g.shape[0], dtype=np.int64)
    assign: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * J
    assign[first] = np.arange(g.shape[0])

    remap_last = np.empty(0, dtype=np.int64)

    def arange_L(n_: int) -> np.ndarray:
        r = aranges.get(n_)
        if r is None:
            r = aranges[n_] = np.arange(n_)
        return r

    def refresh(rows_: np.ndarray) -> None:
        """Bring the low-precision copy and squared norms of the atoms ``rows_`` (distinct) up to date."""
        if len(rows_) == len(gg):  # every atom (a permutation): no gathers
            g32[...] = g
            gg[...] = _sqnorms(g)
            return
        gr = g[rows_]
        g32[rows_] = gr
        gg[rows_] = _sqnorms(gr)

    def solve(j: int, dot: np.ndarray, gg_: np.ndarray, cnt_: np.ndarray) -> np.ndarray:
        """Scores of client ``j`` against the atoms (``dot`` = products, already without ``j``), then the
        maximising assignment: by certificate when possible, otherwise by the solver."""
        L, Lj = dot.shape[1], dot.shape[0]
        K = min(Lj, max(cap - L, Lj - L, 1))
        full = np.empty((Lj, L + K))
        score = full[:, :L]
        a2, gap, pop = table[:, cnt_]
        np.add(dot, xxh[j][:, None], out=score)
        score *= a2
        score += gg_ * gap + pop
        c = new_offsets.get(K)
        if c is None:
            c = new_offsets[K] = log_new - 2.0 * np.log(np.arange(1, K + 1))  # k-th new atom: new_score + c_k
        picked = _certified_assignment(score, new_score[j], c) if certify else None
        if picked is not None:
            stats["certified"] += 1
            return picked
        # Solve with only the first K' new-atom columns; if fewer than K' are used the answer is optimal for
        # all K (the best total with m new atoms is concave in m: an assignment LP's value is concave in the
        # number of rows sent to one side, and the new-atom offsets c_k decrease), else widen and re-solve.
        Kp = min(K, max(Lj - L, 4))
        while True:
            stats["solver"] += 1
            nb = new_block.get((j, Kp))
            if nb is None:
                nb = new_block[(j, Kp)] = new_score[j][:, None] + c[None, :Kp]
            full[:, L : L + Kp] = nb
            _, picked = linear_sum_assignment(full[:, : L + Kp], maximize=True)
            if Kp == K or int((picked >= L).sum()) < Kp:
                return picked  # rows == arange(Lj): the matrix is at least as wide as tall
            Kp = min(K, 4 * Kp)

    def add(j: int, picked: np.ndarray) -> None:
        """Absorb client ``j``'s units into the atoms ``picked`` (indices ≥ L open new atoms, in unit order)."""
        nonlocal g, g32, gg, counts
        L = g.shape[0]
        old = picked < L
        if old.all():
            g[picked] += x[j]
            counts[picked] += 1
            refresh(picked)
            assign[j] = picked
            return
        rows = aranges[len(picked)]
        a = np.empty(len(picked), dtype=np.int64)
        a[old] = picked[old]
        g[picked[old]] += x[j][old]
        counts[picked[old]] += 1
        refresh(picked[old])
        new_rows = rows[~old]  # new atoms are appended in unit order (as the code does)
        a[new_rows] = L + np.arange(len(new_rows))
        fresh = prior_norm[None, :] + x[j][new_rows]
        g = np.vstack([g, fresh])
        g32 = np.vstack([g32, fresh.astype(dtype)])
        gg = np.concatenate([gg, _sqnorms(fresh)])
        counts = np.concatenate([counts, np.ones(len(new_rows), dtype=np.int64)])
        assign[j] = a

    def remove(j: int) -> None:
        """Take client ``j``'s units out of their atoms; atoms left empty are deleted (``remap_last``: old → new)."""
        nonlocal g, g32, gg, counts, remap_last
        a = assign[j]
        counts[a] -= 1
        g[a] -= x[j]
        keep = counts > 0
        if keep.all():
            refresh(a)
            remap_last = arange_L(len(keep))
            return
        remap = remap_last = np.cumsum(keep) - 1
        for k in range(J):
            if k != j:
                assign[k] = remap[assign[k]]
        g, counts = g[keep], counts[keep]
        g32, gg = g.astype(dtype), _sqnorms(g)

    for j in order[1:]:
        add(j, solve(j, (prep(j) @ g32.T).astype(np.float64), gg, counts))
    # Clients whose re-match would change nothing: those re-matched since the grouping of units into atoms last
    # changed, and the client added last (it was matched against all the others' atoms as they still are).
    settled: set[int] = {order[-1]} if J > 1 else set()
    if J == 2 and sizes[0] == sizes[1]:
        # Two clients of one size: re-matching the first into the second's atoms is the problem just solved
        # with the roles swapped.  With all counts 1 its objective, Σ_matched [|μ0s0 + x_i + y_l|²/(s0 + 2s)
        # − |μ0s0 + y_l|²/(s0 + s) + pop] + Σ_unmatched i [|μ0s0 + x_i|²/(s0 + s) − |μ0s0|²/s0] + Σ c_k, differs
        # from the one just maximised by Σ_l |μ0s0 + y_l|²/(s0 + s) − Σ_i |μ0s0 + x_i|²/(s0 + s), a constant:
        # the same matching is optimal, so neither client's re-match can change the grouping.
        settled = {0, 1}
    # Once every client is settled only the atoms' order still changes: ``atom_order[p]`` (the atom now at
    # position p) is tracked instead of moving rows, and applied once at the end.
    atom_order: np.ndarray | None = None
    reordered = False
    alone_ids: list[np.ndarray] = []
    alone_mask: list[np.ndarray] = []
    for _ in range(iters):
        for j in rng.permutation(J):
            j = int(j)
            if skip_settled and atom_order is None and len(settled) == J:
                atom_order = np.arange(len(counts))
                single = counts == 1
                for k in range(J if single.any() else 0):
                    alone_ids.append(assign[k][single[assign[k]]])
                    alone_mask.append(single)  # unused unless k has atoms of its own (then replaced)
                    if len(alone_ids[k]):
                        alone_mask[k] = np.zeros(len(counts), dtype=bool)
                        alone_mask[k][alone_ids[k]] = True
            if atom_order is not None:
                stats["settled"] += 1
                if alone_ids and len(alone_ids[j]):  # j's own atoms are deleted and re-appended in unit order
                    atom_order = np.concatenate([atom_order[~alone_mask[j][atom_order]], alone_ids[j]])
                    reordered = True
                continue
            a = assign[j]
            cnt_ = counts.copy()
            cnt_[a] -= 1
            alone = cnt_[a] == 0
            if skip_settled and j in settled:  # re-matching j would change nothing: only the index bookkeeping
                stats["settled"] += 1
                if alone.any():
                    kept = a[~alone]
                    remove(j)
                    picked = np.empty(len(a), dtype=np.int64)
                    picked[~alone] = remap_last[kept]
                    picked[alone] = g.shape[0] + np.arange(int(alone.sum()))
                    add(j, picked)
                continue
            if alone.any():  # j held atoms alone: they are deleted first, as the code does
                kept = a[~alone]
                remove(j)
                L = g.shape[0]
                picked = solve(j, (prep(j) @ g32.T).astype(np.float64), gg, counts)
                same = bool((picked[alone] >= L).all()) and np.array_equal(picked[~alone], remap_last[kept])
                add(j, picked)
                settled = settled | {j} if same else {j}
                continue
            xj = prep(j)
            dot = (xj @ g32.T).astype(np.float64)
            rows = aranges[len(a)]
            gg_ = gg.copy()
            gg_[a] += 2.0 * (xxh[j] - dot[rows, a])  # |g_i − x_l|² for the atoms j contributed to
            gj = gram.get(j)
            if gj is None:
                gj = gram[j] = xj @ xj.copy().T  # (a copy: numpy's x xᵀ path is slower here)
            dot[:, a] -= gj  # products with the atoms without j
            picked = solve(j, dot, gg_, cnt_)
            if np.array_equal(picked, a):
                stats["unchanged"] += 1
                settled.add(j)
                continue
            remove(j)
            add(j, picked)
            settled = {j}  # j's choice depends only on the others' atoms, which it did not change
    if reordered:
        where = np.empty_like(atom_order)
        where[atom_order] = np.arange(len(atom_order))
        g, counts = g[atom_order], counts[atom_order]
        assign = [where[a] for a in assign]
    p = np.broadcast_to((s0 + counts * s)[:, None], g.shape)  # read-only: the same precision in every dimension
    return BBPResult(g / p, g, p, counts, [np.asarray(a) for a in assign], stats)


def _sqnorms(a: np.ndarray) -> np.ndarray:
    """Squared norm of every row (no temporary array)."""
    return np.vecdot(a, a)


def _certified_assignment(score: np.ndarray, new: np.ndarray, c: np.ndarray) -> np.ndarray | None:
    """The unique optimum of one BBP-MAP assignment problem when a dual certificate proves it, else ``None``.

    ``score`` (Lj, L): unit ``l`` joins existing atom ``i``; opening the ``k``-th new atom scores ``new_l + c_k``
    (``c`` strictly decreasing).  Let ``b_l`` be row ``l``'s best existing score and ``δ_l = b_l − new_l``; with
    the ``δ`` sorted, ``m`` rows with the smallest ``δ`` open new atoms and the others take their best atom.
    This is the unique optimum (up to which new column each of the ``m`` rows takes, which does not change the
    outcome: new atoms are appended in row order) if the other rows' best atoms are distinct and strictly
    better than their second best, and a threshold ``θ`` separates the two groups:
    ``max_T δ < θ < min_S δ`` and ``c_{m+1} < θ < c_m``.  Then row potentials ``u_l = b_l`` (S) or
    ``new_l + θ`` (T) and column potentials 0 (existing atoms) and ``max(c_k − θ, 0)`` (new atoms) are dual
    feasible with complementary slackness, strictly off the chosen pairs.
    """
    Lj, L = score.shape
    if L == 0:  # every unit opens an atom (which new column each takes does not matter)
        return np.arange(Lj) if len(c) >= Lj else None
    best = score.argmax(1)
    b = score.max(1)
    delta = b - new
    if delta.min() > c[0]:  # the common case: no unit prefers a new atom (m = 0)
        top = score >= b[:, None]  # each row's best entries
        if top.sum(1).max() > 1 or top.sum(0).max() > 1:  # a tie in a row, or two rows with the same best atom
            return None
        return best
    order = np.argsort(delta, kind="stable")
    ds = delta[order]
    K = len(c)
    m = int(np.count_nonzero(ds[: min(Lj, K)] < c[: min(Lj, K)]))
    if m > K or (m < Lj and m < K and ds[m] <= c[m]):
        return None
    lo = max(ds[m - 1] if m else -np.inf, c[m] if m < K else -np.inf)
    hi = min(ds[m] if m < Lj else np.inf, c[m - 1] if m else np.inf)
    if not lo < hi:
        return None
    S = order[m:]
    if len(S):
        bs = best[S]
        if np.bincount(bs, minlength=L).max() > 1:
            return None
        if L > 1:
            second = score[S]
            second[np.arange(len(S)), bs] = -np.inf
            if not (second.max(1) < b[S]).all():
                return None
    picked = best.copy()
    T = np.sort(order[:m])
    picked[T] = L + np.arange(m)
    return picked


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
    raise UserError(f"unknown metric {metric!r}; choose l1 or l2")


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
