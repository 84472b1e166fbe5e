"""Pluggable client sampling: which clients take part in a round, and with what aggregation weight.

The run option ``sampling`` picks the policy; every algorithm that leaves participant selection to the engine
(the base :meth:`~fedfuse.algorithms.base.Algorithm.select_clients`) accepts every policy:

* ``uniform`` — m = ``clients_per_round`` distinct clients drawn uniformly without replacement (FedAvg's
  sampling; this is what ``Algorithm.select_clients`` does).
* ``size-weighted`` — "MD" sampling (Li et al. 2020; Fraboni et al. 2021 §2): m independent draws *with*
  replacement from the multinomial distribution p_i = n_i / Σ n_j.
* ``clustered`` — clustered sampling of Fraboni et al. (ICML 2021), Algorithm 2: m distributions r_k over the
  clients, one client drawn from each, built so that Σ_k r_{k,i} = m·p_i for every client i (Proposition 1:
  the expected aggregation weight of client i stays p_i) and similar clients share a distribution
  (lower variance of the aggregation weights, better representativity).  Similarity follows the authors'
  code (``Accenture/Labs-Federated-Learning``, branch ``clustered_sampling``): every client keeps a
  *representative gradient* = its last local model minus the global model it started from (zero until it
  first participates); the angle arccos(cos(g_i, g_j)) between two clients' gradients (0 when either is zero)
  fills a K×K matrix; Ward linkage clusters the clients (the code passes the matrix to ``scipy``'s
  ``linkage``, which treats each row as a client's feature vector — kept); the tree is cut where a
  cluster's total weight would exceed 1/m, the m heaviest clusters each seed a distribution, and the clients
  of the remaining clusters fill the distributions' leftover mass in a random order.  With no gradient
  information (all zeros, round 0) the tree degenerates and the result is still a valid set of distributions.
* ``poisson`` — every client independently with probability m/N (DP-FedAvg's sampling, :mod:`fedfuse.privacy.dp`).
* ``clustered-size`` — Fraboni's Algorithm 1 (clusters by sample size only): clients sorted by p_i fill the
  m distributions in order.

Aggregation weights.  A sampled client's unbiased aggregation weight is put into its result's
``meta["sampling_weight"]``: (times drawn)/m for ``size-weighted`` and the clustered policies (Fraboni's
aggregation, Σ = 1), N·p_i/m for ``uniform`` (unbiased for without-replacement sampling; it sums to 1 only in
expectation).  FedAvg-family algorithms keep their own weighting; CluSamp (:mod:`fedfuse.algorithms.clusamp`)
aggregates with these weights as Fraboni's code does.  A client drawn twice trains once and counts twice.

``auto`` (the run default) uses the algorithm's ``default_sampling`` (``uniform`` unless it declares another).
Algorithms that choose their own participants (MSfusion, D-PSGD, FedMA: everyone, every round) ignore the
policy when every client takes part and reject a non-uniform policy otherwise.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from fedfuse.engine.context import RoundInfo
from fedfuse.engine.contract import Algorithm
from fedfuse.errors import UserError
from fedfuse.types import Message, TensorDict

SAMPLINGS = ("auto", "uniform", "size-weighted", "clustered", "clustered-size", "poisson")


# ------------------------------------------------------------------------------------------ pure math
def size_distributions(m: int, weights: np.ndarray) -> np.ndarray:
    """Fraboni et al. Algorithm 1: (m, K) distributions with Σ_k r_{k,i} = m·p_i, clients filled by size."""
    p = _normalised(weights)
    order = np.argsort(-p, kind="stable")
    return _fill(m, [order], p, np.zeros((m, len(p))))


def clustered_distributions(m: int, weights: np.ndarray, gradients: np.ndarray,
                            rng: np.random.Generator) -> np.ndarray:
    """Fraboni et al. Algorithm 2 on representative gradients ``(K, D)``: (m, K) distributions.

    Every row sums to 1 and every column to m·p_i.  Clusters of the Ward tree whose weight is at most 1/m
    are kept whole where possible (the m heaviest seed one distribution each).
    """
    from scipy.cluster.hierarchy import ClusterWarning, fcluster, linkage

    p = _normalised(weights)
    k = len(p)
    if m >= k or k < 2:
        return size_distributions(m, p)
    angles = angle_matrix(gradients)
    with warnings.catch_warnings():  # rows as observations is deliberate (authors' code), not a mistaken input
        warnings.simplefilter("ignore", ClusterWarning)
        link = linkage(angles, "ward")
    # relabel merge heights with the merged cluster's weight, then cut at weight 1/m
    w = list(p)
    for row in link:
        merged = w[int(row[0])] + w[int(row[1])]
        w.append(merged)
        row[2] = merged
    labels = fcluster(link, 1.0 / m + 1e-12, criterion="distance")
    clusters = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    clusters.sort(key=lambda idx: (p[idx].sum(), -idx.min()))  # lightest first
    # a single client heavier than 1/m forms its own cluster and must be spread over several distributions
    light = [idx for idx in clusters if m * p[idx].sum() <= 1.0 + 1e-9]
    heavy = [idx for idx in clusters if m * p[idx].sum() > 1.0 + 1e-9]
    kept, rest = light[max(len(light) - m, 0):], heavy + light[: max(len(light) - m, 0)]
    r = np.zeros((m, k))
    for row, idx in enumerate(kept):
        r[row, idx] = m * p[idx]
    return _fill(m, [rng.permutation(idx) for idx in rest], p, r)


def _fill(m: int, groups: list[np.ndarray], p: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Pour m·p_i of every client in ``groups`` into the distributions in order, each up to mass 1."""
    row = 0
    for idx in groups:
        for i in idx:
            left = m * p[i]
            while left > 1e-12 and row < m:
                room = 1.0 - r[row].sum()
                put = min(room, left)
                r[row, i] += put
                left -= put
                if 1.0 - r[row].sum() <= 1e-12:
                    row += 1
            if left > 1e-12:  # rounding: give the crumbs to the last distribution
                r[m - 1, i] += left
    return r / r.sum(axis=1, keepdims=True)


