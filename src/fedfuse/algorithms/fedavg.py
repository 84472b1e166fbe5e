"""FedAvg (McMahan et al. 2017): sample-weighted averaging of the clients' full model state.

BatchNorm running statistics are averaged with the same sample weights; ``num_batches_tracked`` follows
``int_policy`` (default ``"max"``; see :mod:`fedfuse.fusion.average`).  Server learning rate
``server_lr`` scales the averaged update (1.0 = plain FedAvg).

Robust fusion, for studying faulty or poisoned clients (off by default): ``fusion="median"`` (coordinate-wise
median, Yin et al. 2018) or ``"trimmed-mean"`` (``trim`` cut at each end per coordinate) replace the weighted
mean — both unweighted, so a claimed sample count buys no influence — and ``clip_norm > 0`` first clips every
client's update ``θ_i − θ_global`` to that L2 norm (Sun et al. 2019).  BN statistics go through the same rule;
``num_batches_tracked`` always follows ``int_policy``.

Central differential privacy (``dp=central``, docs/privacy.md): the mean becomes DP-FedAvg's (McMahan et al.
2018) — every update clipped to ``dp_clip`` (or an adaptive clip, Andrew et al. 2021), summed, Gaussian noise of
std ``dp_noise``·C added, divided by the configured clients per round (weight 1/m each: ``weighting`` does not
apply, sample weights would make one client's influence unbounded); see :mod:`fedfuse.fusion.privacy`.  The
noise is drawn on the server from ``(seed, "dp-noise", round, stage)``, so every executor gives the same run;
``server_lr`` then scales the noised update.  The clip and what the mechanism did live in the server state
(``state["dp"]``, checkpointed) and reach ``metrics.jsonl`` as ``dp_*``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfuse.algorithms.base import Algorithm, RoundInfo, ServerState
from fedfuse.errors import UserError
from fedfuse.fusion.average import add_scaled, clip_updates, delta, robust_average, weighted_average
from fedfuse.fusion.privacy import dp_mean
from fedfuse.options import opt
from fedfuse.rng import derive_seed
from fedfuse.types import Message, Privacy, ServerView, not_built, yes


class FedAvg(Algorithm):
    name = "fedavg"
    description = "FedAvg: sample-weighted average of the clients' full state (BN statistics included)"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                ('the sample-weighted mean needs only the sums Σ n_i·θ_i and Σ n_i (robust fusion and clipping '
                 'options need each update)'),
                central_dp=yes('DP-FedAvg: every update clipped, Gaussian noise on their sum, fixed denominator m'),
                local_dp=not_built('the client step is plain SGD on the task loss: DP-SGD (Opacus) fits it; '
                                    'not wired yet'),
                secagg=not_built('the sample-weighted mean is a sum of n_i·θ_i and n_i: pairwise masks would '
                                  'hide each term')),
    )
    accepts_late = True  # a straggler's model from an earlier round can join a later average (late_replies)

    @dataclass
    class Options:
        weighting: str = opt("samples", "client weights of the mean: samples (n_i, the paper) or uniform",
                             choices=("samples", "uniform"))
        int_policy: str = opt("max", "num_batches_tracked of BatchNorm: max, sum or first (base) value",
                              choices=("max", "sum", "first"))
        server_lr: float = opt(1.0, "server learning rate on the averaged update (1 = plain FedAvg)", gt=0.0)
        fusion: str = opt("mean", "fusion rule: mean (weighted, the paper), median (coordinate-wise) or "
                                  "trimmed-mean (robust rules are unweighted)",
                          choices=("mean", "median", "trimmed-mean"))
        trim: float = opt(0.1, "trimmed-mean: fraction of values cut at each end of every coordinate",
                          ge=0.0, lt=0.5)
        clip_norm: float = opt(0.0, "clip every client's update to this L2 norm before fusion (0 = off)", ge=0.0)

    def __init__(self, ctx, options=None) -> None:
        super().__init__(ctx, options)
        robust = getattr(self.opt, "fusion", "mean") != "mean" or getattr(self.opt, "clip_norm", 0.0) > 0
        if robust and type(self).aggregate_fit is not FedAvg.aggregate_fit:
            raise UserError(f"{self.name} fuses with its own rule; fusion={self.opt.fusion!r} and clip_norm apply "
                            "to FedAvg-style averaging only (fedavg, fedprox, fedavg-ft, ...)")
        if robust and ctx.dp.central:
            raise UserError("dp=central replaces the mean with DP-FedAvg's clipped, noised mean; drop "
                            f"fusion={self.opt.fusion!r} / clip_norm={self.opt.clip_norm:g} (use dp_clip)")

    def client_weights(self, results: dict[int, Message]) -> list[float]:
        if self.opt.weighting == "uniform":
            return [1.0] * len(results)
        if self.opt.weighting != "samples":
            raise UserError(f"weighting={self.opt.weighting!r}; choose samples or uniform")
        return [float(r.num_examples) for r in results.values()]

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        if self.ctx.dp.central:
            return self.dp_aggregate(state, info, results)
        states = [r.tensors for r in results.values()]
        fusion, clip = getattr(self.opt, "fusion", "mean"), float(getattr(self.opt, "clip_norm", 0.0))
        if clip > 0:
            states = clip_updates(states, state["global"], clip)
        if fusion == "mean":
            avg = weighted_average(states, self.client_weights(results), base=state["global"],
                                   int_policy=self.opt.int_policy)  # type: ignore[arg-type]
        else:
            avg = robust_average(states, fusion, trim=float(self.opt.trim),  # type: ignore[arg-type]
                                 base=state["global"], int_policy=self.opt.int_policy)  # type: ignore[arg-type]
        if self.opt.server_lr != 1.0:
            avg = add_scaled(state["global"], delta(avg, state["global"]), self.opt.server_lr)
        return {**state, "global": avg}

    def dp_aggregate(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        """DP-FedAvg's round: clipped updates, Gaussian noise on their sum, a fixed denominator m, then the server
        learning rate; the (adaptive) clip and the round's record go to ``state["dp"]``."""
        dp, m = self.ctx.dp, self.ctx.clients_per_round
        clip = float((state.get("dp") or {}).get("clip", dp.clip))
        gen = torch.Generator().manual_seed(derive_seed(self.ctx.seed, "dp-noise", info.index, info.stage))
        avg, rec = dp_mean([r.tensors for r in results.values()], state["global"], clip=clip,
                           noise_multiplier=dp.noise, denominator=m, gen=gen, quantile=dp.quantile,
                           clip_lr=dp.clip_lr, count_std=dp.count_std(m))
        if self.opt.server_lr != 1.0:
            avg = add_scaled(state["global"], delta(avg, state["global"]), self.opt.server_lr)
        record = {"clip": rec.next_clip if rec.next_clip is not None else clip, "clip_used": clip,
                  "clipped": rec.clipped, "noise_std": rec.noise_std}
        if rec.unclipped_fraction is not None:
            record["unclipped_fraction"] = rec.unclipped_fraction
        return {**state, "global": avg, "dp": record}
