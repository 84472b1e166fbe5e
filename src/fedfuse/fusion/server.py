"""Server update rules: how the server turns a round's client states into the next global model.

A :class:`ServerRule` composes four pure stages on named tensors (state dicts)::

    clip (each client's update θ_i − x)  →  fuse (weighted mean | median | trimmed mean)  →
    transforms (on the fused update Δ = fused − x)  →  step (a server optimiser on x with Δ)

Any averaging algorithm takes a rule (FedAvg and every algorithm built on it build theirs from their
options), so robust fusion, clipping and server optimisers combine freely instead of being options a subclass
may silently ignore.  ``transforms`` is the seam for further server-side operators: a function
``(update, ctx) -> update`` on the fused update (e.g. Gaussian noise for differential privacy after per-client
clipping); :meth:`ServerRule.with_transform` appends one.

Which entries are optimised, and which are not:

* **parameters** (``param_keys``, floating point) that at least one client sent: the fused update Δ goes through
  the transforms and the optimiser;
* **floating buffers** (BatchNorm ``running_mean``/``running_var``): statistics, not iterates — they take the
  fused value (the average) and are never optimised;
* **integer buffers** (``num_batches_tracked``): never averaged or scaled; they follow ``int_policy``
  (see :mod:`fedfuse.fusion.average`);
* a parameter **no client sent** (nobody trained it this round) keeps its value, and its optimiser moments are
  left as they were (no step on a zero update).

The optimisers follow Reddi et al. 2021 ("Adaptive Federated Optimization", Algorithm 2) and Flower's strategies
(``FedAvgM``, ``FedAdam``, ``FedYogi``, ``FedAdagrad``): moments start at 0, Δ is ``fused − x`` (the negative
pseudo-gradient), and the step is ``x + η · m / (√v + τ)``.  Optimiser state is plain data (``{"t": steps,
"m": {...}, "v": {...}}``) kept in the server state, so it is checkpointed and resumed with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedfuse.fusion.average import IntPolicy, RobustRule, clip_updates, robust_average, weighted_average
from fedfuse.types import TensorDict

#: Optimiser state: ``{"t": int, "m": TensorDict, "v": TensorDict}`` (keys an optimiser does not use are absent).
OptState = dict[str, Any]


@dataclass(frozen=True)
class RuleContext:
    """What a transform may read: the 0-based round, the number of fused clients and the optimised keys."""

    round: int
    num_clients: int
    keys: tuple[str, ...]


#: ``transform(update, ctx) -> update`` on the fused update of the optimised parameters (pure).
UpdateTransform = Callable[[TensorDict, RuleContext], TensorDict]


class ServerOptimizer(Protocol):
    """One server step: ``x`` and the fused update ``delta`` (same keys, parameters only) → new ``x``, state."""

    def step(self, x: TensorDict, delta: TensorDict, state: OptState | None) -> tuple[TensorDict, OptState]: ...


def _moments(state: OptState | None, name: str, delta: Mapping[str, torch.Tensor]) -> TensorDict:
    held = (state or {}).get(name) or {}
    return {k: held[k] if k in held else torch.zeros_like(d) for k, d in delta.items()}


@dataclass(frozen=True)
class ServerSGD:
    """``x + lr · Δ``; with ``momentum`` β > 0 (FedAvgM, Hsu et al. 2019): ``m = β m + Δ`` (``m_1 = Δ``),
    ``x + lr · m`` — Flower's ``FedAvgM`` with ``server_learning_rate``/``server_momentum``."""

    lr: float = 1.0
    momentum: float = 0.0

    def step(self, x: TensorDict, delta: TensorDict, state: OptState | None) -> tuple[TensorDict, OptState]:
        t = int((state or {}).get("t", 0)) + 1
        if self.momentum <= 0:
            return {k: x[k] + self.lr * d for k, d in delta.items()}, {"t": t}
        m = _moments(state, "m", delta)
        m = {k: self.momentum * m[k] + d for k, d in delta.items()}
        return {k: x[k] + self.lr * m[k] for k in delta}, {"t": t, "m": m}


