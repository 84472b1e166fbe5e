"""Ditto (Li, Hu, Beirami and Smith, ICML 2021): a personal model pulled towards the global one.

Each client k keeps a personal model v_k (its client state, never sent: ``node_private`` under Flower) besides the
global model w, which is trained and averaged exactly as FedAvg's.  A sampled client, given w^t (Algorithm 1):

1. trains its personal model for ``personal_epochs`` epochs on h_k(v; w^t) = F_k(v) + λ/2 ‖v − w^t‖²
   (SGD steps v ← v − η(∇F_k(v) + λ(v − w^t)); the anchor is the received w^t, a constant),
2. trains w^t with the standard step for the run's ``local_epochs`` and sends it back (FedAvg's server rule).

Every client evaluates its personal model v_k; a client that never trained evaluates v_k^0 = w^0, the run's
initial model (the paper's initialisation).  The global model is still the run's and is tested on the global
test set.  The two trainings run in sequence with one generator (personal first, as in PFLlib's Ditto), so the
client step is a custom ``fit`` that every executor calls as is; the FLOPs are both trainings'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfuse.algorithms.base import ClientState, evaluate_splits
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.algorithms.mean_base import MeanOfDeltas
from fedfuse.engine.client import TrainStats
from fedfuse.engine.context import seeded_state
from fedfuse.engine.program import Batch, ClientProgram, LossTerm, run_program
from fedfuse.options import opt
from fedfuse.types import ClientData, Message, TensorDict

PERSONAL = "v"  # the client-state entry holding the personal model


def proximal_pull(params: TensorDict, anchor: TensorDict, lam: float) -> torch.Tensor:
    """λ/2 Σ ‖v_p − w_p‖² over the trained parameters ``params`` (``anchor``: the received global model)."""
    total = torch.zeros((), device=next(iter(params.values())).device)
    for name, p in params.items():
        total = total + (p - anchor[name]).pow(2).sum()
    return 0.5 * lam * total


def _done(state: TensorDict, stats: TrainStats) -> tuple[TensorDict, TrainStats]:
    return state, stats


class Ditto(FedAvg):
    name = "ditto"
    description = "Ditto: FedAvg's global model plus a personal model per client, pulled to it by λ/2||v - w||^2"
    node_private = (PERSONAL,)
    server_update = MeanOfDeltas("Δ_i = θ_i − θ of the global model", note="the personal model never leaves the client")
    local_dp_why = ("the personal model trains on the same examples: DP-SGD would need both trainings' composed "
                    "accounting; not wired")

    @dataclass
    class Options(FedAvg.Options):
        lam: float = opt(0.1, "λ of the proximal pull λ/2||v - w||^2 of the personal model (the paper tunes it "
                              "in {0.01, 0.05, 0.1, 0.5, 1, 2})", ge=0.0)
        personal_epochs: int = opt(1, "local epochs of the personal model per round", ge=1)

    def __init__(self, ctx, options=None) -> None:
        super().__init__(ctx, options)
        self._initial: TensorDict | None = None

    def personal_model(self, client_state: ClientState) -> TensorDict:
        """The client's personal model v_k, or v_k^0 = w^0 (the run's initial model) before its first round."""
        if client_state and client_state.get(PERSONAL) is not None:
            return dict(client_state[PERSONAL])
        if self._initial is None:
            self._initial = seeded_state(self.ctx, self.ctx.seed)
        return dict(self._initial)

    def personal_program(self, payload: Message, client_state: ClientState) -> ClientProgram:
        """v trained on the task loss plus λ/2‖v − w^t‖², anchored at the received parameters w^t."""
        lam, keys = float(self.opt.lam), self.ctx.param_keys(payload.meta)
        anchor = {k: v.detach().clone() for k, v in payload.tensors.items() if k in keys}

        def pull(b: Batch) -> torch.Tensor:
            return proximal_pull(b.params, b.refs, lam)

        return ClientProgram(model=self.ctx.model(payload.meta), init=self.personal_model(client_state),
                             spec=self.ctx.train.replace(local_epochs=int(self.opt.personal_epochs)), finalize=_done,
                             terms=(LossTerm("ditto-proximal", pull),), refs=anchor)

    def fit(self, payload: Message, client_state: ClientState, data: ClientData,
            gen: torch.Generator) -> tuple[Message, ClientState]:
        personal = self.personal_program(payload, client_state)
        v, st_v = run_program(personal, data, gen)
        reply, _ = run_program(self.standard_program(payload, client_state, data), data, gen)
        extra = self.fit_stats(personal.model, data, st_v)
        assert reply.stats is not None
        reply.stats.flops += extra.flops  # the personal model's training (the pull's gradient is O(parameters))
        reply.stats.trained_params = int(reply.stats.trained_params or 0) + int(extra.trained_params or 0)
        return reply, {**(client_state or {}), PERSONAL: v}

    def evaluate(self, payload: Message, client_state: ClientState, data: ClientData,
                 gen: torch.Generator) -> dict[str, float]:
        """The personal model v_k on the client's own splits."""
        model = self.ctx.load(self.personal_model(client_state), payload.meta)
        return evaluate_splits(model, data, self.ctx.eval_batch_size)
