"""Averaging operators: pure functions on named tensors (state dicts).

BatchNorm handling is explicit:

* floating tensors — weights, biases, ``running_mean`` and ``running_var`` — are averaged with the
  given weights (the usual FedAvg treatment of BN statistics);
* integer tensors — ``num_batches_tracked`` — cannot be averaged meaningfully; ``int_policy`` picks
  ``"max"`` (default: the buffer keeps counting like a single model trained for the longest), ``"sum"``
  (total batches seen by all clients) or ``"first"`` (keep the base/first value);
* a key some clients did not send (a parameter they did not train) is averaged over the clients that
  sent it, with their weights renormalised; a key nobody sent keeps its value in ``base``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from fedfuse.errors import UserError
from fedfuse.types import TensorDict

IntPolicy = Literal["max", "sum", "first"]


def weighted_average(
    states: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float] | None = None,
    *,
    base: Mapping[str, torch.Tensor] | None = None,
    int_policy: IntPolicy = "max",
) -> TensorDict:
    """Weighted average of state dicts, key by key.

    ``weights`` need not be normalised (FedAvg passes sample counts).  The result contains the union
    of the keys of ``states`` and ``base``; float results keep the dtype of the inputs.
    """
    if not states:
        if base is None:
            raise ValueError("weighted_average needs at least one state or a base")
        return {k: v.clone() for k, v in base.items()}
    weights = _checked_weights(weights, len(states))
    out: TensorDict = {}
    for k in _union_keys(states, base):
        holders = [(s[k], float(w)) for s, w in zip(states, weights) if k in s]
        kept = base[k] if base is not None and k in base else None
        if not holders:
            assert kept is not None
            out[k] = kept.clone()
        elif holders[0][0].is_floating_point() or holders[0][0].is_complex():
            out[k] = _average_float(holders, kept)
        else:
            out[k] = _combine_int([t for t, _ in holders], int_policy, kept)
    return out


def _checked_weights(weights: Sequence[float] | None, n: int) -> Sequence[float]:
    """``weights`` (default: all 1) after checking there is one per state and none is negative."""
    if weights is None:
        return [1.0] * n
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} states")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")
    return weights


def _union_keys(states: Sequence[Mapping[str, torch.Tensor]], base: Mapping[str, torch.Tensor] | None) -> list[str]:
    """The keys of ``base`` then those the states add, each once, in first-seen order."""
    keys: list[str] = list(base.keys()) if base is not None else []
    seen = set(keys)
    for s in states:
        for k in s:
            if k not in seen:
                seen.add(k)
                keys.append(k)
    return keys


def _average_float(holders: list[tuple[torch.Tensor, float]], base: torch.Tensor | None) -> torch.Tensor:
    """Weighted mean of one floating key over the clients that sent it (``base``, else the first, if all weigh 0)."""
    ref = holders[0][0]
    total = sum(w for _, w in holders)
    if total <= 0:
        return (base if base is not None else ref).clone()
    acc = torch.zeros_like(ref, dtype=torch.float64 if ref.dtype == torch.float64 else torch.float32)
    for t, w in holders:
        acc.add_(t.to(acc.dtype), alpha=w / total)
    return acc.to(ref.dtype)


def _combine_int(tensors: list[torch.Tensor], policy: IntPolicy, base: torch.Tensor | None) -> torch.Tensor:
    if policy == "max":
        return torch.stack(tensors).amax(0)
    if policy == "sum":
        return torch.stack(tensors).sum(0)
    if policy == "first":
        return (base if base is not None else tensors[0]).clone()
    raise UserError(f"unknown int_policy {policy!r}; choose max, sum or first")


def delta(after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]) -> TensorDict:
    """``after - before`` on floating entries; integer entries (``num_batches_tracked``) are differenced too."""
    return {k: after[k] - before[k] for k in after if k in before}


def add_scaled(
    state: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor], scale: float = 1.0
) -> TensorDict:
    """``state + scale * update`` for floating entries present in ``update``; other entries copied.

    Integer entries are added unscaled (a count of batches cannot be scaled).
    """
    out: TensorDict = {}
    for k, v in state.items():
        if k not in update:
            out[k] = v.clone()
        elif v.is_floating_point():
            out[k] = v + scale * update[k].to(v.dtype)
        else:
            out[k] = v + update[k].to(v.dtype)
    return out


def clone_state(state: Mapping[str, torch.Tensor]) -> TensorDict:
    """Detached deep copy of a state dict."""
    return {k: v.detach().clone() for k, v in state.items()}


def flat_vector(state: Mapping[str, torch.Tensor], keys: Sequence[str]) -> torch.Tensor:
    """The float64 concatenation of ``state[k]`` for ``keys`` (in the given order; no keys: an empty vector)."""
    parts = [state[k].detach().reshape(-1).to(torch.float64) for k in keys]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


# ---- robust fusion (for studying faulty or poisoned clients) -------------------------------------------

RobustRule = Literal["mean", "median", "trimmed-mean"]


def _robust_stack(stack: torch.Tensor, rule: str, trim: float) -> torch.Tensor:
    """Coordinate-wise median or trimmed mean over dim 0 (float64 accumulation)."""
    n = stack.shape[0]
    srt = stack.to(torch.float64).sort(dim=0).values
    if rule == "median":
        mid = n // 2
        return srt[mid] if n % 2 else (srt[mid - 1] + srt[mid]) / 2
    k = int(trim * n)
    if n - 2 * k < 1:
        k = (n - 1) // 2
    return srt[k:n - k].mean(0)


def robust_average(
    states: Sequence[Mapping[str, torch.Tensor]],
    rule: RobustRule = "median",
    *,
    trim: float = 0.1,
    base: Mapping[str, torch.Tensor] | None = None,
    int_policy: IntPolicy = "max",
) -> TensorDict:
    """Coordinate-wise median (Yin et al. 2018) or ``trim``-trimmed mean of state dicts, key by key.

    Unweighted by design: a client cannot buy influence with a claimed sample count.  For every coordinate the
    trimmed mean drops the ``floor(trim * n)`` largest and smallest values (at least one value is kept).  Keys
    follow :func:`weighted_average`: a key is fused over the clients that sent it, a key nobody sent keeps its
    ``base`` value, and integer buffers (``num_batches_tracked``) follow ``int_policy``.  ``rule="mean"`` is the
    plain unweighted average.
    """
    if rule == "mean":
        return weighted_average(states, None, base=base, int_policy=int_policy)
    if rule not in ("median", "trimmed-mean"):
        raise UserError(f"unknown fusion rule {rule!r}; choose mean, median or trimmed-mean")
    if not 0 <= trim < 0.5:
        raise UserError(f"trim must be in [0, 0.5), got {trim}")
    if not states:
        if base is None:
            raise ValueError("robust_average needs at least one state or a base")
        return {k: v.clone() for k, v in base.items()}
    keys: list[str] = list(base.keys()) if base is not None else []
    for s in states:
        keys += [k for k in s if k not in keys]
    out: TensorDict = {}
    for k in keys:
        held = [s[k] for s in states if k in s]
        if not held:
            assert base is not None
            out[k] = base[k].clone()
        elif held[0].is_floating_point():
            out[k] = _robust_stack(torch.stack(held), rule, trim).to(held[0].dtype)
        else:
            out[k] = _combine_int(held, int_policy, base[k] if base is not None and k in base else None)
    return out


def clip_updates(
    states: Sequence[Mapping[str, torch.Tensor]], base: Mapping[str, torch.Tensor], max_norm: float
) -> list[TensorDict]:
    """Each state with its update ``state - base`` scaled down to L2 norm ``<= max_norm`` (Sun et al. 2019).

    The norm runs over the floating entries both hold; integer buffers and keys missing from ``base`` are
    left as they are.  ``max_norm <= 0`` returns copies unchanged."""
    out = []
    for s in states:
        keys = [k for k, v in s.items() if v.is_floating_point() and k in base and base[k].shape == v.shape]
        sq = sum(float(((s[k].double() - base[k].double()) ** 2).sum()) for k in keys)
        norm = sq ** 0.5
        factor = max_norm / norm if max_norm > 0 and norm > max_norm else 1.0
        clipped: TensorDict = {}
        for k, v in s.items():
            if k in keys and factor != 1.0:
                clipped[k] = (base[k].double() + factor * (v.double() - base[k].double())).to(v.dtype)
            else:
                clipped[k] = v.clone()
        out.append(clipped)
    return out
