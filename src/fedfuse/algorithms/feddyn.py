"""FedDyn (Acar, Zhao, Navarro, Mattina, Whatmough & Saligrama, ICLR 2021, "Federated Learning Based on Dynamic
Regularization"), Algorithm 1.

Client i keeps ∇L_i(θ_i^{t−1}) (client state g_i, 0 at first) and, from the server model θ^{t−1}, minimises

    L_i(θ) − ⟨g_i, θ⟩ + (α/2) ‖θ − θ^{t−1}‖²

(a declared loss term of the linear and quadratic parts, so every executor runs it); then
g_i ← g_i − α (θ_i^t − θ^{t−1}).  The server keeps h (0 at first) over the N clients and the participants P:

    h^t = h^{t−1} − α (1/N) Σ_{i∈P} (θ_i^t − θ^{t−1}),      θ^t = (1/|P|) Σ_{i∈P} θ_i^t − h^t/α.

θ^t is sent and evaluated.  h, g_i and the regulariser cover the trainable parameters only; BatchNorm statistics
take the average, ``num_batches_tracked`` follows ``int_policy``.  ``weighting=samples`` weights the mean by n_i
(the paper's mean is uniform).  The reported training loss is the task loss alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfuse.algorithms.base import ClientState, RoundInfo, ServerState
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.engine.client import TrainStats
from fedfuse.engine.program import Batch, ClientProgram, LossTerm
from fedfuse.fusion.average import weighted_average
from fedfuse.options import opt
from fedfuse.types import ClientData, Message, Privacy, ServerView, TensorDict, not_built


def server_step(h: TensorDict, x: TensorDict, mean: TensorDict, alpha: float, participants: int,
                clients: int) -> tuple[TensorDict, TensorDict]:
    """(h^t, θ^t) from h^{t−1}, θ^{t−1} and the participants' mean model (parameters in ``h`` only)."""
    h = {k: v - alpha * participants / clients * (mean[k] - x[k]) for k, v in h.items()}
    return h, {k: mean[k] - h[k] / alpha if k in h else v for k, v in mean.items()}


class FedDyn(FedAvg):
    name = "feddyn"
    description = "FedDyn: dynamic regulariser -<g_i, w> + alpha/2 ||w - w_global||^2 with server state h"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL, "h and the model need only the participants' mean",
                central_dp=not_built("DP-FedAvg's noised mean would feed h; not wired into FedDyn's server step"),
                local_dp=not_built("the regulariser is not a per-sample loss: DP-SGD would clip the task "
                                   "gradients only"),
                secagg=not_built("the uniform mean is a sum of θ_i: pairwise masks fit; not wired")),
    )
    accepts_late = False  # g_i and h assume the update was made from the current server model

    @dataclass
    class Options(FedAvg.AverageOptions):
        weighting: str = opt("uniform", "weights of the participants' mean: uniform (the paper) or samples (n_i)",
                             choices=("samples", "uniform"))
        alpha: float = opt(0.01, "regulariser α (the paper tunes 0.1, 0.01, 0.001)", gt=0.0)

    def init_state(self) -> ServerState:
        state = super().init_state()
        keys = self.ctx.param_keys()
        return {**state, "h": {k: torch.zeros_like(v) for k, v in state["global"].items() if k in keys}}

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        alpha, keys = float(self.opt.alpha), self.ctx.param_keys(payload.meta)
        x = {k: v.detach().clone() for k, v in payload.tensors.items() if k in keys}
        g = client_state["g"] if client_state else {k: torch.zeros_like(v) for k, v in x.items()}
        model = self.ctx.model(payload.meta)

        def regulariser(b: Batch) -> torch.Tensor:
            return sum(((alpha / 2) * (p - b.refs["x/" + k]).pow(2).sum() - (b.refs["g/" + k] * p).sum()
                        for k, p in b.params.items() if "x/" + k in b.refs), torch.zeros(()))

        def finalize(theta: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            new = {k: g[k] - alpha * (theta[k] - x[k]) for k in g} if stats.steps else g
            return Message(theta, stats=self.fit_stats(model, data, stats)), {"g": new}

        refs = {**{"x/" + k: v for k, v in x.items()}, **{"g/" + k: v for k, v in g.items()}}
        return ClientProgram(model=model, init=dict(payload.tensors), spec=self.ctx.train,
                             finalize=finalize, terms=(LossTerm("feddyn", regulariser),), refs=refs)

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        mean = weighted_average([r.tensors for r in results.values()], self.client_weights(results),
                                base=state["global"], int_policy=self.opt.int_policy)  # type: ignore[arg-type]
        h, theta = server_step(state["h"], state["global"], mean, float(self.opt.alpha), len(results),
                               self.ctx.num_clients)
        return {**state, "global": theta, "h": h}
