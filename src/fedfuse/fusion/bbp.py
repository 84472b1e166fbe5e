"""FedMA's BBP-MAP matching (Wang et al. 2020, after Yurochkin et al. 2019, PFNM) of clients' atoms, as pure
functions on arrays; :mod:`fedfuse.fusion.match` applies it layer by layer.

Following ``IBM/FedMA`` ``matching/pfnm.py``: precisions ``s = 1/σ``, ``s0 = 1/σ0`` (σ, σ0 are variances), prior
mean ``μ0`` (0 for weights, 0.1 for biases as in the code; 1 for a BatchNorm scale — the code has no BN).  A global
atom keeps ``g_i = μ0·s0 + Σ s·w`` and ``p_i = s0 + n_i·s``.  Client ``j``'s unit ``l`` is scored against existing
atoms by ``Σ_d[(g_i + s w_l)²/(p_i + s) − g_i²/p_i] + log(min(n_i,10)/(J − min(n_i,10)))`` and against new atoms
``k = 1..K`` by ``Σ_d[(s w_l + μ0 s0)²/(s0 + s) − (μ0 s0)²/s0] − 2 log k + 2 log(γ/J)`` with
``K = min(L_j, max(cap − L, 1))`` (raised to ``L_j − L`` if needed so every unit has a column); the
assignment maximising the total is solved by ``scipy.optimize.linear_sum_assignment``.  Clients are added
largest first, then ``iters`` passes each remove and re-match every client in a random order.  The global
unit is the posterior mean ``g_i / p_i`` (paper and code agree).  With scalar σ, σ0 (the code's setting) each
client update costs one float32 matrix product; per-client terms are reused across passes, the assignment solver
is skipped when a dual certificate proves the greedy assignment is the unique optimum, and passes after the
grouping of units has settled are not recomputed (:func:`bbp_map`).
``benchmarks/matching.py`` checks the assignments against a port of the code's matching and times both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from fedfuse.errors import UserError


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

    Clients are added largest first (:meth:`_ScalarBBP.add_all`), then ``iters`` passes re-match every client in
    a random order (:meth:`_ScalarBBP.rematch`), or only track the atoms' order once every client is settled.
    """
    m = _ScalarBBP(w, s, s0, prior_norm, gamma, cap, pop_cap, dtype, certify)
    m.add_all()
    for _ in range(iters):
        for j in rng.permutation(m.J):
            j = int(j)
            if skip_settled and m.atom_order is None and len(m.settled) == m.J:
                m.freeze_order()
            if m.atom_order is not None:
                m.move_alone(j)
            else:
                m.rematch(j, skip_settled)
    return m.result()


