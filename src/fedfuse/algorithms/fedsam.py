"""FedSAM and FedASAM (Caldarola, Caputo & Ciccone, ECCV 2022): FedAvg with sharpness-aware local training.

Each local step is a two-pass SAM step (Foret et al. 2021): with the mini-batch gradient g at w,

* SAM:  ε = ρ · g / ‖g‖
* ASAM (Kwon et al. 2021): with the elementwise operator T_w = |w| + η for every parameter named ``*weight``
  (conv/linear/BN weights; T = 1 for biases, as in the ASAM reference code), ε = ρ · T²g / ‖T g‖

then the gradient at ``w + ε`` is taken, ``w`` is restored and the optimiser (the run's SGD/momentum) steps
with that gradient.  Server aggregation is FedAvg.  Defaults: SAM ρ = 0.05, ASAM ρ = 0.5, η = 0.01 (the
ASAM/FedASAM reference implementations' defaults; tune ρ per dataset as Caldarola et al. do).  The FedMR
authors' benchmark ``Training_FedASAM.py`` uses ρ = 0.1, η = 0 for FedASAM; ``fedfuse reproduce fedmr`` uses
those.

BatchNorm running statistics are updated by the first (unperturbed) forward pass only: they are saved
before the perturbed pass and restored after it, so the perturbed weights never leak into the statistics.
FLOPs are counted as two forward-backward passes per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedfuse.algorithms.base import ClientState, state_of
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.engine.client import GradHook, TrainConfig, TrainStats, task_loss, train_local
from fedfuse.options import opt
from fedfuse.types import ClientData, Message, Split


@torch.no_grad()
def sam_perturbation(
    named: list[tuple[str, nn.Parameter]], rho: float, adaptive: bool = False, eta: float = 0.01
) -> list[torch.Tensor]:
    """The ascent step ε for every (name, parameter) (zeros where there is no gradient)."""
    scaled = []
    params = [p for _, p in named]
    for name, p in named:
        if p.grad is None:
            scaled.append(None)
            continue
        t = (p.abs() + eta) if adaptive and name.endswith("weight") else None
        scaled.append((p.grad * t, t) if t is not None else (p.grad, None))
    norm = torch.sqrt(sum((tg.pow(2).sum() for tg, _ in filter(None, scaled)), torch.zeros(())))
    eps = []
    for p, s in zip(params, scaled):
        if s is None:
            eps.append(torch.zeros_like(p))
            continue
        tg, t = s
        e = tg * t if t is not None else tg.clone()  # T²g (adaptive) or g
        eps.append(e * (rho / (float(norm) + 1e-12)))
    return eps


def sam_step(model: nn.Module, rho: float, adaptive: bool = False, eta: float = 0.01) -> GradHook:
    """A ``train_local`` hook that replaces the gradient at w by the gradient at w + ε (SAM / ASAM).

    BN buffers touched by the perturbed forward pass are restored, so statistics come from the unperturbed pass.
    """
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    bn_buffers = [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for b in m.buffers()]

    def step(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        eps = sam_perturbation(named, rho, adaptive, eta)
        saved = [b.detach().clone() for b in bn_buffers]
        with torch.no_grad():
            for p, e in zip(params, eps):
                p.add_(e)
        m.zero_grad(set_to_none=True)
        task_loss(m(x), y).backward()
        with torch.no_grad():
            for p, e in zip(params, eps):
                p.sub_(e)
            for b, v in zip(bn_buffers, saved):
                b.copy_(v)

    return step


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
    adaptive = False

    @dataclass
    class Options(FedAvg.Options):
        rho: float = opt(0.05, "SAM neighbourhood radius ρ (SAM reference: 0.05)", ge=0.0)
        eta: float = opt(0.01, "ASAM only: T_w = |w| + η", ge=0.0)

    def fit(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> tuple[Message, ClientState]:
        model = self.ctx.load(payload.tensors, payload.meta)
        st = train_sam(model, data.train, self.ctx.train, gen, rho=float(self.opt.rho), adaptive=self.adaptive,
                       eta=float(self.opt.eta))
        fit = self.fit_stats(model, data, st)
        fit.flops *= 2.0  # two forward-backward passes per step
        return Message(state_of(model), stats=fit), client_state


class FedASAM(FedSAM):
    name = "fedasam"
    description = "FedASAM: FedAvg with local adaptive sharpness-aware minimisation (ASAM)"
    adaptive = True

    @dataclass
    class Options(FedAvg.Options):
        rho: float = opt(0.5, "ASAM radius ρ (ASAM/FedASAM reference: 0.5; FedMR's benchmark code: 0.1)", ge=0.0)
        eta: float = opt(0.01, "T_w = |w| + η (ASAM reference: 0.01; FedMR's benchmark code: 0)", ge=0.0)
