"""Simple-FedMA's alignment: permute one client's units to line up with a reference (hard permutations, no
growth), multi-head groups of one block jointly, as pure functions on named tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from fedfuse.fusion.match import atoms_of, pair_cost
from fedfuse.fusion.permute import PermGroup, permute
from fedfuse.types import TensorDict


def _within(a: np.ndarray, b: np.ndarray, metric: str) -> tuple[np.ndarray, float]:
    cost = pair_cost(a, b, metric)
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
