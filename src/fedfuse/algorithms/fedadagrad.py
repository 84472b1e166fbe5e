"""FedAdagrad (Reddi et al., ICLR 2021, "Adaptive Federated Optimization", Algorithm 2): FedAvg whose server
applies Adagrad to the averaged update ``Δ_t = x̄_t − x_t``:

    v_t = v_{t−1} + Δ_t²,      x_{t+1} = x_t + η Δ_t / (√v_t + τ)

with v starting at 0 and Flower's ``FedAdagrad`` defaults (η = 0.1, τ = 1e-9, no first moment: β₁ = 0).  The
client learning rate η_l is the run's ``lr``.  Fusion, clipping and BatchNorm buffers follow FedAvg's
:class:`fedfuse.fusion.server.ServerRule` (statistics averaged, not optimised).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.algorithms.mean_base import MeanOfDeltas
from fedfuse.fusion.server import ServerAdaptive, ServerOptimizer
from fedfuse.options import opt


class FedAdagrad(FedAvg):
    name = "fedadagrad"
    description = "FedAdagrad: FedAvg with an Adagrad server optimiser on the averaged update (Reddi et al. 2021)"

    server_update = MeanOfDeltas(note="the Adagrad step runs on the mean (post-processing)")

    @dataclass
    class Options(FedAvg.FusionOptions):
        eta: float = opt(0.1, "server learning rate η (Flower's default)", gt=0.0)
        tau: float = opt(1e-9, "adaptivity τ added to √v (Flower's default; the paper tunes 1e-3 and below)", gt=0.0)

    def server_optimizer(self) -> ServerOptimizer | None:
        return ServerAdaptive("adagrad", eta=float(self.opt.eta), tau=float(self.opt.tau))
