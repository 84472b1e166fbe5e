"""MOON (Li, He and Song, CVPR 2021): model-contrastive federated learning.

FedAvg whose local objective adds a model-contrastive term (Eq. 3-4): with z the representation of x under the
model being trained, z_glob under the received global model w^t (the positive) and z_prev under the client's
previous local model (the negative),

    ℓ = ℓ_sup + μ · ℓ_con,   ℓ_con = −log( e^{sim(z, z_glob)/τ} / (e^{sim(z, z_glob)/τ} + e^{sim(z, z_prev)/τ}) ),

sim the cosine similarity, τ the temperature (the paper: 0.5) and μ the weight (the paper: 5 on CIFAR-10, 1 on
CIFAR-100 and Tiny-ImageNet).  The representation is the model's penultimate features (the program declares
``features=True``; the paper's ResNet-50 adds a projection head, fedfuse's models have none).  The global and
previous models are frozen: their tensors are the program's ``refs``, evaluated on a template of their own in eval
mode (:mod:`fedfuse.engine.representation`).  The previous local model (a model buffer of size 1, the paper's
default) is the client's state, kept on its node under Flower.  A client's first round has no previous model and
no term (the paper's first round takes the global model as the previous one: sim(z, z_glob) = sim(z, z_prev), a
constant log 2 of zero gradient).

FLOPs: each step with the term runs two extra forward passes (global and previous model, features only), counted
in the reply on top of the trained model's forward and backward.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from fedfuse.algorithms.base import ClientState
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.algorithms.mean_base import MeanOfDeltas
from fedfuse.engine.client import TrainStats
from fedfuse.engine.program import Batch, ClientProgram, LossTerm
from fedfuse.engine.representation import FeatureView, contrastive_loss, features_flops_per_sample, frozen_features
from fedfuse.options import opt
from fedfuse.types import ClientData, Message, TensorDict

GLOB, PREV = "glob/", "prev/"  # the frozen models' tensors in the program's refs
PREVIOUS = "prev"  # the client-state entry holding the previous local model


def moon_term(view: FeatureView, mu: float, tau: float) -> LossTerm:
    """μ·ℓ_con averaged over the batch's samples: the trained model's features against the frozen global model's
    (positive, ``refs[glob/…]``) and previous local model's (negative, ``refs[prev/…]``)."""

    def con(b: Batch) -> torch.Tensor:
        z = b.features
        assert z is not None  # the program declares features=True
        z_glob, z_prev = frozen_features(view, b.refs, GLOB, b.x), frozen_features(view, b.refs, PREV, b.x)
        per = contrastive_loss(z, z_glob, z_prev, tau, "cosine", reduction="none")
        return b.mean(mu * per.reshape(z.shape[0], -1).mean(1))

    return LossTerm("moon-contrastive", con)


class Moon(FedAvg):
    name = "moon"
    description = "MOON: FedAvg plus a model-contrastive term (global model positive, previous local model negative)"
    requires = frozenset({"features"})
    node_private = (PREVIOUS,)
    server_update = MeanOfDeltas(note="the contrastive term and the previous model are client-side")
    local_dp_why = ("the contrastive term is per-sample but reads two frozen models: DP-SGD through Opacus would clip "
                    "the task gradients only")

    @dataclass
    class Options(FedAvg.Options):
        mu: float = opt(1.0, "weight μ of the model-contrastive loss (the paper: 5 on CIFAR-10, 1 on CIFAR-100 "
                             "and Tiny-ImageNet)", ge=0.0)
        tau: float = opt(0.5, "temperature τ of the model-contrastive loss (the paper: 0.5)", gt=0.0)

    def __init__(self, ctx, options=None) -> None:
        super().__init__(ctx, options)
        self.frozen = FeatureView(copy.deepcopy(ctx.model())).eval()  # never the trained template

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram | None:
        prog = super().client_program(payload, client_state, data)
        if prog is None:  # dp=local: FedAvg's DP-SGD step (refused by the privacy entry)
            return None
        prev: TensorDict | None = (client_state or {}).get(PREVIOUS)
        active = prev is not None and float(self.opt.mu) > 0
        plain = prog.finalize

        def finalize(state: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            reply, _ = plain(state, stats)
            if active and stats.samples and reply.stats is not None:  # two frozen forward passes per sample
                key = (self.ctx.model_name,)
                reply.stats.flops += 2 * features_flops_per_sample(self.frozen, data.train.x, key) * stats.samples
            return reply, {PREVIOUS: state}

        if not active:
            return dataclasses.replace(prog, finalize=finalize)
        assert prev is not None
        refs = {**{GLOB + k: v for k, v in payload.tensors.items()}, **{PREV + k: v for k, v in prev.items()}}
        return dataclasses.replace(prog, finalize=finalize, features=True, refs={**prog.refs, **refs},
                                   terms=(*prog.terms, moon_term(self.frozen, float(self.opt.mu),
                                                                 float(self.opt.tau))))
