"""SCAFFOLD (Karimireddy et al., ICML 2020, "Stochastic Controlled Averaging for Federated Learning").

The server holds the model x and a control variate c; client i keeps its own c_i (client state, 0 at first).  The
payload is x plus c (tensors ``c/<name>``, so the download is twice FedAvg's).  Client i runs K local steps of

    y ← y − η_l (g_i(y) − c_i + c)

(the correction is the gradient of a declared linear loss term, so every executor runs it), then
updates its control variate with the paper's **option II** and replies with y and Δc_i (tensors ``dc/<name>``):

    c_i⁺ = c_i − c + (x − y) / (K η_l),      Δc_i = c_i⁺ − c_i.

The server (η_g = ``server_lr``) sets x ← x + η_g · mean_i (y_i − x) through FedAvg's server rule, uniform
weights by default as in the paper, and c ← c + (1/N) Σ_i Δc_i over the N clients.  Control variates cover the
trainable parameters only; BatchNorm statistics are averaged like FedAvg's.  K is the client's step count and
η_l the run's ``lr``; option II assumes plain SGD (with momentum or Adam it is the usual approximation).

Privacy: a client's release is the pair (y_i − x, Δc_i) and the server reads only Σ w_i·(y_i − x), Σ w_i and
Σ Δc_i, so the update is declared a mean of deltas (``server_update``, the Δc entries summed with weight 1) and
SCAFFOLD wears the shared mechanisms (:class:`fedfuse.algorithms.mean_base.DeltaMean`) on the model part *and* the
control variates: the base is (x, 0), the mean's denominator D gives back Σ Δc_i = D·mean_Δc, and c ← c + D/N ·
mean_Δc.  Under central DP the pair is clipped as one vector and both sums are noised (D = m: c ← c + (Σ Δc_i +
noise)/N); under secure aggregation both sums are masked (the control variates are never sent in the clear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfuse.algorithms.base import ClientState, RoundInfo, ServerState
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.algorithms.mean_base import MeanOfDeltas
from fedfuse.engine.client import TrainStats
from fedfuse.engine.program import Batch, ClientProgram, LossTerm
from fedfuse.options import opt
from fedfuse.types import ClientData, Message, TensorDict

CV, DC = "c/", "dc/"  # server control variate in the payload; control-variate update in the reply


def option_two(ci: TensorDict, c: TensorDict, x: TensorDict, y: TensorDict, steps: int, lr: float) -> TensorDict:
    """c_i⁺ = c_i − c + (x − y)/(K η_l); c_i unchanged when the client took no step."""
    if steps <= 0 or lr <= 0:
        return {k: v.clone() for k, v in ci.items()}
    return {k: ci[k] - c[k] + (x[k] - y[k]) / (steps * lr) for k in ci}


def correction(b: Batch) -> torch.Tensor:
    """⟨y, c − c_i⟩ over the parameters (``refs`` holds c − c_i): its gradient is the drift correction."""
    return sum(((p * b.refs[CV + k]).sum() for k, p in b.params.items() if CV + k in b.refs), torch.zeros(()))


class Scaffold(FedAvg):
    name = "scaffold"
    description = "SCAFFOLD: control variates c, c_i correct client drift (option II), uniform server average"
    server_update = MeanOfDeltas("Δ_i = (y_i − x, Δc_i)", unweighted=(DC,),
                                 note="c ← c + Σ Δc_i / N reads the Δc sum: the control variates are summed too")
    local_dp_why = ("the corrected step is SGD plus a linear term: DP-SGD would clip the task gradients only")
    accepts_late = False  # a late Δc_i was computed against an older c
    node_private = ("c",)  # c_i never leaves a Flower node (its changes are the Δc_i that only travel summed)

    @dataclass
    class Options(FedAvg.FusionOptions):
        weighting: str = opt("uniform", "weights of the model average: uniform (the paper) or samples (n_i)",
                             choices=("samples", "uniform"))
        server_lr: float = opt(1.0, "global step size η_g on the averaged update (the paper's default 1)", gt=0.0)

    def init_state(self) -> ServerState:
        state = super().init_state()
        keys = self.ctx.param_keys()
        return {**state, "c": {k: torch.zeros_like(v) for k, v in state["global"].items() if k in keys}}

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        """FedAvg's broadcast (with the mechanisms' meta) plus c (``c/<name>``)."""
        cv = {CV + k: v for k, v in state["c"].items()}
        shared: dict[int, Message] = {}
        return {cid: shared.setdefault(id(m), Message({**m.tensors, **cv}, m.meta, m.stats))
                for cid, m in super().configure_fit(state, info, clients).items()}

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        x = {k: v for k, v in payload.tensors.items() if not k.startswith(CV)}
        c = {k[len(CV):]: v for k, v in payload.tensors.items() if k.startswith(CV)}
        ci = client_state["c"] if client_state else {k: torch.zeros_like(v) for k, v in c.items()}
        model, spec = self.ctx.model(payload.meta), self.ctx.train

        def finalize(y: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            new = option_two(ci, c, x, y, stats.steps, spec.lr)
            reply = {**y, **{DC + k: new[k] - ci[k] for k in ci}}
            return Message(reply, stats=self.fit_stats(model, data, stats)), {"c": new}

        return ClientProgram(model=model, init=x, spec=spec, finalize=finalize,
                             terms=(LossTerm("scaffold-correction", correction),),
                             refs={CV + k: c[k] - ci[k] for k in c})

    def fuse(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        """The plain rule: FedAvg's on the models, c ← c + Σ Δc_i / N."""
        if not results:
            return state
        models = {cid: Message({k: v for k, v in r.tensors.items() if not k.startswith(DC)}, r.meta, r.stats)
                  for cid, r in results.items()}
        out = super().fuse(state, info, models)
        n = self.ctx.num_clients
        c = {k: v + sum(r.tensors[DC + k] for r in results.values()) / n for k, v in state["c"].items()}
        return {**out, "c": c}

    # ---- the mean the mechanisms form: base (x, 0), the model part stepped by FedAvg, c from Σ Δc_i -----------
    def delta_base(self, payload: Message) -> TensorDict:
        x = {k: v for k, v in payload.tensors.items() if not k.startswith(CV)}
        return {**x, **{DC + k[len(CV):]: torch.zeros_like(v) for k, v in payload.tensors.items()
                        if k.startswith(CV)}}

    def server_base(self, state: ServerState) -> TensorDict:
        return {**state["global"], **{DC + k: torch.zeros_like(v) for k, v in state["c"].items()}}

    def step_on_mean(self, state: ServerState, info: RoundInfo, mean: TensorDict, denominator: float,
                     replies: int | None) -> ServerState:
        """x steps on the model part of the mean; c ← c + D·mean_Δc / N = c + Σ Δc_i / N (plus the noise's share
        under central DP)."""
        out = super().step_on_mean(state, info, {k: v for k, v in mean.items() if not k.startswith(DC)},
                                   denominator, replies)
        scale = denominator / self.ctx.num_clients
        return {**out, "c": {k: v + mean[DC + k].to(v.dtype) * scale for k, v in state["c"].items()}}
