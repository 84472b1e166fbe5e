"""FedSAM and FedASAM (Caldarola, Caputo & Ciccone, ECCV 2022): FedAvg with sharpness-aware local training.

Each local step is a two-pass SAM step (Foret et al. 2021): with the mini-batch gradient g at w,

* SAM:  ε = ρ · g / ‖g‖
* ASAM (Kwon et al. 2021): with the elementwise operator T_w = |w| + η for every parameter named ``*weight``
  (conv/linear/BN weights; T = 1 for biases, as in the ASAM reference code), ε = ρ · T²g / ‖T g‖

then the gradient at ``w + ε`` is taken, ``w`` is restored and the optimiser (the run's SGD/momentum) steps
with that gradient.  The client step is a declared program (``TrainConfig(two_pass="sam"|"asam")``, the math
in :mod:`fedfuse.engine.sam`), so every executor runs it, the batched one included.
Server aggregation is FedAvg.  Defaults: SAM ρ = 0.05, ASAM ρ = 0.5, η = 0.01 (the
ASAM/FedASAM reference implementations' defaults; tune ρ per dataset as Caldarola et al. do).  The FedMR
authors' benchmark ``Training_FedASAM.py`` uses ρ = 0.1, η = 0 for FedASAM; ``fedfuse reproduce fedmr`` uses
those.

BatchNorm running statistics are updated by the first (unperturbed) forward pass only: they are saved
before the perturbed pass and restored after it, so the perturbed weights never leak into the statistics.
FLOPs are counted as two forward-backward passes per sample.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from fedfuse.algorithms.base import ClientState
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.algorithms.mean_base import MeanOfDeltas
from fedfuse.engine.client import TrainConfig, TrainStats, train_local
from fedfuse.engine.program import ClientProgram
from fedfuse.engine.sam import sam_step
from fedfuse.options import opt
from fedfuse.types import ClientData, Message, Split, TensorDict


def train_sam(
    model: nn.Module,
    data: Split,
    cfg: TrainConfig,
    generator: torch.Generator,
    *,
    rho: float,
    adaptive: bool = False,
    eta: float = 0.01,
) -> TrainStats:
    """Local (A)SAM training: :func:`fedfuse.engine.client.train_local` with the SAM gradient hook."""
    return train_local(model, data, cfg, generator, before_step=sam_step(model, rho, adaptive, eta))


class FedSAM(FedAvg):
    name = "fedsam"
    description = "FedSAM: FedAvg with local sharpness-aware minimisation (SAM)"
    server_update = MeanOfDeltas(note="SAM's ascent step is client-side")
    local_dp_why = "SAM takes two gradients per step: DP-SGD would need both per-sample clipped and noised"
    adaptive = False

    @dataclass
    class Options(FedAvg.Options):
        rho: float = opt(0.05, "SAM neighbourhood radius ρ (SAM reference: 0.05)", ge=0.0)

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """FedAvg's standard step with a two-pass (A)SAM local spec; FLOPs count both passes."""
        if self.adaptive:  # η (T_w = |w| + η) is ASAM's alone: FedSAM does not offer it
            spec = self.ctx.train.with_two_pass("asam", float(self.opt.rho), float(self.opt.eta))
        else:
            spec = self.ctx.train.with_two_pass("sam", float(self.opt.rho))
        program = self.standard_program(payload, client_state, data, spec=spec)
        finalize = program.finalize

        def doubled(state: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            reply, cstate = finalize(state, stats)
            assert reply.stats is not None
            reply.stats.flops *= 2.0  # two forward-backward passes per step
            return reply, cstate

        return dataclasses.replace(program, finalize=doubled)


class FedASAM(FedSAM):
    name = "fedasam"
    description = "FedASAM: FedAvg with local adaptive sharpness-aware minimisation (ASAM)"
    server_update = MeanOfDeltas(note="ASAM's ascent step is client-side")
    local_dp_why = "ASAM takes two gradients per step: DP-SGD would need both per-sample clipped and noised"
    adaptive = True

    @dataclass
    class Options(FedAvg.Options):
        rho: float = opt(0.5, "ASAM radius ρ (ASAM/FedASAM reference: 0.5; FedMR's benchmark code: 0.1)", ge=0.0)
        eta: float = opt(0.01, "T_w = |w| + η (ASAM reference: 0.01; FedMR's benchmark code: 0)", ge=0.0)
