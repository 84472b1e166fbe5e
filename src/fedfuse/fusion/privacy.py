"""Central differential privacy on a mean of client updates: DP-FedAvg (McMahan, Ramage, Talwar, Zhang, ICLR 2018)
with fixed clipping, or adaptive clipping at a target quantile (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021).

Pure functions on named tensors.  One round, with m the configured clients per round (the expected number of
participants, a fixed denominator whoever replies):

    Δ_k = θ_k − θ,   Δ̃_k = Δ_k · min(1, C / ‖Δ_k‖),   θ' = θ + (Σ_k Δ̃_k + N(0, (z_Δ C)² I)) / m

so one client changes the noised sum by at most C (added or removed) and the noise on the mean has standard
deviation z_Δ·C/m.  Adaptive clipping also releases the noised *centred* count of clients whose update was not
clipped, each client contributing b_k − ½ with b_k = 1[‖Δ_k‖ ≤ C] (sensitivity ½; TF-Privacy's
``QuantileEstimatorQuery``), and b̄ = (Σ_k (b_k − ½) + N(0, σ_b²)) / m + ½; the clip moves geometrically toward the
γ-quantile of the norms: C ← C · exp(−η_C (b̄ − γ)).  One added client moves (Σ Δ̃ / (z_Δ C), Σ (b − ½) / σ_b)
by at most (1/z_Δ, 1/(2σ_b)) in norm, which is 1/z when z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (Andrew et al., Theorem 1;
σ_b = m/20 is their recommendation): the two releases together are one Gaussian mechanism of noise multiplier z,
which the accountant charges per round (:func:`joint_noise_multiplier`).

What is clipped and noised: every floating entry of the state — parameters *and* BatchNorm running statistics
(``running_mean``/``running_var`` are averages of the client's data and would leak it unnoised).  Integer
entries (``num_batches_tracked``, whose value reveals how many batches a client ran, i.e. its data size) are not
released: they keep the server's value.  A key a client did not send counts as a zero update from it.

The noise: a :class:`SecureGaussian` (seeded once from 256 bits of ``os.urandom``, never stored: nobody, the run's
seed in hand, can regenerate it) whenever a run claims a guarantee; a seeded ``torch.Generator`` only in the research
mode that gives up the guarantee for bit-reproducible runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedfuse.rng import secure_numpy_rng
from fedfuse.types import TensorDict

#: a source of float64 standard normals of a given shape (:class:`SecureGaussian`) or a seeded torch generator
Noise = Callable[[tuple[int, ...]], torch.Tensor] | torch.Generator


class SecureGaussian:
    """Standard normal noise nobody can regenerate: a NumPy PCG64DXSM generator seeded once from 256 bits of
    ``os.urandom`` that are never written anywhere (not in the config, the checkpoint or the records).

    Each value is the sum of four standard normals halved (still N(0, 1)): Opacus's ``secure_mode`` defence against
    floating-point attacks on the Gaussian sampler (Holohan & Braghin 2021, §5.1; Mironov, CCS 2012 for the
    problem).  Pickling or copying it gives a fresh, independent source: its state never leaves the process."""

    def __init__(self) -> None:
        self._rng = secure_numpy_rng()

    def __call__(self, shape: tuple[int, ...]) -> torch.Tensor:
        draws = self._rng.standard_normal((4, *shape))
        return torch.from_numpy(np.asarray(draws.sum(axis=0) / 2.0, dtype=np.float64))

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (SecureGaussian, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> SecureGaussian:
        return SecureGaussian()


def standard_normal(noise: Noise, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """float64 N(0, 1) draws of ``shape`` from ``noise`` (a seeded generator draws as ``torch.randn`` always has)."""
    if isinstance(noise, torch.Generator):
        return torch.randn(tuple(shape), dtype=torch.float64, generator=noise)
    return noise(tuple(shape))


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


#: how much one client moves the centred clipped count Σ (b_k − ½): ½ (added or removed, whether clipped or not)
COUNT_SENSITIVITY = 0.5


def joint_noise_multiplier(update_multiplier: float, count_std: float) -> float:
    """The noise multiplier of the round's two releases taken together: one client moves the clipped sum by at most
    C (noise z_Δ·C) and the centred count by at most ½ (noise σ_b), so jointly they are a Gaussian mechanism of
    multiplier (z_Δ⁻² + (σ_b/½)⁻²)^(−½) — z itself for z_Δ of :func:`update_noise_multiplier`.  ``count_std = 0``
    means no count is released (fixed clipping): z_Δ."""
    if update_multiplier <= 0:
        return 0.0
    if count_std <= 0:
        return update_multiplier
    return (update_multiplier ** -2 + (COUNT_SENSITIVITY / count_std) ** 2) ** -0.5


def dp_contribution(state: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor],
                    clip: float) -> tuple[TensorDict, float, float]:
    """What one client adds to DP-FedAvg's two sums: its update clipped to ``clip`` (:func:`clipped_update`), its
    centred bit b − ½ (+½ if the update fit under the clip, −½ if it was clipped) and its norm before clipping.
    Computed by the server from a reply, or by the client itself under secure aggregation."""
    upd, norm = clipped_update(state, base, clip)
    return upd, (1.0 if norm <= clip else 0.0) - COUNT_SENSITIVITY, norm


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
    centred_count: float,
    *,
    clip: float,
    noise_multiplier: float,
    denominator: float,
    gen: Noise,
    quantile: float = 0.0,
    clip_lr: float = 0.2,
    count_std: float = 0.0,
) -> tuple[TensorDict, float, float | None, float | None]:
    """The server's half of DP-FedAvg from the sum of clipped updates and the centred count Σ (b_k − ½) of
    unclipped ones (what secure aggregation reveals): ``(new state, noise std on the mean, noised unclipped
    fraction b̄, next clip)``; b̄ = (Σ (b_k − ½) + N(0, σ_b²)) / m + ½."""
    if clip <= 0 or denominator <= 0:
        raise ValueError(f"clip ({clip}) and denominator ({denominator}) must be positive")
    adaptive = quantile > 0
    std = update_noise_multiplier(noise_multiplier, count_std if adaptive else 0.0) * clip
    out: TensorDict = {}
    for k, v in base.items():
        if k in clipped_sum and v.is_floating_point():
            noise = standard_normal(gen, v.shape) * std if std > 0 else 0.0
            out[k] = (v.double() + (clipped_sum[k].double() + noise) / denominator).to(v.dtype)
        else:
            out[k] = v.clone()
    if not adaptive:
        return out, std / denominator, None, None
    count_noise = float(standard_normal(gen, ())) * count_std if count_std > 0 else 0.0
    frac = (centred_count + count_noise) / denominator + COUNT_SENSITIVITY
    return out, std / denominator, frac, adapt_clip(clip, frac, quantile, clip_lr)


def dp_mean(
    states: Sequence[Mapping[str, torch.Tensor]],
    base: Mapping[str, torch.Tensor],
    *,
    clip: float,
    noise_multiplier: float,
    denominator: float,
    gen: Noise,
    quantile: float = 0.0,
    clip_lr: float = 0.2,
    count_std: float = 0.0,
) -> tuple[TensorDict, DPRound]:
    """DP-FedAvg's noised mean of ``states`` around ``base`` (see the module docstring).

    ``noise_multiplier`` is the run's z; with ``quantile > 0`` the clip adapts and the update noise uses z_Δ.
    ``denominator`` is m (the expected number of participants).  Noise is drawn from ``gen`` (a
    :class:`SecureGaussian`, or a seeded generator in the research mode) in the order of ``base``'s keys, float64.
    """
    total = {k: torch.zeros_like(base[k], dtype=torch.float64) for k in noised_keys(base)}
    norms, centred = [], 0.0
    for s in states:
        upd, bit, norm = dp_contribution(s, base, clip)
        norms.append(norm)
        centred += bit
        for k, v in upd.items():
            total[k].add_(v)
    out, std, frac, nxt = noised_mean(base, total, centred, clip=clip, noise_multiplier=noise_multiplier,
                                      denominator=denominator, gen=gen, quantile=quantile, clip_lr=clip_lr,
                                      count_std=count_std)
    return out, DPRound(tuple(norms), sum(1 for n in norms if n > clip), std, frac, nxt)


def adapt_clip(clip: float, unclipped_fraction: float, quantile: float, lr: float) -> float:
    """Andrew et al.'s geometric update C ← C · exp(−η_C (b̄ − γ)): shrinks when more than a γ fraction of the
    updates fit under C, grows otherwise; its fixed point is the γ-quantile of the update norms."""
    return clip * math.exp(-lr * (unclipped_fraction - quantile))
