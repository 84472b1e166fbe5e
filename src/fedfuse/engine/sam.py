"""Sharpness-aware two-pass steps (SAM, Foret et al. 2021; ASAM, Kwon et al. 2021) as an engine primitive.

With the mini-batch gradient g at w:

* SAM:  ε = ρ · g / ‖g‖
* ASAM: with the elementwise operator T_w = |w| + η for every parameter named ``*weight`` (conv/linear/BN
  weights; T = 1 for biases, as in the ASAM reference code), ε = ρ · T²g / ‖T g‖

then the gradient is taken again at ``w + ε``, ``w`` is restored and the optimiser steps with that second
gradient.  BatchNorm running statistics come from the first (unperturbed) pass only.  A declared client program
asks for it with ``TrainConfig(two_pass="sam" | "asam", sam_rho=ρ, sam_eta=η)``; every executor honours it (the
sequential one with :func:`sam_step` on a module, the batched one on client-stacked tensors).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedfuse.engine.client import GradHook, task_loss
from fedfuse.runtime.precision import train_autocast
from fedfuse.structure import batchnorm_modules

TWO_PASS = ("", "sam", "asam")


def asam_scale(name: str, p: torch.Tensor, adaptive: bool, eta: float) -> torch.Tensor | None:
    """ASAM's T_w = |w| + η for a ``*weight`` parameter; ``None`` (T = 1) otherwise or for plain SAM."""
    return (p.abs() + eta) if adaptive and name.endswith("weight") else None


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
        t = asam_scale(name, p, adaptive, eta)
        scaled.append((p.grad * t, t) if t is not None else (p.grad, None))
    norm = torch.sqrt(sum((tg.pow(2).sum() for tg, _ in filter(None, scaled)), torch.zeros(())))
    eps = []
    for p, s in zip(params, scaled, strict=True):
        if s is None:
            eps.append(torch.zeros_like(p))
            continue
        tg, t = s
        e = tg * t if t is not None else tg.clone()  # T²g (adaptive) or g
        eps.append(e * (rho / (float(norm) + 1e-12)))
    return eps


def sam_step(model: nn.Module, rho: float, adaptive: bool = False, eta: float = 0.01,
             loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             names: list[str] | None = None) -> GradHook:
    """A ``train_local`` hook that replaces the gradient at w by the gradient at w + ε (SAM / ASAM).

    ``loss(model, x, y)`` is the objective of the second pass (default: the task loss); ``names`` the
    parameters perturbed (default: every one that requires grad).  BN buffers touched by the perturbed forward
    pass are restored, so statistics come from the unperturbed pass.
    """
    keep = None if names is None else set(names)
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad and (keep is None or k in keep)]
    params = [p for _, p in named]
    bn_buffers = [b for _, m in batchnorm_modules(model) for b in m.buffers()]
    objective = loss or (lambda m, x, y: task_loss(m(x), y))

    def step(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        eps = sam_perturbation(named, rho, adaptive, eta)
        saved = [b.detach().clone() for b in bn_buffers]
        with torch.no_grad():
            for p, e in zip(params, eps, strict=True):
                p.add_(e)
        m.zero_grad(set_to_none=True)
        with train_autocast(x.device):
            second = objective(m, x, y)
        second.backward()
        with torch.no_grad():
            for p, e in zip(params, eps, strict=True):
                p.sub_(e)
            for b, v in zip(bn_buffers, saved, strict=True):
                b.copy_(v)

    return step


@torch.no_grad()
def stacked_perturbation(names: list[str], params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                         rho: float, adaptive: bool, eta: float) -> dict[str, torch.Tensor]:
    """ε of :func:`sam_perturbation` for client-stacked tensors (leading axis = client), one norm per client."""
    scaled = {}
    for n in names:
        g = grads.get(n)
        if g is not None:
            t = asam_scale(n, params[n], adaptive, eta)
            scaled[n] = (g * t, t) if t is not None else (g, None)
    if not scaled:
        return {}
    C = next(iter(scaled.values()))[0].shape[0]
    norm = torch.stack([tg.reshape(C, -1).pow(2).sum(1) for tg, _ in scaled.values()]).sum(0).sqrt()
    coef = rho / (norm + 1e-12)
    return {n: (tg * t if t is not None else tg) * coef.view(-1, *([1] * (tg.dim() - 1)))
            for n, (tg, t) in scaled.items()}


__all__ = ["TWO_PASS", "asam_scale", "sam_perturbation", "sam_step", "stacked_perturbation"]
