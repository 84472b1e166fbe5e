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

Privacy: the update is a mean of client deltas (``server_update``), so FedAvg wears the shared mechanisms of
:class:`fedfuse.algorithms.mean_base.DeltaMean` — central DP (DP-FedAvg, McMahan et al. 2018: clip → noised sum →
fixed denominator m, weights 1/m each), secure aggregation of n_i·Δ_i and n_i, both — and local DP-SGD on its plain
client step; its privacy entry is derived from that declaration (docs/privacy.md).  Robust fusion reads each update
and is refused under central DP.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfuse.algorithms.base import RoundInfo, ServerState
from fedfuse.algorithms.mean_base import DeltaMean, MeanOfDeltas
from fedfuse.errors import UserError
from fedfuse.fusion.server import ServerOptimizer, ServerRule, ServerSGD
from fedfuse.options import opt
from fedfuse.types import Message, TensorDict


class FedAvg(DeltaMean):
    name = "fedavg"
    description = "FedAvg: sample-weighted average of the clients' full state (BN statistics included)"
    server_update = MeanOfDeltas(note="robust fusion and clip_norm read each update (refused under DP and SecAgg)")
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

    def fuse(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        """The plain rule: :meth:`server_rule` on the replies with :meth:`client_weights`."""
        if not results:
            return state
        new, opt_state = self.server_rule().apply(
            state["global"], [r.tensors for r in results.values()], self.client_weights(results),
            state.get("server_opt"), param_keys=self.ctx.param_keys(), round=info.index)
        return self._with_optimizer_state({**state, "global": new}, opt_state)

    def reads_each_update(self) -> str | None:
        o = self.opt
        if isinstance(o, FedAvg.FusionOptions) and (o.fusion != "mean" or o.clip_norm > 0):
            return f"fusion={o.fusion!r} / clip_norm={o.clip_norm:g} read each client's update"
        return None

    def delta_weight(self, reply: Message) -> float:
        return 1.0 if self.opt.weighting == "uniform" else float(reply.num_examples)

    def step_on_mean(self, state: ServerState, info: RoundInfo, mean: TensorDict, denominator: float,
                     replies: int | None) -> ServerState:
        """The server optimiser on the mean (the mechanisms' mean: noised, or decoded from a secure sum).  Integer
        buffers (``num_batches_tracked``) are not summed: the server keeps its own counter."""
        new, opt_state = ServerRule(optimizer=self.server_optimizer()).step(
            state["global"], mean, state.get("server_opt"), param_keys=self.ctx.param_keys(), round=info.index,
            num_clients=replies or 0)
        return self._with_optimizer_state({**state, "global": new}, opt_state)

    @staticmethod
    def _with_optimizer_state(state: ServerState, opt_state: dict | None) -> ServerState:
        return state if opt_state is None else {**state, "server_opt": opt_state}
