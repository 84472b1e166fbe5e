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
noise is drawn on the server from a :class:`~fedfuse.fusion.privacy.SecureGaussian` (OS randomness nobody can
regenerate), or, in the research mode ``dp_reproducible`` (no guarantee), from ``(seed, "dp-noise", round,
stage)``; every round releases a noised aggregate, an empty one included.  The server optimiser (``server_lr``;
FedAvgM's, FedAdam's, ...) then steps on the noised update's parameters.  The clip and what the mechanism did
live in the server state (``state["dp"]``, checkpointed) and reach ``metrics.jsonl`` as ``dp_*``.

Secure aggregation (``secagg=true``, :mod:`fedfuse.privacy.secure`): each client contributes n_i·(θ_i − θ) and n_i
(under central DP: its clipped update and its centred bit b_i − ½, +½ if it was left unclipped) to a masked sum;
the server's :meth:`FedAvg.aggregate_sum` sees only the decoded sums, then applies the same server optimiser.

Local differential privacy (``dp=local``): every client trains with DP-SGD through Opacus (per-sample clipping at
``dp_clip``, noise ``dp_noise``, Poisson-sampled batches; :mod:`fedfuse.engine.local_dp`) instead of the standard
step; a model with BatchNorm is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState
from fedfuse.engine.local_dp import check_local_dp, train_dp_sgd
from fedfuse.engine.program import ClientProgram
from fedfuse.errors import UserError
from fedfuse.fusion.privacy import noised_keys
from fedfuse.fusion.server import ServerOptimizer, ServerRule, ServerSGD
from fedfuse.options import opt
from fedfuse.privacy.central import CentralDP
from fedfuse.types import ClientData, Message, Privacy, ServerView, TensorDict, yes

SECAGG_COUNT = "secagg/count"  # the summed weight (n_i) or, under central DP, the centred count Σ (b_i − ½)


class FedAvg(Algorithm):
    name = "fedavg"
    description = "FedAvg: sample-weighted average of the clients' full state (BN statistics included)"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                ('the sample-weighted mean needs only the sums Σ n_i·θ_i and Σ n_i (robust fusion and clipping '
                 'options need each update)'),
                central_dp=yes('DP-FedAvg: every update clipped, Gaussian noise on their sum, fixed denominator m'),
                local_dp=yes('the client step is plain SGD on the task loss: DP-SGD through Opacus (BN-free models)'),
                secagg=yes('clients mask n_i·Δ_i and n_i (SecAgg/SecAgg+); the server decodes only the sums')),
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
        if ctx.dp.local:  # Opacus must be able to clip per-sample gradients of the model
            check_local_dp(ctx.model())
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
        if self.ctx.dp.central:  # even with no reply: every round releases a noised aggregate
            return self.dp_aggregate(state, info, results)
        if not results:
            return state
        new, opt_state = self.server_rule().apply(
            state["global"], [r.tensors for r in results.values()], self.client_weights(results),
            state.get("server_opt"), param_keys=self.ctx.param_keys(), round=info.index)
        return self._with_optimizer_state({**state, "global": new}, opt_state)

    @staticmethod
    def _with_optimizer_state(state: ServerState, opt_state: dict | None) -> ServerState:
        return state if opt_state is None else {**state, "server_opt": opt_state}

    # ---- local DP (dp=local): DP-SGD through Opacus replaces the standard client step ------------------------
    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram | None:
        return None if self.ctx.dp.local else super().client_program(payload, client_state, data)

    def fit(self, payload: Message, client_state: ClientState, data: ClientData,
            gen: torch.Generator) -> tuple[Message, ClientState]:
        if not self.ctx.dp.local:
            return super().fit(payload, client_state, data, gen)
        model = self.ctx.load(payload.tensors, payload.meta)
        state, stats = train_dp_sgd(model, data.train, self.ctx.train, gen, noise=self.ctx.dp.noise,
                                    clip=self.ctx.dp.clip)
        return Message(state, stats=self.fit_stats(model, data, stats)), client_state

    # ---- central DP (dp=central): the shared mechanism of fedfuse.privacy.central -----------------------------
    @property
    def central_dp(self) -> CentralDP:
        """The run's central-DP step (clip → noised sum → fixed denominator m), one per algorithm instance."""
        mech = self.__dict__.get("_central_dp")
        if mech is None:
            mech = self.__dict__["_central_dp"] = CentralDP(self.ctx.dp, self.ctx.clients_per_round, self.ctx.seed)
        return mech

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        if not self.ctx.dp.central:
            return super().configure_fit(state, info, clients)
        msg = Message(state["global"], self.central_dp.meta(state))  # clients clip themselves under SecAgg
        return {c: msg for c in clients}

    def dp_aggregate(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        """DP-FedAvg's round: the mechanism's noised mean of the replies (noise around the model when there is
        none), then the server optimiser on it."""
        avg, record = self.central_dp.mean(state, state["global"], [r.tensors for r in results.values()],
                                           info.index, info.stage)
        return self.dp_step(state, info, avg, record, len(results))

    def dp_step(self, state: ServerState, info: RoundInfo, avg: TensorDict, record: dict[str, float],
                replies: int | None) -> ServerState:
        """The server optimiser on the noised mean (post-processing); the mechanism's record to ``state["dp"]``."""
        avg, opt_state = ServerRule(optimizer=self.server_optimizer()).step(
            state["global"], avg, state.get("server_opt"), param_keys=self.ctx.param_keys(), round=info.index,
            num_clients=replies or 0)
        return self._with_optimizer_state({**state, "global": avg, "dp": record}, opt_state)

    # ---- secure aggregation (secagg=true; fedfuse.privacy.secure) ----------------------------------------------
    def secure_contribution(self, sent: Message, reply: Message) -> TensorDict:
        """Client side: n_i·(θ_i − θ) and n_i (``weighting=uniform``: weight 1); under central DP the client's
        clipped update (at the clip the server sent) and its centred bit b_i − ½ (+½ unclipped, −½ clipped)."""
        base = sent.tensors
        if self.ctx.dp.central:
            upd, bit = self.central_dp.contribution(base, reply.tensors, sent.meta)
            return {**upd, SECAGG_COUNT: torch.tensor([bit], dtype=torch.float64)}
        w = 1.0 if self.opt.weighting == "uniform" else float(reply.num_examples)
        out = {k: (reply.tensors[k].double() - base[k].double()) * w if k in reply.tensors
               else torch.zeros_like(base[k], dtype=torch.float64) for k in noised_keys(base)}
        return {**out, SECAGG_COUNT: torch.tensor([w], dtype=torch.float64)}

    def aggregate_sum(self, state: ServerState, info: RoundInfo, total: TensorDict) -> ServerState:
        """Server side: the new global model from the decoded sum alone, then the server optimiser.  Integer
        buffers (``num_batches_tracked``) are not summed: the server keeps its own counter."""
        count = float(total[SECAGG_COUNT].sum())
        sums = {k: v for k, v in total.items() if k != SECAGG_COUNT}
        if self.ctx.dp.central:
            avg, record = self.central_dp.mean_of_sums(state, state["global"], sums, count, info.index, info.stage)
            return self.dp_step(state, info, avg, record, None)
        if count <= 0:
            return state
        base = state["global"]
        avg = {k: (base[k].double() + sums[k] / count).to(base[k].dtype) if k in sums else base[k].clone()
               for k in base}
        avg, opt_state = ServerRule(optimizer=self.server_optimizer()).step(
            base, avg, state.get("server_opt"), param_keys=self.ctx.param_keys(), round=info.index)
        return self._with_optimizer_state({**state, "global": avg}, opt_state)
