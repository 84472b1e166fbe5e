"""FedRep (Collins, Hassani, Mokhtari and Shakkottai, ICML 2021): a shared representation, a local head.

The model is a representation φ (every layer before the head) and a head h (``model.head_keys()``), which stays
on each client (declared ``stays_local``; :mod:`fedfuse.engine.personal` keeps it, merges it and sends only φ).
Each round a sampled client, starting from the received φ^t and its own head (Algorithm 1):

1. trains the head for ``head_epochs`` epochs with the representation frozen (the paper: τ_h = 10 epochs),
2. then trains the representation for the run's ``local_epochs`` with the new head frozen,

and sends φ back; the server averages the representations (FedAvg's rule).  Each client evaluates φ with its
own head; there is no global model.

Both phases are declared programs run in sequence (:func:`fedfuse.engine.program.run_program`, one generator:
the head phase's batches, then the body's), so the client step is a custom ``fit`` that every executor calls as
is.  FLOPs are counted per phase: a head phase's backward pass stops at the head (the frozen representation
needs no gradient), a body phase's reaches every layer but computes no head weight gradient.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch import nn

from fedfuse.algorithms.base import ClientState, StaysLocal
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.engine.client import TrainStats, train_flops_per_sample
from fedfuse.engine.program import ClientProgram, run_program
from fedfuse.options import opt
from fedfuse.types import ClientData, FitStats, Message, Privacy, ServerView, TensorDict, not_built


def phase_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor, trained: frozenset[str], key: tuple) -> float:
    """Forward + backward FLOPs of one training sample when only the parameters ``trained`` need gradients."""
    frozen = copy.deepcopy(model)
    for name, p in frozen.named_parameters():
        p.requires_grad_(name in trained)
    return train_flops_per_sample(frozen, x, y, key=key)


def _done(state: TensorDict, stats: TrainStats) -> tuple[TensorDict, TrainStats]:
    return state, stats


class FedRep(FedAvg):
    name = "fedrep"
    description = "FedRep: local head epochs (representation frozen), then representation epochs; head stays local"
    requires = frozenset({"head"})
    stays_local = StaysLocal(head=True)
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                "the sample-weighted mean of the representations needs only their sums; heads never leave",
                central_dp=not_built("DP-FedAvg on the representation only: the noised mean is not wired for "
                                     "entries that stay on the client"),
                local_dp=not_built("two DP-SGD phases per round (head, then body) would need their composed "
                                   "accounting; not wired"),
                secagg=not_built("the masked sum would carry the representation only; not wired")),
    )

    @dataclass
    class Options(FedAvg.Options):
        head_epochs: int = opt(10, "local epochs of the head with the representation frozen (the paper: 10); the "
                                   "representation then trains for the run's local_epochs", ge=0)

    def phases(self) -> tuple[frozenset[str], frozenset[str]]:
        """(head parameters, representation parameters)."""
        model = self.ctx.model()
        head = frozenset(model.head_keys()) & self.ctx.param_keys()
        return head, frozenset(self.ctx.param_keys() - head)

    def fit(self, payload: Message, client_state: ClientState, data: ClientData,
            gen: torch.Generator) -> tuple[Message, ClientState]:
        model, spec = self.ctx.model(payload.meta), self.ctx.train
        head, body = self.phases()
        first = ClientProgram(model=model, init=dict(payload.tensors), finalize=_done, trainable=head,
                              spec=replace(spec, local_epochs=int(self.opt.head_epochs)))
        after_head, st_head = run_program(first, data, gen)
        second = ClientProgram(model=model, init=after_head, spec=spec, finalize=_done, trainable=body)
        state, st_body = run_program(second, data, gen)
        return Message(state, stats=self.phase_stats(model, data, st_head, st_body)), client_state

    def phase_stats(self, model: nn.Module, data: ClientData, st_head: TrainStats, st_body: TrainStats) -> FitStats:
        """Both phases' work: their samples, steps and mean loss, each phase's FLOPs at its own backward depth."""
        head, body = self.phases()
        flops = 0.0
        for trained, st, tag in ((head, st_head, "fedrep-head"), (body, st_body, "fedrep-body")):
            if st.samples and len(data.train):
                flops += phase_flops(model, data.train.x, data.train.y, trained, (self.ctx.model_name, tag)) \
                    * st.samples
        samples = st_head.samples + st_body.samples
        return FitStats(num_examples=len(data.train), samples=int(samples), steps=int(st_head.steps + st_body.steps),
                        train_loss=float((st_head.loss_sum + st_body.loss_sum) / max(samples, 1)), flops=float(flops),
                        trained_params=int(sum(p.numel() for p in model.parameters() if p.requires_grad)))
