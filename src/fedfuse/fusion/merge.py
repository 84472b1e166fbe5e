"""Model-merging operators (FedMerge): pure functions on named tensors and merging-weight matrices.

Notation (FedMerge, Eq. 4 and App. D): d global models Θ_1..Θ_d, merging logits a ∈ R^{m×d}, weights
w = row-softmax(a), client i's merged model θ_i = Σ_j w_ij Θ_j.

BatchNorm and friends, explicitly:

* floating entries — weights, biases, BN ``running_mean`` / ``running_var`` — are merged and updated with
  the same weights as the parameters (the merged model is the *full* state);
* integer entries (``num_batches_tracked``) cannot be weighted: merging takes the max over the global
  models with a non-zero weight (``int_policy="max"``) or the first model's value (``"first"``); the
  delta update adds the largest client delta among the clients that touch Θ_j (``"max"``) or keeps the
  value (``"first"``).  With one global model and all clients this is exactly FedAvg's ``"max"`` policy;
* the logit inner product uses *parameters* only (never buffers), restricted to a key subset;
* a key a client did not send is a zero delta for that client (paper form), or is averaged over the
  clients that did send it (column-normalised form); a key nobody sent keeps its value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fedfuse.errors import UserError
from fedfuse.fusion.average import flat_vector
from fedfuse.types import TensorDict

States = Sequence[Mapping[str, torch.Tensor]]


def row_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise softmax in float64 (``-inf`` logits give exact zeros: the Fixed(k/d) ablation)."""
    return torch.softmax(logits.to(torch.float64), dim=-1)


def merge_states(globals_: States, weights: Sequence[float] | torch.Tensor, int_policy: str = "max") -> TensorDict:
    """θ = Σ_j w_j Θ_j on every state entry (float64 accumulation, cast back to each entry's dtype)."""
    w = [float(x) for x in (weights.tolist() if isinstance(weights, torch.Tensor) else weights)]
    if len(w) != len(globals_):
        raise ValueError(f"{len(w)} weights for {len(globals_)} global models")
    out: TensorDict = {}
    for k, ref in globals_[0].items():
        if ref.is_floating_point():
            acc = torch.zeros_like(ref, dtype=torch.float64)
            for g, wj in zip(globals_, w):
                if wj != 0.0:
                    acc.add_(g[k].to(torch.float64), alpha=wj)
            out[k] = acc.to(ref.dtype)
        elif int_policy == "max":
            held = [g[k] for g, wj in zip(globals_, w) if wj > 0] or [ref]
            out[k] = torch.stack(held).amax(0)
        elif int_policy == "first":
            out[k] = ref.clone()
        else:
            raise UserError(f"unknown int_policy {int_policy!r}; choose max or first")
    return out


def inner_products(
    deltas: States, globals_: States, sent: States, keys: Sequence[str]
) -> torch.Tensor:
    """``P[i, j] = ⟨Δθ_i, Θ_j − θ_i⟩`` over ``keys`` (a client missing a key contributes 0 for it)."""
    P = torch.zeros(len(deltas), len(globals_), dtype=torch.float64)
    for i, (dl, th) in enumerate(zip(deltas, sent)):
        present = [k for k in keys if k in dl]
        dv, tv = flat_vector(dl, present), flat_vector(th, present)
        for j, g in enumerate(globals_):
            P[i, j] = torch.dot(dv, flat_vector(g, present) - tv) if present else 0.0
    return P


