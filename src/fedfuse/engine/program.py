"""Declared client programs: a client step described as data and pure functions.

An algorithm that declares its client step as a :class:`ClientProgram` hands the *training loop* to the
executor: the sequential executor runs it on the template module (:func:`run_program`, bit-identical to
:func:`fedfuse.engine.client.train_local`), the batched executor trains many clients at once with ``vmap``, and
the process executor runs :func:`run_program` in worker processes.

A program says

- where training starts: the architecture ``model`` (a template) and the starting state ``init`` (parameters
  and buffers, e.g. the received global model).  Template entries that ``init`` leaves out are a frozen base
  shared by every client (LoRA's base model): read from the template, never optimised, not sent back;
- how to train: ``spec``, the run's :class:`~fedfuse.engine.client.TrainConfig` (epochs, batch size,
  optimiser, learning rate, clipping, step cap, SAM two-pass steps), on the samples ``train`` (``None``: the
  client's training split; FedEM trains on per-sample soft targets);
- what to minimise on a batch: ``loss(batch)``, the reported training loss (default :func:`cross_entropy`), plus
  the declared :class:`LossTerm` s.  Both read a :class:`Batch`: the inputs and labels, the logits, the
  model's penultimate ``features`` when the program declares ``features=True`` (MSfusion's contrastive term),
  the functional parameters and buffers, the per-client constant tensors ``refs`` (FedProx's anchor,
  HeteroFL's class mask, FedGen's per-step noise indexed with ``batch.step``) and the optimiser step;
- which parameters move: ``trainable`` (``None``: every parameter with ``requires_grad``), and an optional
  per-client gradient ``transform(grads, params, refs)`` applied after a SAM second pass and before
  clipping and the optimiser step (Dis-PFL's sparse masks);
- how the reply is built: ``finalize(trained_state, stats)``; ``stats.generator`` is the client's generator
  where training left it (for post-training draws such as Dis-PFL's gradient-screening batch).

One step function serves every executor: :func:`step_loss` computes the loss of one client on one batch from
functional tensors; the sequential driver calls it with the module's own tensors, the batched one ``vmap`` s
it over clients, and both apply ``transform`` per client.  The stacked executor (linear models) computes the
forward pass of all clients as batched products and then evaluates :func:`batch_loss`, the part of
:func:`step_loss` after the forward pass, per client.  A program cannot be honoured by one executor and
misread by another.

Losses must reduce over samples with :meth:`Batch.mean` or :meth:`Batch.cross_entropy` (the batched executor
pads ragged batches; padded samples carry weight 0).  A term that reads the batch as a whole (a batch
statistic) declares ``couples_batch=True``, and its clients are then batched only with equal batch schedules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from fedfuse.engine.client import TrainConfig, TrainStats, task_loss, train_local
from fedfuse.engine.sam import sam_step
from fedfuse.types import ClientData, Message, Split, TensorDict


@dataclass(frozen=True)
class Batch:
    """One client's batch as a loss sees it (functional: the same in every executor)."""

    x: torch.Tensor
    y: torch.Tensor
    logits: torch.Tensor
    features: torch.Tensor | None  # the head's input, when the program declares ``features=True``
    params: TensorDict  # the parameters being trained (name → tensor)
    buffers: TensorDict
    refs: TensorDict  # the program's per-client constants
    step: int  # the optimiser step (0-based), for constants drawn per step
    mask: torch.Tensor | None = None  # (B,) 1 = real sample; None = every sample is real

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over the real samples of per-sample ``values`` (B,)."""
        if self.mask is None:
            return values.mean()
        return (values * self.mask).sum() / self.mask.sum().clamp_min(1)

    def cross_entropy(self, logits: torch.Tensor | None = None) -> torch.Tensor:
        """The task loss (cross-entropy; per token for language models) of ``logits`` (default: the batch's)."""
        logits = self.logits if logits is None else logits
        if self.mask is None:
            return task_loss(logits, self.y)
        return self.mean(task_loss(logits, self.y, reduction="none").reshape(self.y.shape[0], -1).mean(1))


#: ``loss(batch) -> scalar``.
Loss = Callable[[Batch], torch.Tensor]
#: ``transform(grads, params, refs) -> grads``: one client's gradients (name → tensor, parameters without a
#: gradient left out) after the backward pass(es), before clipping and the step.
GradTransform = Callable[[TensorDict, TensorDict, TensorDict], TensorDict]
#: ``finalize(trained_state, stats) -> (reply, new_client_state)``.
Finalize = Callable[[TensorDict, TrainStats], tuple[Message, Any]]


def cross_entropy(batch: Batch) -> torch.Tensor:
    """The default loss: cross-entropy on the batch's labels."""
    return batch.cross_entropy()


@dataclass(frozen=True)
class LossTerm:
    """A declared addition to the loss (not part of the reported training loss).  ``couples_batch``: the term
    reads the batch as a whole, so padding a batch would change it."""

    name: str
    fn: Loss
    couples_batch: bool = False


@dataclass
class ClientProgram:
    """One client's declared step; see the module docstring."""

    model: nn.Module
    init: TensorDict
    spec: TrainConfig
    finalize: Finalize
    loss: Loss = cross_entropy
    terms: tuple[LossTerm, ...] = ()
    features: bool = False
    refs: TensorDict = field(default_factory=dict)
    trainable: frozenset[str] | None = None
    transform: GradTransform | None = None
    train: Split | None = None

    def __post_init__(self) -> None:
        named = self.model.named_parameters
        self.tied = len(list(named(remove_duplicate=False))) != len(list(named()))

    def check(self) -> None:
        """Everything the optimiser moves must start from ``init``."""
        outside = [n for n in self.optimised_names() if n not in self.init]
        if outside:
            raise ValueError(f"optimised parameters missing from init: {outside[:3]}")

    def train_split(self, data: ClientData) -> Split:
        """The samples the program trains on (``train``, else the client's training split)."""
        if self.train is None:
            return data.train
        if len(self.train) != len(data.train):
            raise ValueError(f"train has {len(self.train)} samples for {len(data.train)} training samples")
        return self.train

    def optimised_names(self) -> list[str]:
        """Parameter names the optimiser updates, in ``named_parameters`` order."""
        return [n for n, p in self.model.named_parameters()
                if p.requires_grad and (self.trainable is None or n in self.trainable)]

    def with_spec(self, **changes: Any) -> ClientProgram:
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, **changes))


