"""FedProx (Li et al. 2020): FedAvg with the local proximal term (μ/2)‖θ − θ_global‖².

Only trainable parameters enter the proximal term (BN buffers are statistics, not optimised).  μ per FedMR's
Table 1 setting: 0.01 on CIFAR-10, 0.001 on CIFAR-100, 0.1 on FEMNIST (FedMR's code ``--prox_alpha``,
default 0.01); ``fedfuse reproduce fedmr`` sets it per dataset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.algorithms.mean_base import MeanOfDeltas
from fedfuse.engine.program import Batch, LossTerm
from fedfuse.options import opt
from fedfuse.types import Message, TensorDict


def proximal_penalty(params: TensorDict, anchor: TensorDict, mu: float) -> torch.Tensor:
    """(μ/2) Σ ‖p − anchor_p‖² over the trained parameters ``params`` (in their order)."""
    first = next(iter(params.values()))
    total = torch.zeros((), device=first.device)
    for name, p in params.items():
        total = total + (p - anchor[name]).pow(2).sum()
    return 0.5 * mu * total


class FedProx(FedAvg):
    name = "fedprox"
    description = "FedProx: FedAvg plus a local proximal term (mu/2)||w - w_global||^2"
    server_update = MeanOfDeltas(note="the proximal term is client-side")
    local_dp_why = ("the proximal term is not a per-sample loss: DP-SGD would clip the task gradients only and add "
                    "it after")

    @dataclass
    class Options(FedAvg.Options):
        mu: float = opt(0.01, "proximal coefficient μ of (μ/2)||w - w_global||^2 (FedMR Table 1: 0.01 CIFAR-10, "
                        "0.001 CIFAR-100, 0.1 FEMNIST)", ge=0.0)

    def loss_terms(self, payload: Message) -> tuple[tuple[LossTerm, ...], TensorDict]:
        """The proximal term, declared so every executor (sequential, batched, processes) can run it."""
        mu = float(self.opt.mu)
        keys = self.ctx.param_keys(payload.meta)
        anchor = {k: v.detach().clone() for k, v in payload.tensors.items() if k in keys}

        def prox(b: Batch) -> torch.Tensor:
            return proximal_penalty(b.params, b.refs, mu)

        return (LossTerm("proximal", prox),), anchor