def angle_matrix(gradients: np.ndarray) -> np.ndarray:
    """arccos of the cosine similarity between every pair of rows; 0 where a row is zero (authors' code)."""
    g = np.asarray(gradients, dtype=np.float64)
    norms = np.linalg.norm(g, axis=1)
    safe = np.where(norms > 0, norms, 1.0)
    cos = np.clip((g @ g.T) / np.outer(safe, safe), -1.0, 1.0)
    ang = np.arccos(cos)
    zero = norms == 0
    ang[zero, :] = 0.0
    ang[:, zero] = 0.0
    return ang


def _normalised(weights: np.ndarray) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError("client weights must be a non-empty vector of non-negative numbers with a positive sum")
    return w / w.sum()


def draw(distributions: np.ndarray, rng: np.random.Generator) -> list[int]:
    """One client from each distribution (the m draws, duplicates kept)."""
    return [int(rng.choice(distributions.shape[1], p=row)) for row in distributions]


# ------------------------------------------------------------------------------------------ samplers
class Sampler:
    """A sampling policy bound to a run.  ``select`` returns the sorted distinct participants; ``weights``
    their aggregation weights; ``observe`` sees the round's payloads and results (for gradient-based policies).
    ``state_dict``/``load_state_dict`` let a resumed run continue exactly."""

    name = "uniform"

    def __init__(self, num_clients: int, per_round: int, sizes: np.ndarray, param_keys: set[str] | None = None):
        self.num_clients = int(num_clients)
        self.m = min(int(per_round), self.num_clients)
        self.p = _normalised(np.maximum(np.asarray(sizes, dtype=np.float64), 0) + (0 if np.sum(sizes) else 1))
        self.param_keys = param_keys
        self.counts: dict[int, int] = {}

    def select(self, algo: Algorithm, info: RoundInfo, rng: np.random.Generator) -> list[int]:
        clients = algo.select_clients(info, rng)
        self.counts = {c: 1 for c in clients}
        return clients

    def weights(self) -> dict[int, float]:
        if self.name == "uniform":
            return {c: self.num_clients * float(self.p[c]) / max(len(self.counts), 1) for c in self.counts}
        return {c: n / self.m for c, n in self.counts.items()}

    def observe(self, payloads: dict[int, Message], results: dict[int, Message]) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class SizeWeightedSampler(Sampler):
    name = "size-weighted"

    def distributions(self, rng: np.random.Generator) -> np.ndarray:
        return np.tile(self.p, (self.m, 1))

    def select(self, algo: Algorithm, info: RoundInfo, rng: np.random.Generator) -> list[int]:
        drawn = draw(self.distributions(rng), rng)
        self.counts = {c: drawn.count(c) for c in sorted(set(drawn))}
        return sorted(self.counts)


class ClusteredSizeSampler(SizeWeightedSampler):
    name = "clustered-size"

    def distributions(self, rng: np.random.Generator) -> np.ndarray:
        return size_distributions(self.m, self.p)


