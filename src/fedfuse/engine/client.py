"""Client-side building blocks: local training, evaluation, per-sample losses, FLOP counting, the client's label
histogram and FedMA-style retraining schedules.

These are plain functions of (model, data, hyper-parameters, generator); algorithms compose them in
their ``fit`` / ``evaluate`` hooks.  Nothing here knows about server state.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.errors import UserError
from fedfuse.runtime.precision import train_autocast, train_layout
from fedfuse.sections import TrainConfig as TrainConfig  # the run config's training section
from fedfuse.types import ClientData, Split

#: ``loss(model, x, y) -> (minimised, reported)``: a batch loss that replaces the cross-entropy.
BatchLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
GradHook = Callable[[nn.Module, torch.Tensor, torch.Tensor], None]


@dataclass
class TrainStats:
    """What one local training did; ``generator`` is the client's generator where training left it (a
    program's finalize may continue drawing from it)."""

    steps: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    generator: torch.Generator | None = field(default=None, repr=False, compare=False)

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(self.samples, 1)


def task_loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy for classification (B, C) and language modelling (B, L, V)."""
    if logits.dim() == 3:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)
    return F.cross_entropy(logits, y, reduction=reduction)


LR_SCHEDULES = ("constant", "cyclic")
#: Floor of the cyclic schedule as a fraction of its peak in the MSfusion paper's setup (App. A.2.2: CyclicLR
#: 0.001 → 0.0012), shared by MSfusion and the baselines it is compared with (HeteroFL, FedRolex).
CYCLIC_MIN_RATIO = 0.001 / 0.0012


def cyclic_lr(r: int, total: int, lr_min: float, lr_max: float) -> float:
    """Triangular CyclicLR with one cycle over ``total`` rounds: lr_min → lr_max (mid-training) → lr_min."""
    if total <= 1:
        return lr_min
    x = abs(2.0 * r / total - 1.0)
    return lr_min + (lr_max - lr_min) * (1.0 - x)


def scheduled_lr(lr: float, r: int, total: int, schedule: str = "constant", min_ratio: float = 1.0) -> float:
    """The local learning rate of round ``r`` of ``total``.

    One owner: the run's ``lr`` (``--lr``) is the value a schedule is built from and is never replaced.
    ``constant`` returns it; ``cyclic`` is a triangular cycle over all rounds whose *peak* is ``lr`` and whose
    floor is ``min_ratio · lr`` (MSfusion App. A.2.2: 0.001 → 0.0012, i.e. ``min_ratio`` = 1/1.2).
    Algorithms expose only the schedule's shape (its name and ``min_ratio``), never an absolute rate.
    """
    if schedule == "constant":
        return float(lr)
    if schedule == "cyclic":
        if not 0.0 < min_ratio <= 1.0:
            raise UserError(f"lr_min_ratio must be in (0, 1], got {min_ratio}")
        return cyclic_lr(r, total, min_ratio * float(lr), float(lr))
    raise UserError(f"unknown learning-rate schedule {schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")


def make_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig, lr: float | None = None):
    lr = cfg.lr if lr is None else lr
    params = list(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
    raise UserError(f"unknown optimizer {cfg.optimizer!r}; choose sgd or adam")


def train_local(
    model: nn.Module,
    data: Split,
    cfg: TrainConfig,
    generator: torch.Generator,
    *,
    loss: BatchLoss | None = None,
    params: Iterable[torch.nn.Parameter] | None = None,
    epochs: int | None = None,
    lr: float | None = None,
    before_step: GradHook | None = None,
) -> TrainStats:
    """Mini-batch training of ``model`` on ``data`` in place (the sequential loop of every client step).

    Batches are drawn by a permutation from ``generator`` each epoch (so the order is reproducible and
    independent of any global RNG).  ``loss(model, x, y) -> (minimised, reported)`` replaces the cross-entropy
    (a declared program's :func:`fedfuse.engine.program.step_loss`).  ``params`` restricts the optimised
    parameters (FedMA freezes lower layers).  ``before_step(model, x, y)`` runs after the backward pass and
    before clipping and the optimiser step; it may replace the gradients (SAM's second pass, a gradient
    transform).  ``stats.generator`` is ``generator`` where training left it.
    """
    with train_layout(model, data.x):  # the run's memory format (fedfuse.runtime.precision); NCHW by default
        return _train_steps(model, data, cfg, generator, loss=loss, params=params, epochs=epochs, lr=lr,
                            before_step=before_step)


def _train_steps(model: nn.Module, data: Split, cfg: TrainConfig, generator: torch.Generator, *,
                 loss: BatchLoss | None, params: Iterable[torch.nn.Parameter] | None, epochs: int | None,
                 lr: float | None, before_step: GradHook | None) -> TrainStats:
    model.train()
    n = len(data)
    stats = TrainStats(generator=generator)
    if n == 0:
        return stats
    opt = make_optimizer(model.parameters() if params is None else params, cfg, lr)
    trainable = [p for g in opt.param_groups for p in g["params"]]
    bs = min(cfg.batch_size, n)
    epochs = cfg.local_epochs if epochs is None else epochs
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator).to(data.x.device)
        for start in range(0, n, bs):
            idx = perm[start : start + bs]
            x, y = data.x[idx], data.y[idx]
            with train_autocast(x.device):  # the run's precision (fedfuse.runtime.precision); no-op at fp32
                if loss is None:
                    total = reported = task_loss(model(x), y)
                else:
                    total, reported = loss(model, x, y)
            opt.zero_grad(set_to_none=True)
            total.backward()
            if before_step is not None:
                before_step(model, x, y)
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
            opt.step()
            stats.steps += 1
            stats.samples += int(idx.numel())
            stats.loss_sum += float(reported.detach()) * int(idx.numel())
            if cfg.max_steps and stats.steps >= cfg.max_steps:
                return stats
    return stats


@dataclass
class EvalStats:
    loss_sum: float = 0.0
    correct: int = 0
    count: int = 0  # samples (classification) or tokens (LM)

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else math.nan

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else math.nan

    def as_dict(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}_loss": self.loss, f"{prefix}_accuracy": self.accuracy, f"{prefix}_count": self.count}


@torch.no_grad()
def evaluate_model(
    model: nn.Module,
    data: Split,
    batch_size: int = 512,
    predict: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> EvalStats:
    """Summed cross-entropy, correct predictions and count on ``data``.

    ``predict(x)`` may replace ``model(x)`` and return *probabilities* (ensembles, mixtures); the loss is
    then the negative log of the predicted probability.
    """
    model.eval()
    st = EvalStats()
    for start in range(0, len(data), batch_size):
        x, y = data.x[start : start + batch_size], data.y[start : start + batch_size]
        if predict is None:
            out = model(x)
            st.loss_sum += float(task_loss(out, y, reduction="sum"))
        else:
            out = predict(x)
            lp = out.clamp_min(1e-12).log()
            st.loss_sum += float(F.nll_loss(lp.reshape(-1, lp.shape[-1]), y.reshape(-1), reduction="sum"))
        st.correct += int((out.argmax(-1) == y).sum())
        st.count += int(y.numel())
    return st


_FLOP_CACHE: dict[tuple, float] = {}


def train_flops_per_sample(model: nn.Module, x: torch.Tensor, y: torch.Tensor, key: tuple = ()) -> float:
    """Forward + backward FLOPs of one training sample, counted with ``torch.utils.flop_counter``.

    Counted once per (architecture key, input shape) on a batch of up to 8 samples and memoised; the
    optimiser update (a few FLOPs per parameter) is not included.
    """
    from torch.utils.flop_counter import FlopCounterMode

    xb, yb = x[:8], y[:8]
    ck = (key, type(model).__name__, tuple(xb.shape[1:]), sum(p.numel() for p in model.parameters()))
    if ck not in _FLOP_CACHE:
        # count on a copy: a train-mode pass would move BN running statistics of the live model
        model = copy.deepcopy(model)
        model.train()
        rnn_tokens: list[tuple[nn.Module, int]] = []
        hooks = [
            m.register_forward_hook(lambda mod, inp, out: rnn_tokens.append((mod, _tokens(mod, inp[0]))))
            for m in model.modules()
            if isinstance(m, nn.LSTM | nn.RNN)
        ]
        counter = FlopCounterMode(display=False)
        try:
            with counter:
                loss = task_loss(model(xb), yb)
                loss.backward()
        finally:
            for h in hooks:
                h.remove()
        total = counter.get_total_flops() + sum(3 * _rnn_forward_flops(m) * t for m, t in rnn_tokens)
        _FLOP_CACHE[ck] = total / max(int(xb.shape[0]), 1)
    return _FLOP_CACHE[ck]


_FWD_CACHE: dict[tuple, float] = {}


def forward_flops_per_sample(model: nn.Module, x: torch.Tensor, key: tuple = ()) -> float:
    """Forward-only FLOPs of one sample (``torch.utils.flop_counter``), memoised per architecture/shape."""
    from torch.utils.flop_counter import FlopCounterMode

    xb = x[:8]
    ck = (key, type(model).__name__, tuple(xb.shape[1:]), sum(p.numel() for p in model.parameters()))
    if ck not in _FWD_CACHE:
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model(xb)
        _FWD_CACHE[ck] = counter.get_total_flops() / max(int(xb.shape[0]), 1)
    return _FWD_CACHE[ck]


@torch.no_grad()
def per_sample_losses(model: nn.Module, split: Split, batch_size: int = 512) -> torch.Tensor:
    """Cross-entropy of every sample of ``split`` under ``model`` in eval mode (float64 vector)."""
    model.eval()
    parts = [task_loss(model(split.x[s : s + batch_size]), split.y[s : s + batch_size], reduction="none")
             for s in range(0, len(split), batch_size)]
    return torch.cat(parts).to(torch.float64) if parts else torch.zeros(0, dtype=torch.float64)


def class_counts(data: ClientData, num_classes: int) -> list[int]:
    """How many training samples of each class the client holds (its own data: a client may report it)."""
    y = data.train.y
    if not len(y):
        return [0] * num_classes
    return torch.bincount(y.reshape(-1).cpu(), minlength=num_classes)[:num_classes].tolist()


def retrain_config(base: TrainConfig, schedule: str, epochs: int, lr: float = 0.0, last: bool = False,
                   weight_decay: float = 0.0, last_layer_schedule: bool = True) -> tuple[TrainConfig, int]:
    """The optimiser settings and epochs of one FedMA-style retraining step (FedMA, one-shot matching).

    ``schedule="code"``: ``IBM/FedMA``'s ``local_retrain`` — SGD, momentum 0.9, ``lr`` (0 = the run's lr),
    ``weight_decay``; ``last=True`` (only the head is trained): lr/10, weight decay 1e-4, 3× epochs.
    ``schedule="run"``: the run's optimiser settings; ``last`` applies the same head schedule only when
    ``last_layer_schedule`` is set.
    """
    epochs = max(int(epochs), 0)
    if schedule == "code":
        cfg = dataclasses.replace(base, optimizer="sgd", momentum=0.9, lr=lr if lr > 0 else base.lr,
                                  weight_decay=weight_decay)
    elif schedule == "run":
        cfg = base
        if not last_layer_schedule:
            return cfg, epochs
    else:
        raise UserError(f"retrain_schedule={schedule!r}; choose code or run")
    if last:
        cfg = dataclasses.replace(cfg, lr=cfg.lr / 10, weight_decay=1e-4)
        epochs *= 3
    return cfg, epochs


def _tokens(rnn: nn.Module, x: torch.Tensor) -> int:
    if isinstance(x, torch.nn.utils.rnn.PackedSequence):
        return int(x.data.shape[0])
    return int(x.shape[0] * x.shape[1]) if x.dim() == 3 else int(x.shape[0])


def _rnn_forward_flops(rnn: nn.Module) -> int:
    """Forward FLOPs per token of an ``nn.LSTM``/``nn.RNN`` (the flop counter has no formula for their fused
    kernels): 2 · gates · (input·hidden + hidden·hidden) per layer and direction; training ≈ 3× forward."""
    gates = 4 if isinstance(rnn, nn.LSTM) else 1
    h = rnn.hidden_size
    dirs = 2 if rnn.bidirectional else 1
    total = 0
    for layer in range(rnn.num_layers):
        inp = rnn.input_size if layer == 0 else h * dirs
        total += dirs * 2 * gates * (inp * h + h * h)
    return total
