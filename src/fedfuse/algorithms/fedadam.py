"""FedAdam (Reddi et al., ICLR 2021, "Adaptive Federated Optimization", Algorithm 2): FedAvg whose server applies
Adam to the averaged update ``Δ_t = x̄_t − x_t``:

    m_t = β₁ m_{t−1} + (1 − β₁) Δ_t,   v_t = β₂ v_{t−1} + (1 − β₂) Δ_t²,   x_{t+1} = x_t + η_t m_t / (√v_t + τ)

with moments starting at 0 and Flower's ``FedAdam`` defaults (η = 0.1, β₁ = 0.9, β₂ = 0.99, τ = 1e-9).  Like
Flower, ``η_t`` is bias-corrected, ``η √(1 − β₂ᵗ) / (1 − β₁ᵗ)``, with t = 1, 2, … the server steps taken (Flower
writes the exponent as ``server_round + 1``, i.e. one step ahead); ``bias_correction=False`` is the paper's
Algorithm 2 (η_t = η).  The client learning rate η_l is the run's ``lr``.  Fusion, clipping and BatchNorm
buffers follow FedAvg's :class:`fedfuse.fusion.server.ServerRule` (statistics averaged, not optimised).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.algorithms.mean_base import MeanOfDeltas
from fedfuse.fusion.server import ServerAdaptive, ServerOptimizer
from fedfuse.options import opt


class FedAdam(FedAvg):
    name = "fedadam"
    description = "FedAdam: FedAvg with an Adam server optimiser on the averaged update (Reddi et al. 2021)"

    server_update = MeanOfDeltas(note="the Adam step runs on the mean (post-processing)")

    @dataclass
    class Options(FedAvg.FusionOptions):
        eta: float = opt(0.1, "server learning rate η (Flower's default)", gt=0.0)
        beta_1: float = opt(0.9, "first-moment decay β₁", ge=0.0, lt=1.0)
        beta_2: float = opt(0.99, "second-moment decay β₂", ge=0.0, lt=1.0)
        tau: float = opt(1e-9, "adaptivity τ added to √v (Flower's default; the paper tunes 1e-3 and below)", gt=0.0)
        bias_correction: bool = opt(True, "Adam's bias-corrected step (as Flower); False = the paper's Algorithm 2")

    def server_optimizer(self) -> ServerOptimizer | None:
        o = self.opt
        return ServerAdaptive("adam", eta=float(o.eta), beta_1=float(o.beta_1), beta_2=float(o.beta_2),
                              tau=float(o.tau), bias_correction=bool(o.bias_correction))
