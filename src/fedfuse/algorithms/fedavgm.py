"""FedAvgM (Hsu, Qi & Brown 2019, "Measuring the effects of non-identical data distribution"): FedAvg with server
momentum.  With the averaged update ``Δ_t = x̄_t − x_t`` (the negative pseudo-gradient):

    m_t = β · m_{t−1} + Δ_t   (m_1 = Δ_1),      x_{t+1} = x_t + η · m_t

as Flower's ``FedAvgM`` (``server_learning_rate`` η = ``server_lr``, ``server_momentum`` β).  Flower's default
β = 0 is plain FedAvg; the default here is β = 0.9, the value Hsu et al. and Reddi et al. use.  Fusion, clipping
and the treatment of BatchNorm buffers are FedAvg's (:class:`fedfuse.fusion.server.ServerRule`): running
statistics take the average, ``num_batches_tracked`` follows ``int_policy``; only parameters get momentum.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.algorithms.mean_base import MeanOfDeltas
from fedfuse.fusion.server import ServerOptimizer, ServerSGD
from fedfuse.options import opt


class FedAvgM(FedAvg):
    name = "fedavgm"
    description = "FedAvgM: FedAvg with server momentum m = beta m + delta, x += server_lr m (Hsu et al. 2019)"

    server_update = MeanOfDeltas(note="server momentum runs on the mean (post-processing)")

    @dataclass
    class Options(FedAvg.FusionOptions):
        server_lr: float = opt(1.0, "server learning rate η (Flower: server_learning_rate)", gt=0.0)
        server_momentum: float = opt(0.9, "server momentum β (Flower's default 0 is plain FedAvg)", ge=0.0, lt=1.0)

    def server_optimizer(self) -> ServerOptimizer | None:
        return ServerSGD(lr=float(self.opt.server_lr), momentum=float(self.opt.server_momentum))
