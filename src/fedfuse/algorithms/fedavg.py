"""FedAvg (McMahan et al. 2017): sample-weighted averaging of the clients' full model state.

The server's update is a :class:`fedfuse.fusion.server.ServerRule` built from the options
(:meth:`FedAvg.server_rule`), so every algorithm built on FedAvg fuses the same way and honours the same options:

* BatchNorm running statistics are averaged with the same sample weights; ``num_batches_tracked`` follows
  ``int_policy`` (default ``"max"``; see :mod:`fedfuse.fusion.average`);
* robust fusion, for studying faulty or poisoned clients (off by default): ``fusion="median"`` (coordinate-wise
  median, Yin et al. 2018) or ``"trimmed-mean"`` (``trim`` cut at each end per coordinate) replace the weighted
  mean — both unweighted, so a claimed sample count buys no influence — and ``clip_norm > 0`` first clips every
  client's update ``θ_i − θ_global`` to that L2 norm (Sun et al. 2019);
* the server optimiser (:meth:`FedAvg.server_optimizer`): here SGD with ``server_lr`` on the averaged update
  (1.0 = plain FedAvg); FedAvgM, FedAdam, FedYogi and FedAdagrad replace it.

Option sets for algorithms that average: ``FedAvg.AverageOptions`` (weights and integer buffers) and
``FedAvg.FusionOptions`` (plus robust fusion and clipping); an algorithm with its own fusion rule (FedExP) takes
only the former, so it never accepts an option it would ignore.

Central differential privacy (``dp=central``, docs/privacy.md): the mean becomes DP-FedAvg's (McMahan et al.
2018) — every update clipped to ``dp_clip`` (or an adaptive clip, Andrew et al. 2021), summed, Gaussian noise of
std ``dp_noise``·C added, divided by the configured clients per round (weight 1/m each: ``weighting`` does not
apply, sample weights would make one client's influence unbounded); see :mod:`fedfuse.fusion.privacy`.  The
noise is drawn on the server from ``(seed, "dp-noise", round, stage)``, so every executor gives the same run;
the server optimiser (``server_lr``; FedAvgM's, FedAdam's, ...) then steps on the noised update's parameters.
The clip and what the mechanism did live in the server state (``state["dp"]``, checkpointed) and reach
``metrics.jsonl`` as ``dp_*``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfuse.algorithms.base import Algorithm, RoundInfo, ServerState
from fedfuse.errors import UserError
from fedfuse.fusion.privacy import dp_mean
from fedfuse.fusion.server import ServerOptimizer, ServerRule, ServerSGD
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
    class AverageOptions:
        """How client states are weighted and how integer buffers combine."""

        weighting: str = opt("samples", "client weights of the mean: samples (n_i, the paper) or uniform",
                             choices=("samples", "uniform"))
        int_policy: str = opt("max", "num_batches_tracked of BatchNorm: max, sum or first (base) value",
                              choices=("max", "sum", "first"))

    @dataclass
    class FusionOptions(AverageOptions):
        """:class:`AverageOptions` plus robust fusion and update clipping (the :class:`ServerRule`'s fuse stage)."""

        fusion: str = opt("mean", "fusion rule: mean (weighted, the paper), median (coordinate-wise) or "
                                  "trimmed-mean (robust rules are unweighted)",
                          choices=("mean", "median", "trimmed-mean"))
        trim: float = opt(0.1, "trimmed-mean: fraction of values cut at each end of every coordinate",
                          ge=0.0, lt=0.5)
        clip_norm: float = opt(0.0, "clip every client's update to this L2 norm before fusion (0 = off)", ge=0.0)

    @dataclass
    class Options(FusionOptions):
        server_lr: float = opt(1.0, "server learning rate on the averaged update (1 = plain FedAvg)", gt=0.0)

    def __init__(self, ctx, options=None) -> None:
        super().__init__(ctx, options)
        robust = isinstance(self.opt, FedAvg.FusionOptions) and (self.opt.fusion != "mean" or self.opt.clip_norm > 0)
        if robust and ctx.dp.central:
            raise UserError("dp=central replaces the mean with DP-FedAvg's clipped, noised mean; drop "
                            f"fusion={self.opt.fusion!r} / clip_norm={self.opt.clip_norm:g} (use dp_clip)")

    def client_weights(self, results: dict[int, Message]) -> list[float]:
        if self.opt.weighting == "uniform":
            return [1.0] * len(results)
        if self.opt.weighting != "samples":
            raise UserError(f"weighting={self.opt.weighting!r}; choose samples or uniform")
        return [float(r.num_examples) for r in results.values()]

    def server_optimizer(self) -> ServerOptimizer | None:
        """The server step on the fused update (None = take the fused model as is)."""
        lr = float(self.opt.server_lr)
        return None if lr == 1.0 else ServerSGD(lr=lr)

    def server_rule(self) -> ServerRule:
        """The rule :meth:`aggregate_fit` applies, built from the options (override to add transforms)."""
        return ServerRule(fusion=self.opt.fusion, trim=float(self.opt.trim), clip_norm=float(self.opt.clip_norm),
                          int_policy=self.opt.int_policy, optimizer=self.server_optimizer())

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        if self.ctx.dp.central:
            return self.dp_aggregate(state, info, results)
        new, opt_state = self.server_rule().apply(
            state["global"], [r.tensors for r in results.values()], self.client_weights(results),
            state.get("server_opt"), param_keys=self.ctx.param_keys(), round=info.index)
        return self._with_optimizer_state({**state, "global": new}, opt_state)

    @staticmethod
    def _with_optimizer_state(state: ServerState, opt_state: dict | None) -> ServerState:
        return state if opt_state is None else {**state, "server_opt": opt_state}

    def dp_aggregate(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        """DP-FedAvg's round: clipped updates, Gaussian noise on their sum, a fixed denominator m, then the server
        optimiser on the noised update; the (adaptive) clip and the round's record go to ``state["dp"]``."""
        dp, m = self.ctx.dp, self.ctx.clients_per_round
        clip = float((state.get("dp") or {}).get("clip", dp.clip))
        gen = torch.Generator().manual_seed(derive_seed(self.ctx.seed, "dp-noise", info.index, info.stage))
        avg, rec = dp_mean([r.tensors for r in results.values()], state["global"], clip=clip,
                           noise_multiplier=dp.noise, denominator=m, gen=gen, quantile=dp.quantile,
                           clip_lr=dp.clip_lr, count_std=dp.count_std(m))
        avg, opt_state = ServerRule(optimizer=self.server_optimizer()).step(
            state["global"], avg, state.get("server_opt"), param_keys=self.ctx.param_keys(), round=info.index,
            num_clients=len(results))
        record = {"clip": rec.next_clip if rec.next_clip is not None else clip, "clip_used": clip,
                  "clipped": rec.clipped, "noise_std": rec.noise_std}
        if rec.unclipped_fraction is not None:
            record["unclipped_fraction"] = rec.unclipped_fraction
        return self._with_optimizer_state({**state, "global": avg, "dp": record}, opt_state)
