"""FedYogi (Reddi et al., ICLR 2021, "Adaptive Federated Optimization", Algorithm 2): FedAvg whose server applies
Yogi to the averaged update ``Δ_t = x̄_t − x_t``:

    m_t = β₁ m_{t−1} + (1 − β₁) Δ_t,   v_t = v_{t−1} − (1 − β₂) Δ_t² · sign(v_{t−1} − Δ_t²),
    x_{t+1} = x_t + η m_t / (√v_t + τ)

with moments starting at 0 and Flower's ``FedYogi`` defaults (η = 0.01, β₁ = 0.9, β₂ = 0.99, τ = 1e-3; no bias
correction, as in the paper and Flower).  The client learning rate η_l is the run's ``lr``.  Fusion, clipping and
BatchNorm buffers follow FedAvg's :class:`fedfuse.fusion.server.ServerRule` (statistics averaged, not optimised).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.algorithms.mean_base import MeanOfDeltas
from fedfuse.fusion.server import ServerAdaptive, ServerOptimizer
from fedfuse.options import opt


class FedYogi(FedAvg):
    name = "fedyogi"
    description = "FedYogi: FedAvg with a Yogi server optimiser on the averaged update (Reddi et al. 2021)"

    server_update = MeanOfDeltas(note="the Yogi step runs on the mean (post-processing)")

    @dataclass
    class Options(FedAvg.FusionOptions):
        eta: float = opt(0.01, "server learning rate η (Flower's default)", gt=0.0)
        beta_1: float = opt(0.9, "first-moment decay β₁", ge=0.0, lt=1.0)
        beta_2: float = opt(0.99, "second-moment decay β₂", ge=0.0, lt=1.0)
        tau: float = opt(1e-3, "adaptivity τ added to √v (Flower's default)", gt=0.0)

    def server_optimizer(self) -> ServerOptimizer | None:
        o = self.opt
        return ServerAdaptive("yogi", eta=float(o.eta), beta_1=float(o.beta_1), beta_2=float(o.beta_2),
                              tau=float(o.tau))