class ClusteredSampler(SizeWeightedSampler):
    """Algorithm 2 over representative gradients, sketched to at most ``sketch_dim`` coordinates.

    Storing K full gradients costs K × (model size); above ``sketch_dim`` parameters each gradient is
    compressed by a fixed random signed hashing (count sketch), which preserves inner products in
    expectation and so the angles the clustering uses.
    """

    name = "clustered"
    sketch_dim = 1 << 18

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grads: np.ndarray | None = None  # (K, D) float32
        self._sketch: tuple[torch.Tensor, torch.Tensor] | None = None

    def distributions(self, rng: np.random.Generator) -> np.ndarray:
        g = self.grads if self.grads is not None else np.zeros((self.num_clients, 1), dtype=np.float32)
        return clustered_distributions(self.m, self.p, g, rng)

    def _flat(self, new: TensorDict, old: TensorDict) -> torch.Tensor | None:
        keys = [k for k in sorted(new) if k in old and new[k].shape == old[k].shape and new[k].is_floating_point()
                and not k.startswith("sim/") and (self.param_keys is None or k in self.param_keys)]
        if not keys:
            return None
        v = torch.cat([(new[k].detach().float() - old[k].detach().float()).reshape(-1).cpu() for k in keys])
        if v.numel() <= self.sketch_dim:
            return v
        if self._sketch is None or self._sketch[0].numel() != v.numel():
            gen = torch.Generator().manual_seed(12345)
            idx = torch.randint(0, self.sketch_dim, (v.numel(),), generator=gen)
            sign = torch.randint(0, 2, (v.numel(),), generator=gen).float() * 2 - 1
            self._sketch = (idx, sign)
        idx, sign = self._sketch
        return torch.zeros(self.sketch_dim).index_add_(0, idx, v * sign)

    def observe(self, payloads: dict[int, Message], results: dict[int, Message]) -> None:
        for c, res in results.items():
            if c not in payloads:
                continue
            v = self._flat(res.tensors, payloads[c].tensors)
            if v is None:
                continue
            if self.grads is None or self.grads.shape[1] != v.numel():
                self.grads = np.zeros((self.num_clients, v.numel()), dtype=np.float32)
            self.grads[c] = v.numpy()

    def state_dict(self) -> dict[str, Any]:
        return {"grads": None if self.grads is None else self.grads.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        g = state.get("grads")
        self.grads = None if g is None else np.asarray(g, dtype=np.float32)


class PoissonSampler(Sampler):
    """Every client takes part independently with probability q = m/N (McMahan et al. 2018's sampling for DP-FedAvg:
    the privacy amplification the accountant's ``PoissonSampledDpEvent`` assumes).  The number of participants
    varies round to round (its mean is m); the weights are FedAvg-style 1/m-normalised (N·p_i/m, as ``uniform``)."""

    name = "poisson"

    def select(self, algo: Any, info: Any, rng: np.random.Generator) -> list[int]:
        q = self.m / self.num_clients
        clients = [int(c) for c in np.flatnonzero(rng.random(self.num_clients) < q)]
        self.counts = {c: 1 for c in clients}
        return clients

    def weights(self) -> dict[int, float]:
        return {c: self.num_clients * float(self.p[c]) / self.m for c in self.counts}


SAMPLERS: dict[str, type[Sampler]] = {
    "uniform": Sampler,
    "poisson": PoissonSampler,
    "size-weighted": SizeWeightedSampler,
    "clustered": ClusteredSampler,
    "clustered-size": ClusteredSizeSampler,
}


def make_sampler(name: str, algo: Algorithm) -> Sampler:
    """The sampler named ``name`` (``auto`` → the algorithm's ``default_sampling``) for ``algo``'s run.

    An algorithm with its own participation rule says so in ``selects_own_clients`` (the engine does not
    inspect algorithm classes)."""
    if name == "auto":
        name = algo.default_sampling
    if name not in SAMPLERS:
        raise UserError(f"sampling={name!r}; choose one of: {', '.join(SAMPLINGS)}")
    ctx = algo.ctx
    own = algo.selects_own_clients
    if name != "uniform" and own and ctx.clients_per_round < ctx.num_clients:
        raise UserError(
            f"sampling={name!r}: algorithm {algo.name!r} chooses its own participants; use sampling=uniform "
            f"(or clients_per_round={ctx.num_clients}, when every client takes part)"
        )
    if own:  # the algorithm's own rule (full participation): nothing to sample
        name = "uniform"
    try:
        keys = ctx.param_keys({})
    except Exception:  # models that cannot be built without meta
        keys = None
    return SAMPLERS[name](ctx.num_clients, ctx.clients_per_round, ctx.client_sizes, keys)


__all__ = ["SAMPLERS", "SAMPLINGS", "Sampler", "angle_matrix", "clustered_distributions", "draw", "make_sampler",
           "size_distributions"]
