"""Central differential privacy on a mean of client updates: DP-FedAvg (McMahan, Ramage, Talwar, Zhang, ICLR 2018)
with fixed clipping, or adaptive clipping at a target quantile (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021).

Pure functions on named tensors.  One round, with m the configured clients per round (the expected number of
participants, a fixed denominator whoever replies):

    Δ_k = θ_k − θ,   Δ̃_k = Δ_k · min(1, C / ‖Δ_k‖),   θ' = θ + (Σ_k Δ̃_k + N(0, (z_Δ C)² I)) / m

so one client changes the noised sum by at most C (added or removed) and the noise on the mean has standard
deviation z_Δ·C/m.  Adaptive clipping also releases the noised fraction of clients whose update was not clipped,
b̄ = (Σ_k 1[‖Δ_k‖ ≤ C] + N(0, σ_b²)) / m, and moves the clip geometrically toward the γ-quantile of the norms:
C ← C · exp(−η_C (b̄ − γ)).  The two releases together are one Gaussian mechanism of noise multiplier z when
z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (Andrew et al., Theorem 1; σ_b = m/20 is their recommendation), so the
accountant charges z per round.

What is clipped and noised: every floating entry of the state — parameters *and* BatchNorm running statistics
(``running_mean``/``running_var`` are averages of the client's data and would leak it unnoised).  Integer
entries (``num_batches_tracked``, whose value reveals how many batches a client ran, i.e. its data size) are not
released: they keep the server's value.  A key a client did not send counts as a zero update from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fedfuse.types import TensorDict


def noised_keys(base: Mapping[str, torch.Tensor]) -> list[str]:
    """The entries DP-FedAvg clips and noises: every floating tensor of the state (parameters and BN statistics)."""
    return [k for k, v in base.items() if v.is_floating_point()]


def update_norm(state: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of ``state − base`` over :func:`noised_keys` (float64)."""
    sq = 0.0
    for k in noised_keys(base):
        if k in state:
            sq += float(((state[k].double() - base[k].double()) ** 2).sum())
    return math.sqrt(sq)


def update_noise_multiplier(z: float, count_std: float) -> float:
    """z_Δ of Andrew et al.: the update's noise multiplier when the clipped-count query with noise ``count_std``
    (σ_b) shares the budget of noise multiplier ``z``; ``count_std = 0`` means fixed clipping (z_Δ = z)."""
    if count_std <= 0 or z == 0:
        return z
    rest = z ** -2 - (2 * count_std) ** -2
    if rest <= 0:
        raise ValueError(f"adaptive clipping: the clipped-count noise σ_b={count_std:g} is too small for the noise "
                         f"multiplier z={z:g} (needs 2σ_b > z); raise dp_count_noise or lower dp_noise")
    return rest ** -0.5


@dataclass(frozen=True)
class DPRound:
    """What one DP aggregation did: the pre-clipping norms, how many were clipped, the noise std on the mean,
    and (adaptive clipping) the noised unclipped fraction and the next clip norm."""

    norms: tuple[float, ...]
    clipped: int
    noise_std: float
    unclipped_fraction: float | None = None
    next_clip: float | None = None


def clipped_update(
    state: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], clip: float
) -> tuple[TensorDict, float]:
    """A client's update ``state − base`` over :func:`noised_keys`, scaled to L2 norm ``<= clip`` (float64), and its
    norm before clipping.  Under secure aggregation the client computes this itself."""
    norm = update_norm(state, base)
    factor = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: ((state[k].double() - base[k].double()) * factor if k in state
                else torch.zeros_like(base[k], dtype=torch.float64)) for k in noised_keys(base)}, norm


def noised_mean(
    base: Mapping[str, torch.Tensor],
    clipped_sum: Mapping[str, torch.Tensor],
    unclipped: float,
    *,
    clip: float,
    noise_multiplier: float,
    denominator: float,
    gen: torch.Generator,
    quantile: float = 0.0,
    clip_lr: float = 0.2,
    count_std: float = 0.0,
) -> tuple[TensorDict, float, float | None, float | None]:
    """The server's half of DP-FedAvg from the sum of clipped updates and the count of unclipped ones (what secure
    aggregation reveals): ``(new state, noise std on the mean, noised unclipped fraction, next clip)``."""
    if clip <= 0 or denominator <= 0:
        raise ValueError(f"clip ({clip}) and denominator ({denominator}) must be positive")
    adaptive = quantile > 0
    std = update_noise_multiplier(noise_multiplier, count_std if adaptive else 0.0) * clip
    out: TensorDict = {}
    for k, v in base.items():
        if k in clipped_sum and v.is_floating_point():
            noise = torch.randn(v.shape, dtype=torch.float64, generator=gen) * std if std > 0 else 0.0
            out[k] = (v.double() + (clipped_sum[k].double() + noise) / denominator).to(v.dtype)
        else:
            out[k] = v.clone()
    if not adaptive:
        return out, std / denominator, None, None
    count_noise = float(torch.randn((), dtype=torch.float64, generator=gen)) * count_std if count_std > 0 else 0.0
    frac = (unclipped + count_noise) / denominator
    return out, std / denominator, frac, adapt_clip(clip, frac, quantile, clip_lr)


def dp_mean(
    states: Sequence[Mapping[str, torch.Tensor]],
    base: Mapping[str, torch.Tensor],
    *,
    clip: float,
    noise_multiplier: float,
    denominator: float,
    gen: torch.Generator,
    quantile: float = 0.0,
    clip_lr: float = 0.2,
    count_std: float = 0.0,
) -> tuple[TensorDict, DPRound]:
    """DP-FedAvg's noised mean of ``states`` around ``base`` (see the module docstring).

    ``noise_multiplier`` is the run's z; with ``quantile > 0`` the clip adapts and the update noise uses z_Δ.
    ``denominator`` is m (the expected number of participants).  Noise is drawn from ``gen`` in the order of
    ``base``'s keys, float64, so the result depends only on the inputs and the generator's seed.
    """
    total = {k: torch.zeros_like(base[k], dtype=torch.float64) for k in noised_keys(base)}
    norms = []
    for s in states:
        upd, norm = clipped_update(s, base, clip)
        norms.append(norm)
        for k, v in upd.items():
            total[k].add_(v)
    unclipped = sum(1 for n in norms if n <= clip)
    out, std, frac, nxt = noised_mean(base, total, unclipped, clip=clip, noise_multiplier=noise_multiplier,
                                      denominator=denominator, gen=gen, quantile=quantile, clip_lr=clip_lr,
                                      count_std=count_std)
    return out, DPRound(tuple(norms), len(norms) - unclipped, std, frac, nxt)


def adapt_clip(clip: float, unclipped_fraction: float, quantile: float, lr: float) -> float:
    """Andrew et al.'s geometric update C ← C · exp(−η_C (b̄ − γ)): shrinks when more than a γ fraction of the
    updates fit under C, grows otherwise; its fixed point is the γ-quantile of the update norms."""
    return clip * math.exp(-lr * (unclipped_fraction - quantile))
