"""FedAvg-FT ("FedAvg+"): FedAvg training; for personalised evaluation each client first fine-tunes the
global model on its own training split for ``ft_epochs`` epochs (not sent back, not aggregated).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfuse.algorithms.base import ClientState, evaluate_splits
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.algorithms.mean_base import MeanOfDeltas
from fedfuse.engine.client import train_local
from fedfuse.options import opt
from fedfuse.types import ClientData, Message


class FedAvgFT(FedAvg):
    name = "fedavg-ft"
    description = "FedAvg-FT (FedAvg+): FedAvg, then local fine-tuning before personalised evaluation"
    server_update = MeanOfDeltas(note="the fine-tuning before evaluation stays on the client")

    @dataclass
    class Options(FedAvg.Options):
        ft_epochs: int = opt(1, "local fine-tuning epochs of the global model before each evaluation", ge=0)
        ft_lr: float = opt(0.0, "fine-tuning learning rate (0 = the run's local learning rate)", ge=0.0)

    def evaluate(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> dict[str, float]:
        model = self.ctx.load(payload.tensors, payload.meta)
        train_local(
            model, data.train, self.ctx.train, gen, epochs=int(self.opt.ft_epochs), lr=self.opt.ft_lr or None
        )
        return evaluate_splits(model, data, self.ctx.eval_batch_size)