class _ScalarBBP:
    """The state of one scalar-precision BBP-MAP run: the global atoms and every client's assignment.

    Reused across the passes: each client's ``|x_l|²``, Gram matrix ``x_j x_jᵀ`` and new-atom scores; the
    global atoms' squared norms and low-precision copy are refreshed only for rows that change.  Everything
    that depends only on a count ``n_i ∈ 0..J`` (precisions, the popularity term) is tabulated once.  Removing
    client ``j`` before re-matching it is done on the score matrix (subtracting its Gram matrix from the
    products with the current atoms), so when ``j``'s assignment does not change no atom row is touched.
    ``settled`` holds the clients whose re-match would change nothing (see ``skip_settled`` in
    :func:`bbp_map`); when it holds every client only the atoms' order is tracked from then on.
    """

    def __init__(self, w, s, s0, prior_norm, gamma, cap, pop_cap, dtype, certify) -> None:
        J = self.J = len(w)
        self.s, self.s0, self.prior_norm, self.cap, self.dtype, self.certify = s, s0, prior_norm, cap, dtype, certify
        # Per client, not stacked: large temporaries cost page faults, and each client's arrays are small.
        x = [np.asarray(a, dtype=np.float64) for a in w]
        self.sizes = [a.shape[0] for a in x]
        if s != 1.0:
            x = [a * s for a in x]
        self.x = x
        # A unit's score for opening a new atom (before the offsets c_k): |x + μ0 s0|²/(s0 + s) − |μ0 s0|²/s0
        # = |x|² k + x·(2 μ0 s0 k) + |μ0 s0|² (k − 1/s0) with k = 1/(s0 + s).
        self.k_new = 1.0 / (s0 + s)
        self.pn2 = (2.0 * self.k_new) * prior_norm
        m2 = float(prior_norm @ prior_norm)
        self.c_new = m2 * self.k_new - m2 / s0
        # Per client, computed when the client is first matched (a client that never is needs none of them):
        # its units in ``dtype``, half squared norms, new-atom scores and Gram matrix x_j x_jᵀ (in ``dtype``).
        self.xc: list[np.ndarray | None] = [None] * J
        self.xxh: list[np.ndarray | None] = [None] * J
        self.new_score: list[np.ndarray | None] = [None] * J
        self.gram: dict[int, np.ndarray] = {}
        self.table = _count_table(J, s, s0, pop_cap)
        self.log_new = 2.0 * math.log(gamma / J)
        self.new_block: dict[tuple[int, int], np.ndarray] = {}
        self.new_offsets: dict[int, np.ndarray] = {}
        self.aranges = {Lj: np.arange(Lj) for Lj in set(self.sizes)}
        self.stats = {"solver": 0, "certified": 0, "unchanged": 0, "settled": 0}
        self.order = sorted(range(J), key=lambda j: -self.sizes[j])  # stable: ties keep client order
        first = self.order[0]
        self.g = prior_norm + x[first]
        self.g32 = self.g.astype(dtype)
        self.gg = _sqnorms(self.g)
        self.counts = np.ones(self.g.shape[0], dtype=np.int64)
        self.assign: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * J
        self.assign[first] = np.arange(self.g.shape[0])
        self.remap_last = np.empty(0, dtype=np.int64)
        self.settled: set[int] = set()
        # Once every client is settled only the atoms' order still changes: ``atom_order[p]`` (the atom now at
        # position p) is tracked instead of moving rows, and applied once at the end.
        self.atom_order: np.ndarray | None = None
        self.reordered = False
        self.alone_ids: list[np.ndarray] = []
        self.alone_mask: list[np.ndarray] = []

    # ---- per-client terms and atom bookkeeping
    def prep(self, j: int) -> np.ndarray:
        """Client ``j``'s per-client terms (computed once); returns its units in ``dtype``."""
        if self.xc[j] is None:
            a = self.x[j]
            self.xc[j] = a if self.dtype == np.float64 else a.astype(self.dtype)
            sq = _sqnorms(a)
            self.xxh[j] = 0.5 * sq
            self.new_score[j] = sq * self.k_new + (a @ self.pn2 + self.c_new)
        return self.xc[j]

    def arange_L(self, n_: int) -> np.ndarray:
        r = self.aranges.get(n_)
        if r is None:
            r = self.aranges[n_] = np.arange(n_)
        return r

    def refresh(self, rows_: np.ndarray) -> None:
        """Bring the low-precision copy and squared norms of the atoms ``rows_`` (distinct) up to date."""
        if len(rows_) == len(self.gg):  # every atom (a permutation): no gathers
            self.g32[...] = self.g
            self.gg[...] = _sqnorms(self.g)
            return
        gr = self.g[rows_]
        self.g32[rows_] = gr
        self.gg[rows_] = _sqnorms(gr)

    def products(self, j: int) -> np.ndarray:
        """Client ``j``'s units' products with the current atoms (in ``dtype``, returned in float64)."""
        return (self.prep(j) @ self.g32.T).astype(np.float64)

    def solve(self, j: int, dot: np.ndarray, gg_: np.ndarray, cnt_: np.ndarray) -> np.ndarray:
        """Scores of client ``j`` against the atoms (``dot`` = products, already without ``j``), then the
        maximising assignment: by certificate when possible, otherwise by the solver."""
        L, Lj = dot.shape[1], dot.shape[0]
        K = min(Lj, max(self.cap - L, Lj - L, 1))
        full = np.empty((Lj, L + K))
        score = full[:, :L]
        a2, gap, pop = self.table[:, cnt_]
        np.add(dot, self.xxh[j][:, None], out=score)
        score *= a2
        score += gg_ * gap + pop
        c = self.new_offsets.get(K)
        if c is None:  # k-th new atom: new_score + c_k
            c = self.new_offsets[K] = self.log_new - 2.0 * np.log(np.arange(1, K + 1))
        picked = _certified_assignment(score, self.new_score[j], c) if self.certify else None
        if picked is not None:
            self.stats["certified"] += 1
            return picked
        return self._solve_widening(j, full, L, K, c)

    def _solve_widening(self, j: int, full: np.ndarray, L: int, K: int, c: np.ndarray) -> np.ndarray:
        """Solve with only the first K' new-atom columns; if fewer than K' are used the answer is optimal for
        all K (the best total with m new atoms is concave in m: an assignment LP's value is concave in the
        number of rows sent to one side, and the new-atom offsets c_k decrease), else widen and re-solve."""
        Lj = full.shape[0]
        Kp = min(K, max(Lj - L, 4))
        while True:
            self.stats["solver"] += 1
            nb = self.new_block.get((j, Kp))
            if nb is None:
                nb = self.new_block[(j, Kp)] = self.new_score[j][:, None] + c[None, :Kp]
            full[:, L : L + Kp] = nb
            _, picked = linear_sum_assignment(full[:, : L + Kp], maximize=True)
            if Kp == K or int((picked >= L).sum()) < Kp:
                return picked  # rows == arange(Lj): the matrix is at least as wide as tall
            Kp = min(K, 4 * Kp)

    def add(self, j: int, picked: np.ndarray) -> None:
        """Absorb client ``j``'s units into the atoms ``picked`` (indices ≥ L open new atoms, in unit order)."""
        L = self.g.shape[0]
        old = picked < L
        if old.all():
            self.g[picked] += self.x[j]
            self.counts[picked] += 1
            self.refresh(picked)
            self.assign[j] = picked
            return
        rows = self.aranges[len(picked)]
        a = np.empty(len(picked), dtype=np.int64)
        a[old] = picked[old]
        self.g[picked[old]] += self.x[j][old]
        self.counts[picked[old]] += 1
        self.refresh(picked[old])
        new_rows = rows[~old]  # new atoms are appended in unit order (as the code does)
        a[new_rows] = L + np.arange(len(new_rows))
        fresh = self.prior_norm[None, :] + self.x[j][new_rows]
        self.g = np.vstack([self.g, fresh])
        self.g32 = np.vstack([self.g32, fresh.astype(self.dtype)])
        self.gg = np.concatenate([self.gg, _sqnorms(fresh)])
        self.counts = np.concatenate([self.counts, np.ones(len(new_rows), dtype=np.int64)])
        self.assign[j] = a

    def remove(self, j: int) -> None:
        """Take client ``j``'s units out of their atoms; atoms left empty are deleted (``remap_last``: old → new)."""
        a = self.assign[j]
        self.counts[a] -= 1
        self.g[a] -= self.x[j]
        keep = self.counts > 0
        if keep.all():
            self.refresh(a)
            self.remap_last = self.arange_L(len(keep))
            return
        remap = self.remap_last = np.cumsum(keep) - 1
        for k in range(self.J):
            if k != j:
                self.assign[k] = remap[self.assign[k]]
        self.g, self.counts = self.g[keep], self.counts[keep]
        self.g32, self.gg = self.g.astype(self.dtype), _sqnorms(self.g)

    # ---- the schedule
    def add_all(self) -> None:
        """Add the clients after the first (largest first), then mark the clients whose re-match would change
        nothing: the client added last (it was matched against all the others' atoms as they still are)."""
        for j in self.order[1:]:
            self.add(j, self.solve(j, self.products(j), self.gg, self.counts))
        self.settled = {self.order[-1]} if self.J > 1 else set()
        if self.J == 2 and self.sizes[0] == self.sizes[1]:
            # Two clients of one size: re-matching the first into the second's atoms is the problem just solved
            # with the roles swapped.  With all counts 1 its objective, Σ_matched [|μ0s0 + x_i + y_l|²/(s0 + 2s)
            # − |μ0s0 + y_l|²/(s0 + s) + pop] + Σ_unmatched i [|μ0s0 + x_i|²/(s0 + s) − |μ0s0|²/s0] + Σ c_k,
            # differs from the one just maximised by Σ_l |μ0s0 + y_l|²/(s0 + s) − Σ_i |μ0s0 + x_i|²/(s0 + s), a
            # constant: the same matching is optimal, so neither client's re-match can change the grouping.
            self.settled = {0, 1}

    def freeze_order(self) -> None:
        """Every client is settled: from now on track only ``atom_order`` and each client's atoms of its own."""
        self.atom_order = np.arange(len(self.counts))
        single = self.counts == 1
        for k in range(self.J if single.any() else 0):
            self.alone_ids.append(self.assign[k][single[self.assign[k]]])
            self.alone_mask.append(single)  # unused unless k has atoms of its own (then replaced)
            if len(self.alone_ids[k]):
                self.alone_mask[k] = np.zeros(len(self.counts), dtype=bool)
                self.alone_mask[k][self.alone_ids[k]] = True

    def move_alone(self, j: int) -> None:
        """A settled pass over ``j``: its own atoms are deleted and re-appended in unit order."""
        self.stats["settled"] += 1
        if self.alone_ids and len(self.alone_ids[j]):
            self.atom_order = np.concatenate([self.atom_order[~self.alone_mask[j][self.atom_order]], self.alone_ids[j]])
            self.reordered = True

    def rematch(self, j: int, skip_settled: bool) -> None:
        """Take client ``j`` out of the atoms and match it again (only the bookkeeping when it is settled)."""
        a = self.assign[j]
        cnt_ = self.counts.copy()
        cnt_[a] -= 1
        alone = cnt_[a] == 0
        if skip_settled and j in self.settled:  # re-matching j would change nothing: only the index bookkeeping
            self.stats["settled"] += 1
            if alone.any():
                self._reappend(j, a, alone)
        elif alone.any():  # j held atoms alone: they are deleted first, as the code does
            self._rematch_after_delete(j, a, alone)
        else:
            self._rematch_in_place(j, a, cnt_)

    def _reappend(self, j: int, a: np.ndarray, alone: np.ndarray) -> None:
        """A settled client with atoms of its own keeps its matches; its own atoms move to the end."""
        kept = a[~alone]
        self.remove(j)
        picked = np.empty(len(a), dtype=np.int64)
        picked[~alone] = self.remap_last[kept]
        picked[alone] = self.g.shape[0] + np.arange(int(alone.sum()))
        self.add(j, picked)

    def _rematch_after_delete(self, j: int, a: np.ndarray, alone: np.ndarray) -> None:
        kept = a[~alone]
        self.remove(j)
        L = self.g.shape[0]
        picked = self.solve(j, self.products(j), self.gg, self.counts)
        same = bool((picked[alone] >= L).all()) and np.array_equal(picked[~alone], self.remap_last[kept])
        self.add(j, picked)
        self.settled = self.settled | {j} if same else {j}

    def _rematch_in_place(self, j: int, a: np.ndarray, cnt_: np.ndarray) -> None:
        """Re-match ``j`` on the score matrix: its contribution is subtracted from the products and norms, and
        the atoms are touched only when its assignment changes."""
        xj = self.prep(j)
        dot = (xj @ self.g32.T).astype(np.float64)
        rows = self.aranges[len(a)]
        gg_ = self.gg.copy()
        gg_[a] += 2.0 * (self.xxh[j] - dot[rows, a])  # |g_i − x_l|² for the atoms j contributed to
        gj = self.gram.get(j)
        if gj is None:
            gj = self.gram[j] = xj @ xj.copy().T  # (a copy: numpy's x xᵀ path is slower here)
        dot[:, a] -= gj  # products with the atoms without j
        picked = self.solve(j, dot, gg_, cnt_)
        if np.array_equal(picked, a):
            self.stats["unchanged"] += 1
            self.settled.add(j)
            return
        self.remove(j)
        self.add(j, picked)
        self.settled = {j}  # j's choice depends only on the others' atoms, which it did not change

    def result(self) -> BBPResult:
        g, counts, assign = self.g, self.counts, self.assign
        if self.reordered:
            where = np.empty_like(self.atom_order)
            where[self.atom_order] = np.arange(len(self.atom_order))
            g, counts = g[self.atom_order], counts[self.atom_order]
            assign = [where[a] for a in assign]
        p = np.broadcast_to((self.s0 + counts * self.s)[:, None], g.shape)  # read-only: one precision per atom
        return BBPResult(g / p, g, p, counts, [np.asarray(a) for a in assign], self.stats)


def _count_table(J: int, s: float, s0: float, pop_cap: int) -> np.ndarray:
    """Everything that depends only on an atom's count n = 0..J, in one (3, J + 1) table (one gather per update):
    2/(p + s), |g|²(1/(p + s) − 1/p) per |g|², and the popularity term log(min(n,10)/(J − min(n,10)))."""
    rows_tab = []
    for n in range(J + 1):
        inv_ps2 = 2.0 / (s0 + (n + 1) * s)
        c_n = min(n, pop_cap)
        pop_n = math.log(c_n / max(J - c_n, 1e-12)) if c_n else -math.inf  # count 0: never a live atom
        rows_tab.append((inv_ps2, 0.5 * inv_ps2 - 1.0 / (s0 + n * s), pop_n))
    return np.array(rows_tab).T.copy()


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
