"""Local differential privacy on the clients: DP-SGD (Abadi et al., CCS 2016) through Opacus (``dp=local``).

Every local step of a client samples each of its n_i training examples independently with probability
q_i = 1/⌈n_i/B⌉ (Opacus's Poisson data loader; B = ``batch_size``), clips every per-sample gradient to L2 norm
``dp_clip`` and adds Gaussian noise of std ``dp_noise``·``dp_clip`` to their sum before the optimiser step.  The
model a client sends is then (ε_i, δ)-DP with respect to each of *its own* examples, whatever the server does
with it (example-level privacy; central DP is client-level).  ε_i comes from Opacus's RDP accountant over all the
steps client i has taken in the run; ``metrics.jsonl`` reports the largest ε_i over the clients so far
(``dp_epsilon``) and the median over the clients that trained (``dp_epsilon_median``).

Layers whose output mixes samples (BatchNorm in training mode) have no per-sample gradient: such a model is
refused with Opacus's reasons (use a GroupNorm or normalisation-free variant).  Opacus is an optional dependency
(``pip install fedfuse[dp]``).
"""

from __future__ import annotations

import copy
import math
import warnings
from functools import lru_cache

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedfuse.engine.client import TrainConfig, TrainStats, task_loss
from fedfuse.errors import UserError
from fedfuse.extras import import_extra
from fedfuse.types import Split, TensorDict


def _opacus():  # -> module
    """Opacus, or :class:`fedfuse.extras.MissingExtra` naming ``pip install 'fedfuse[dp]'``."""
    return import_extra("opacus", "dp", "dp=local")


def check_local_dp(model: nn.Module) -> None:
    """Raise a :class:`~fedfuse.errors.UserError` with Opacus's reasons when it cannot compute per-sample
    gradients of ``model``."""
    _opacus()
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        why = "; ".join(sorted({str(e).splitlines()[0].split(". ")[0] for e in errors}))
        raise UserError(f"dp=local: Opacus cannot clip per-sample gradients of this model ({why}); BatchNorm mixes "
                         "the samples of a batch — use a model without it (e.g. a GroupNorm variant)")


def sample_rate(n: int, batch_size: int) -> float:
    """Opacus's Poisson sampling rate for ``n`` examples and batch size B: 1/⌈n/B⌉."""
    return 1.0 / max(math.ceil(n / batch_size), 1)


def train_dp_sgd(model: nn.Module, split: Split, train: TrainConfig, gen: torch.Generator, *, noise: float,
                 clip: float) -> tuple[TensorDict, TrainStats]:
    """DP-SGD on a copy of ``model`` for ``train.local_epochs`` epochs of Poisson-sampled batches; returns the
    trained state and the statistics (``steps`` counts every sampling step, empty batches included: each one is
    accounted).  The noise comes from ``gen``; batch sampling from the global torch RNG (seeded per client step by
    every executor), so runs are reproducible."""
    _opacus()
    from opacus import PrivacyEngine

    work = copy.deepcopy(model).train()  # Opacus hooks the module: never touch the caller's (cached) one
    params = [p for p in work.parameters() if p.requires_grad]
    if train.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=train.lr, weight_decay=train.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
    loader = DataLoader(TensorDataset(split.x, split.y), batch_size=min(train.batch_size, max(len(split), 1)))
    with warnings.catch_warnings():  # simulation: the noise comes from the run's seeded generator, not a CSPRNG
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = PrivacyEngine(accountant="rdp")
        private, popt, ploader = engine.make_private(module=work, optimizer=opt, data_loader=loader,
                                                     noise_multiplier=noise, max_grad_norm=clip,
                                                     noise_generator=gen)
    with warnings.catch_warnings():  # Opacus's hooks on a first layer whose input needs no gradient
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        stats = _steps(private, popt, ploader, train)
    state = {k: v.detach().clone() for k, v in private._module.state_dict().items()}
    return state, stats


def _steps(private: nn.Module, popt: torch.optim.Optimizer, ploader: DataLoader, train: TrainConfig) -> TrainStats:
    stats = TrainStats()
    for _ in range(train.local_epochs):
        for x, y in ploader:
            stats.steps += 1
            popt.zero_grad(set_to_none=True)
            if len(x) == 0:  # an empty Poisson batch: a zero gradient, and the step still adds its noise
                task_loss(private(x), y, reduction="sum").backward()
                popt.step()
                continue
            loss = task_loss(private(x), y)
            loss.backward()
            popt.step()
            stats.samples += len(x)
            stats.loss_sum += float(loss.detach()) * len(x)
            if train.max_steps and stats.steps >= train.max_steps:
                break
    return stats


@lru_cache(maxsize=65536)
def local_epsilon(noise: float, rate: float, steps: int, delta: float) -> float:
    """ε at ``delta`` of ``steps`` DP-SGD steps of sampling rate ``rate`` and noise ``noise`` (Opacus's RDP
    accountant)."""
    from opacus.accountants import RDPAccountant

    if steps <= 0:
        return 0.0
    if noise <= 0:
        return math.inf
    acc = RDPAccountant()
    acc.history = [(noise, rate, steps)]
    return float(acc.get_epsilon(delta))
