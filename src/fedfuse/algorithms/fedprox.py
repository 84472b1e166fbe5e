"""FedProx (Li et al. 2020): FedAvg with the local proximal term (μ/2)‖θ − θ_global‖².

Only trainable parameters enter the proximal term (BN buffers are statistics, not optimised).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfuse.algorithms.base import ClientState, state_of
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.options import opt
from fedfuse.types import ClientData, Message


def proximal_term(model: torch.nn.Module, anchor: dict[str, torch.Tensor], mu: float) -> torch.Tensor:
    """(μ/2) Σ ‖p − anchor_p‖² over the model's parameters."""
    total = torch.zeros((), device=next(model.parameters()).device)
    for name, p in model.named_parameters():
        total = total + (p - anchor[name]).pow(2).sum()
    return 0.5 * mu * total


class FedProx(FedAvg):
    name = "fedprox"
    description = "FedProx: FedAvg plus a local proximal term (mu/2)||w - w_global||^2"

    @dataclass
    class Options(FedAvg.Options):
        mu: float = opt(0.01, "proximal coefficient μ of the local objective (μ/2)‖w − w_global‖²", ge=0.0)

    def fit(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> tuple[Message, ClientState]:
        anchor = {k: v.detach().clone() for k, v in payload.tensors.items()}
        mu = float(self.opt.mu)
        model, meta = self.train_payload(
            payload, data, gen, extra_loss=lambda m, x, y, logits: proximal_term(m, anchor, mu)
        )
        return Message(state_of(model), meta), client_state