class _FeaturesAndLogits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.features_and_logits(x)


def forward(model: nn.Module, state: Mapping[str, torch.Tensor] | None, x: torch.Tensor, *, features: bool = False,
            tied: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(features, logits)`` of ``model`` evaluated with ``state`` (entries it lacks, or all with ``None``: the
    module's own).  ``features`` needs a model with ``features_and_logits`` (every
    :class:`~fedfuse.models.base.FedModel`)."""
    if state is None:
        return model.features_and_logits(x) if features else (None, model(x))
    if not features:
        return None, functional_call(model, dict(state), (x,), strict=False, tie_weights=tied)
    view = _FeaturesAndLogits(model)
    return functional_call(view, {"model." + k: v for k, v in state.items()}, (x,), strict=False, tie_weights=tied)


def step_loss(program: ClientProgram, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
              refs: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None,
              step: int = 0, frozen: Mapping[str, torch.Tensor] | None = None,
              own: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """THE training loss of one client on one batch: ``(minimised, reported)`` = (loss + terms, loss).

    ``frozen``: template tensors outside ``params``/``buffers`` passed explicitly (the batched executor's shared
    base, detached).  ``own``: ``params``/``buffers`` are the template's own tensors (the sequential driver), so
    the template is called as it is.  Every executor computes its gradients from this function."""
    state = None if own else {**(frozen or {}), **params, **buffers}
    z, logits = forward(program.model, state, x, features=program.features, tied=program.tied)
    return batch_loss(program, Batch(x, y, logits, z, dict(params), dict(buffers), dict(refs), step, mask))


def batch_loss(program: ClientProgram, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(minimised, reported)`` = (loss + terms, loss) of one client's forward pass ``batch``: the part of
    :func:`step_loss` after the forward pass (the stacked executor computes the forward pass of all clients as
    batched products and evaluates this per client)."""
    reported = program.loss(batch)
    extra: torch.Tensor | None = None
    for term in program.terms:
        v = term.fn(batch)
        extra = v if extra is None else extra + v
    return (reported if extra is None else reported + extra), reported


def run_program(program: ClientProgram, data: ClientData, gen: torch.Generator) -> tuple[Message, Any]:
    """The sequential execution: load ``init`` into the template and train it in place (``train_local``'s
    batches, operations and optimiser); parameters outside the optimised set have ``requires_grad`` off while
    it trains."""
    model = program.model
    program.check()
    loaded = model.load_state_dict(program.init, strict=False)
    if loaded.unexpected_keys:
        raise KeyError(f"init keys the model does not have: {loaded.unexpected_keys[:3]}")
    named = dict(model.named_parameters())
    names = program.optimised_names()
    frozen = [p for n, p in named.items() if n not in set(names) and p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        stats = _train(program, model, program.train_split(data), gen, [named[n] for n in names])
    finally:
        for p in frozen:
            p.requires_grad_(True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k in program.init}
    return program.finalize(state, stats)


def _train(program: ClientProgram, model: nn.Module, split: Split, gen: torch.Generator,
           params: list[nn.Parameter]) -> TrainStats:
    spec, step = program.spec, [0]  # the optimiser step the loss is computed for
    own_params, own_buffers = dict(model.named_parameters()), dict(model.named_buffers())  # trained in place

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return step_loss(program, own_params, own_buffers, program.refs, x, y, None, step[0], own=True)

    second = sam_step(model, spec.sam_rho, spec.two_pass == "asam", spec.sam_eta, names=program.optimised_names(),
                      loss=lambda m, x, y: loss(m, x, y)[0]) if spec.two_pass else None

    def before(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:  # after the backward pass, before the step
        if second is not None:
            second(m, x, y)
        if program.transform is not None:
            named = dict(m.named_parameters())
            grads = {n: named[n].grad for n in program.optimised_names() if named[n].grad is not None}
            with torch.no_grad():
                new = program.transform(grads, {n: named[n].detach() for n in grads}, program.refs)
            for n, g in new.items():
                named[n].grad = g
        step[0] += 1

    return train_local(model, split, spec, gen, loss=loss, params=params, before_step=before)