def logit_gradient(weights: torch.Tensor, inner: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """App. D in delta form: ``g_ij = s_i · w_ij · ⟨Δθ_i, Θ_j − θ_i⟩`` (an *ascent* direction for a).

    With one SGD step Δθ_i = −η ∂ℓ_i/∂θ_i, so g = −η ∂L/∂a for L = Σ_i s_i ℓ_i: adding g descends L.
    """
    return scale.to(torch.float64)[:, None] * weights.to(torch.float64) * inner.to(torch.float64)


def fixed_magnitude_step(logits: torch.Tensor, grad: torch.Tensor, step: float) -> torch.Tensor:
    """``a + step · G / max|G|``: the largest logit change is exactly ``step`` (closed form of the code's
    search, which moves along G/‖G‖₁ in small increments until a change exceeds the step)."""
    m = float(grad.abs().max()) if grad.numel() else 0.0
    if m == 0.0 or not np.isfinite(m):
        return logits.clone()
    return logits + step * grad.to(logits.dtype) / m


def paper_coefficients(weights: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Eq. 8: ``c_ij = (n_i/n) · w_ij``."""
    return scale.to(torch.float64)[:, None] * weights.to(torch.float64)


def column_normalised(weights: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Author code: ``ŵ_ij = w_ij n_i / Σ_k w_kj n_k`` (each column sums to 1 over the given clients)."""
    c = weights.to(torch.float64) * sizes.to(torch.float64)[:, None]
    col = c.sum(0, keepdim=True)
    return torch.where(col > 0, c / col.clamp_min(1e-300), torch.zeros_like(c))


def update_globals(
    globals_: States,
    deltas: States,
    coef: torch.Tensor,
    lr: float = 1.0,
    *,
    normalised: bool = False,
    int_policy: str = "max",
) -> list[TensorDict]:
    """``Θ_j ← Θ_j + lr · Σ_i c_ij Δθ_i`` on every entry.

    ``normalised``: for a key some clients did not send, divide by Σ c_ij over the clients that did (the
    column-normalised form stays an average); otherwise a missing key is a zero delta.
    """
    known = set(globals_[0])
    for dl in deltas:
        extra = set(dl) - known
        if extra:
            raise ValueError(f"delta has keys the global models do not: {sorted(extra)[:3]}")
    out: list[TensorDict] = []
    for j, g in enumerate(globals_):
        new: TensorDict = {}
        for k, v in g.items():
            holders = [(dl[k], float(coef[i, j])) for i, dl in enumerate(deltas) if k in dl]
            if not holders:
                new[k] = v.clone()
                continue
            if v.is_floating_point():
                total = sum(c for _, c in holders) if normalised else 1.0
                if total <= 0:
                    new[k] = v.clone()
                    continue
                acc = v.to(torch.float64).clone()
                for t, c in holders:
                    if c != 0.0:
                        acc.add_(t.to(torch.float64), alpha=lr * c / total)
                new[k] = acc.to(v.dtype)
            elif int_policy == "max":
                touched = [t for t, c in holders if c > 0]
                new[k] = v + torch.stack(touched).amax(0).to(v.dtype) if touched else v.clone()
            elif int_policy == "first":
                new[k] = v.clone()
            else:
                raise UserError(f"unknown int_policy {int_policy!r}; choose max or first")
        out.append(new)
    return out


def server_step(
    globals_: States,
    logits: torch.Tensor,
    clients: Sequence[int],
    deltas: States,
    sizes: torch.Tensor,
    total: float,
    keys: Sequence[str],
    *,
    step: float,
    merge_update: str = "fixed",
    weights_first: bool = False,
    theta_update: str = "column_normalised",
    theta_lr: float = 1.0,
    int_policy: str = "max",
) -> tuple[list[TensorDict], torch.Tensor]:
    """One FedMerge server round on the replies of ``clients`` (deltas Δθ_i, example counts n_i).

    1. Merging logits (skipped when ``step`` is 0): G_ij = s_i w_ij ⟨Δθ_i, Θ_j − θ_i⟩ over ``keys`` with
       s_i = n_i / ``total``; ``merge_update="fixed"`` moves the largest logit by exactly ``step``,
       ``"gradient"`` takes a += step · G.
    2. Global models: Θ_j += η_Θ Σ_i c_ij Δθ_i with c = the paper's s_i w_ij (Eq. 8) or the author code's
       column-normalised w_ij n_i / Σ_k w_kj n_k; ``weights_first`` uses the updated weights (code order).

    Returns the new global models and the full logit matrix (rows of other clients unchanged).
    """
    idx = torch.tensor(list(clients))
    scale = sizes / total if total > 0 else torch.zeros_like(sizes)
    logits = logits.clone()
    w_old = row_softmax(logits[idx])
    if step > 0:
        sent = [merge_states([{k: g[k] for k in keys} for g in globals_], w_old[r]) for r in range(len(clients))]
        grad = logit_gradient(w_old, inner_products(deltas, globals_, sent, keys), scale)
        if merge_update == "fixed":
            logits[idx] = fixed_magnitude_step(logits[idx], grad, step)
        else:
            logits[idx] = logits[idx] + step * grad
    w = row_softmax(logits[idx]) if weights_first else w_old
    if theta_update == "paper":
        coef, normalised = paper_coefficients(w, scale), False
    else:
        coef, normalised = column_normalised(w, sizes), True
    return update_globals(globals_, deltas, coef, theta_lr, normalised=normalised, int_policy=int_policy), logits


def merge_entropy(weights: np.ndarray) -> float:
    """Mean row entropy (nats) of a merging-weight matrix: log d for uniform rows, 0 for one-hot rows."""
    return float(-(weights * np.log(np.clip(weights, 1e-300, None))).sum(1).mean())


def select_keys(model: torch.nn.Module, spec: str) -> list[str]:
    """Parameter keys entering the logit inner product: ``head`` | ``last-K`` (last K layers) | ``all``.

    Buffers (BN statistics, counters) never enter: the code skips them too.
    """
    params = [k for k, _ in model.named_parameters()]
    pset = set(params)
    if spec == "all":
        return params
    if spec == "head":
        keys = [k for k in model.head_keys() if k in pset]  # type: ignore[operator]
    elif spec.startswith("last-"):
        try:
            n = int(spec.split("-", 1)[1])
        except ValueError:
            raise UserError(f"merge_params={spec!r}: use last-K with an integer K") from None
        layers = [layer for layer in model.layers() if any(k in pset for k in layer.keys)]  # type: ignore[operator]
        if n < 1:
            raise UserError(f"merge_params={spec!r}: K must be >= 1")
        keys = [k for layer in layers[-n:] for k in layer.keys if k in pset]
    else:
        raise UserError(f"merge_params={spec!r}; choose head, last-K or all")
    if not keys:
        raise UserError(f"merge_params={spec!r} selects no parameters of {type(model).__name__}")
    return keys


def fixed_weights(num_clients: int, d: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Fixed(k/d) ablation logits: each client picks k of the d models (uniform weight), others −inf."""
    if not 1 <= k <= d:
        raise UserError(f"fixed_k must be in [1, d={d}], got {k}")
    a = torch.full((num_clients, d), float("-inf"), dtype=torch.float64)
    for i in range(num_clients):
        a[i, rng.choice(d, size=k, replace=False)] = 0.0
    return a


def cluster_ari(rows: np.ndarray, groups: Sequence[int], seed: int = 0) -> float:
    """Adjusted Rand index between a k-means clustering of ``rows`` (K = number of true groups) and ``groups``."""
    import warnings

    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_rand_score

    k = len(set(groups))
    if k < 2 or len(groups) < 2:
        return float("nan")
    uniq = np.unique(np.round(rows, 12), axis=0)
    if len(uniq) < 2:
        pred = np.zeros(len(groups), dtype=int)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pred = KMeans(n_clusters=min(k, len(uniq)), n_init=10, random_state=seed).fit_predict(rows)
    return float(adjusted_rand_score(list(groups), pred))