@dataclass(frozen=True)
class ServerAdaptive:
    """FedAdagrad / FedAdam / FedYogi (Reddi et al. 2021, Algorithm 2) with ``m = β₁ m + (1 − β₁) Δ`` and

    * ``adagrad``: ``v = v + Δ²``
    * ``adam``:    ``v = β₂ v + (1 − β₂) Δ²``
    * ``yogi``:    ``v = v − (1 − β₂) Δ² · sign(v − Δ²)``

    then ``x + η_t · m / (√v + τ)``.  ``bias_correction`` (Adam only) uses Kingma & Ba's
    ``η_t = η √(1 − β₂ᵗ) / (1 − β₁ᵗ)`` with t the number of server steps taken (1, 2, …); without it
    ``η_t = η`` as in Reddi et al.'s Algorithm 2.
    """

    kind: str
    eta: float
    beta_1: float = 0.0
    beta_2: float = 0.0
    tau: float = 1e-9
    bias_correction: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("adagrad", "adam", "yogi"):
            raise ValueError(f"unknown adaptive server optimiser {self.kind!r}; choose adagrad, adam or yogi")

    def step(self, x: TensorDict, delta: TensorDict, state: OptState | None) -> tuple[TensorDict, OptState]:
        t = int((state or {}).get("t", 0)) + 1
        m, v = _moments(state, "m", delta), _moments(state, "v", delta)
        b1, b2 = self.beta_1, self.beta_2
        new_x: TensorDict = {}
        for k, d in delta.items():
            m[k] = b1 * m[k] + (1 - b1) * d
            sq = d * d
            if self.kind == "adagrad":
                v[k] = v[k] + sq
            elif self.kind == "adam":
                v[k] = b2 * v[k] + (1 - b2) * sq
            else:
                v[k] = v[k] - (1 - b2) * sq * torch.sign(v[k] - sq)
        eta = self.eta
        if self.bias_correction and self.kind == "adam":
            eta = self.eta * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t)
        for k in delta:
            new_x[k] = x[k] + eta * m[k] / (v[k].sqrt() + self.tau)
        return new_x, {"t": t, "m": m, "v": v}


@dataclass(frozen=True)
class ServerRule:
    """clip → fuse → transforms → optimiser; see the module docstring.  The default rule is FedAvg's weighted mean.

    ``fusion``: ``"mean"`` (weighted by the given weights), ``"median"`` or ``"trimmed-mean"`` (unweighted, ``trim``
    cut at each end per coordinate); ``clip_norm > 0`` first clips every client's update to that L2 norm;
    ``optimizer=None`` takes the fused model as is (bit-identical to plain averaging).
    """

    fusion: RobustRule = "mean"
    trim: float = 0.1
    clip_norm: float = 0.0
    int_policy: IntPolicy = "max"
    optimizer: ServerOptimizer | None = None
    transforms: tuple[UpdateTransform, ...] = ()

    def with_transform(self, transform: UpdateTransform) -> ServerRule:
        """This rule with ``transform`` applied (after the existing ones) to the fused update."""
        return dataclasses.replace(self, transforms=(*self.transforms, transform))

    def fuse(self, x: Mapping[str, torch.Tensor], states: Sequence[Mapping[str, torch.Tensor]],
             weights: Sequence[float] | None = None) -> TensorDict:
        """The fused state: clipped updates (if ``clip_norm``), then the mean or a robust rule, base ``x``."""
        if self.clip_norm > 0:
            states = clip_updates(states, x, self.clip_norm)
        if self.fusion == "mean":
            return weighted_average(states, weights, base=x, int_policy=self.int_policy)
        return robust_average(states, self.fusion, trim=self.trim, base=x, int_policy=self.int_policy)

    def apply(
        self, x: Mapping[str, torch.Tensor], states: Sequence[Mapping[str, torch.Tensor]],
        weights: Sequence[float] | None, opt_state: OptState | None, *, param_keys: set[str] | frozenset[str],
        round: int = 0,
    ) -> tuple[TensorDict, OptState | None]:
        """The next global state and optimiser state from the current ``x`` and the clients' ``states``."""
        fused = self.fuse(x, states, weights)
        sent = set().union(*(s.keys() for s in states)) if states else set()
        return self.step(x, fused, opt_state, param_keys=param_keys, sent=sent, round=round,
                         num_clients=len(states))

    def step(
        self, x: Mapping[str, torch.Tensor], fused: Mapping[str, torch.Tensor], opt_state: OptState | None, *,
        param_keys: set[str] | frozenset[str], sent: set[str] | None = None, round: int = 0, num_clients: int = 0,
    ) -> tuple[TensorDict, OptState | None]:
        """The transforms and the optimiser on an already fused state (e.g. DP-FedAvg's noised mean).

        The optimised keys are the floating ``param_keys`` of ``x`` present in ``fused`` (and in ``sent``, the
        keys some client sent, when given); every other entry takes its ``fused`` value.  Without optimiser and
        transforms ``fused`` is returned as is."""
        if self.optimizer is None and not self.transforms:
            return dict(fused), opt_state
        keys = tuple(k for k in x if k in param_keys and k in fused and x[k].is_floating_point()
                     and (sent is None or k in sent))
        update = {k: fused[k] - x[k] for k in keys}
        ctx = RuleContext(round=round, num_clients=num_clients, keys=keys)
        for transform in self.transforms:
            update = transform(update, ctx)
        if self.optimizer is None:
            stepped, new_state = {k: x[k] + update[k] for k in keys}, opt_state
        else:
            stepped, new_state = self.optimizer.step({k: x[k] for k in keys}, update, opt_state)
            if opt_state:  # moments of parameters nobody sent this round are kept as they were
                for name in ("m", "v"):
                    for k, val in (opt_state.get(name) or {}).items():
                        new_state.setdefault(name, {}).setdefault(k, val)
        out = dict(fused)
        for k in keys:
            out[k] = stepped[k].to(x[k].dtype)
        return out, new_state


__all__ = ["OptState", "RuleContext", "ServerAdaptive", "ServerOptimizer", "ServerRule", "ServerSGD",
           "UpdateTransform"]
