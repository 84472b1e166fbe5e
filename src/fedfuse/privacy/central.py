"""Central DP as a step of a server rule: clip → noised sum → fixed denominator (DP-FedAvg, McMahan et al. 2018;
adaptive clipping, Andrew et al. 2021; the mathematics in :mod:`fedfuse.fusion.privacy`).

Any algorithm whose server update is a mean of client deltas admits it without DP code of its own: it hands the
mechanism the base it sent and what the clients replied (or, under secure aggregation, the decoded sums of
:meth:`CentralDP.contribution`) and gets back the noised mean, on which its own server step runs (an SGD, momentum
or adaptive server optimiser is post-processing).  Every floating entry the base holds is clipped and noised as one
vector, so an algorithm that releases more than the model (SCAFFOLD's control-variate updates) puts those entries in
the base too (zeros: deltas of their own) and they share the clip and the noise.

The mechanism's state — the (adaptive) clip — lives in the algorithm's server state under ``"dp"`` (plain floats:
checkpointed with the state), together with what the last round did (``clip_used``, ``noise_std``, the noised
``unclipped_fraction``; ``clipped``, the exact count, for the debug metrics only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fedfuse.fusion.privacy import Noise, SecureGaussian, dp_contribution, noised_keys, noised_mean
from fedfuse.privacy.dp import DPSettings
from fedfuse.rng import derive_seed
from fedfuse.types import TensorDict

CLIP_META = "dp_clip"  # the payload's meta key holding the clip the clients clip at (under secure aggregation)


class CentralDP:
    """The central-DP step of one run: ``settings`` (z, C, γ, η_C, σ_b, the research mode), the fixed denominator
    ``per_round`` (m, the configured clients per round) and the run ``seed`` (read only in the research mode)."""

    def __init__(self, settings: DPSettings, per_round: int, seed: int) -> None:
        self.settings, self.per_round, self.seed = settings, int(per_round), int(seed)
        self._secure: SecureGaussian | None = None

    def clip(self, state: Mapping[str, Any]) -> float:
        """This round's clip: the adapted one in ``state["dp"]``, else the configured ``dp_clip``."""
        return float((state.get("dp") or {}).get("clip", self.settings.clip))

    def meta(self, state: Mapping[str, Any]) -> dict[str, float]:
        """What the payload carries for the mechanism: the clip (clients clip themselves under SecAgg)."""
        return {CLIP_META: self.clip(state)}

    def noise(self, round_index: int, stage: int) -> Noise:
        """The round's noise: one secure source for the run (never seeded, never stored), or in the research mode
        ``dp_reproducible`` a generator seeded from ``(seed, "dp-noise", round, stage)``."""
        if self.settings.reproducible:
            return torch.Generator().manual_seed(derive_seed(self.seed, "dp-noise", round_index, stage))
        if self._secure is None:
            self._secure = SecureGaussian()
        return self._secure

    @staticmethod
    def contribution(base: Mapping[str, torch.Tensor], reply: Mapping[str, torch.Tensor],
                     meta: Mapping[str, Any]) -> tuple[TensorDict, float]:
        """Client side (secure aggregation): its update clipped at the clip in ``meta`` and its centred bit b − ½."""
        upd, bit, _ = dp_contribution(reply, base, float(meta[CLIP_META]))
        return upd, bit

    def mean(self, state: Mapping[str, Any], base: Mapping[str, torch.Tensor],
             replies: Iterable[Mapping[str, torch.Tensor]], round_index: int, stage: int = 0
             ) -> tuple[TensorDict, dict[str, float]]:
        """Server side, from the replies: every update clipped, summed, noised, divided by m.  No reply is an
        empty sum: the round still releases noise around ``base``.  Returns (the noised mean state, the record
        for ``state["dp"]``)."""
        clip = self.clip(state)
        total = {k: torch.zeros_like(base[k], dtype=torch.float64) for k in noised_keys(base)}
        centred, count = 0.0, 0
        for reply in replies:
            upd, bit, _ = dp_contribution(reply, base, clip)
            centred += bit
            count += 1
            for k, v in upd.items():
                total[k].add_(v)
        return self.mean_of_sums(state, base, total, centred, round_index, stage, replies=count)

    def mean_of_sums(self, state: Mapping[str, Any], base: Mapping[str, torch.Tensor],
                     total: Mapping[str, torch.Tensor], centred: float, round_index: int, stage: int = 0,
                     replies: int | None = None) -> tuple[TensorDict, dict[str, float]]:
        """Server side, from the sums alone (what secure aggregation decodes): Σ clip(Δ_i) and Σ (b_i − ½).
        ``replies`` (known outside SecAgg) adds the exact clipped count, a debug metric."""
        s, clip = self.settings, self.clip(state)
        out, std, frac, nxt = noised_mean(base, total, centred, clip=clip, noise_multiplier=s.noise,
                                          denominator=self.per_round, gen=self.noise(round_index, stage),
                                          quantile=s.quantile, clip_lr=s.clip_lr,
                                          count_std=s.count_std(self.per_round))
        record: dict[str, float] = {"clip": nxt if nxt is not None else clip, "clip_used": clip, "noise_std": std}
        if replies is not None:  # withheld from the records unless dp_debug_metrics
            record["clipped"] = round(replies / 2 - centred)
        if frac is not None:
            record["unclipped_fraction"] = frac
        return out, record
