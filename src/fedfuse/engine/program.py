"""Declared client programs: a client step described as data and pure functions.

An algorithm that declares its client step as a :class:`ClientProgram` hands the *training loop* to the
executor: the sequential executor runs it on a stateful module (bit-identical to
:func:`fedfuse.engine.client.train_local`), the batched executor trains many clients at once with
``torch.func.functional_call`` + ``vmap``, and the process executor runs it in worker processes.

A program says

- where training starts: the architecture ``model`` (a template; its own values are never read) and the
  full starting state ``init`` (parameters and buffers, e.g. the received global model).  With
  ``shared_base=True`` the template's values of every key outside ``init`` *are* read: they are a frozen base
  shared by all clients (LoRA's base model), ``init`` holds only the per-client tensors (the adapter), and
  only those are loaded, stacked per client by the batched executor and handed to ``finalize``;
- the local settings ``spec`` (:class:`~fedfuse.engine.client.TrainConfig`, the run's type): epochs, batch size,
  optimiser, learning rate, clipping, step cap, two-pass (SAM) steps;
- the loss: the task loss (cross-entropy) plus declared :class:`LossTerm` s, pure functions of the functional
  parameters, buffers, per-client reference tensors ``refs`` (e.g. FedProx's anchor) and the batch;
- which parameters are optimised (``trainable``; ``None`` = every parameter with ``requires_grad``);
- per-step constants (``step_refs``: tensors whose leading dimension is the optimiser step; at step t the
  terms read ``refs[k] = step_refs[k][t]``): random draws a term consumes step by step, drawn up front in the
  order a loop would draw them (FedGen's generator noise and labels), so every executor sees the same draws;
- which output classes take part in training (``logit_mask``: the logits of the other classes are set to 0
  before the loss, HeteroFL's masked cross-entropy; evaluation is unmasked);
- what the loss is: cross-entropy on the client's labels unless the program declares an ``objective``, a
  per-sample loss of the logits and per-sample ``targets`` that replace the labels (FedEM: M learners'
  cross-entropies weighted by the E-step's responsibilities, carried as extra target columns);
- which gradient entries may move (``grad_masks``: 0/1 tensors per parameter multiplied into the gradient
  before clipping and the step, Dis-PFL's sparse training);
- how the client finalises its reply from the trained state and the training statistics (``finalize``;
  with ``finalize_rng`` it also receives the client's generator after training drew its batches from it,
  for post-training draws such as Dis-PFL's gradient-screening batch).

Executors never import algorithms: they call ``client_program(payload, client_state, data)`` of the
:class:`fedfuse.engine.contract.Algorithm` they are handed; it returns ``None`` when the client step is not
declared, and the executor then calls the algorithm's opaque ``fit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedfuse.engine.client import TrainConfig, TrainStats, task_loss, train_local
from fedfuse.engine.sam import sam_step
from fedfuse.types import ClientData, Message, Split, TensorDict

#: ``fn(params, buffers, refs, x, y, logits) -> Tensor``: a scalar, or per-sample values ``(B,)`` when the
#: term is declared ``per_sample``.  ``params``/``buffers`` are the functional state of the model being
#: trained (name → tensor), ``refs`` the program's per-client constant tensors.
TermFn = Callable[[TensorDict, TensorDict, TensorDict, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: ``objective(logits, targets) -> (B,)``: a per-sample training loss that replaces the cross-entropy.
Objective = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: ``finalize(trained_state, stats) -> (reply, new_client_state)``; with ``ClientProgram.finalize_rng`` it is
#: called as ``finalize(trained_state, stats, generator)``.
Finalize = Callable[..., tuple[Message, Any]]


@dataclass(frozen=True)
class LossTerm:
    """A declared addition to the task loss.

    ``per_sample``: ``fn`` returns one value per sample and the executor averages over the real samples of
    the batch (safe with padded batches).  ``uses_batch=False`` declares that a scalar ``fn`` reads only
    params/buffers/refs (a proximal term), so batches padded for batching cannot change it.  A scalar term
    that reads the batch forces exact batching (no padding) in the batched executor.
    """

    name: str
    fn: TermFn
    per_sample: bool = False
    uses_batch: bool = True


@dataclass
class ClientProgram:
    """One client's declared step; see the module docstring."""

    model: nn.Module
    init: TensorDict
    spec: TrainConfig
    finalize: Finalize
    terms: tuple[LossTerm, ...] = ()
    refs: TensorDict = field(default_factory=dict)
    trainable: frozenset[str] | None = None
    logit_mask: torch.Tensor | None = None  # bool (num_classes,): False = logit set to 0 in training
    grad_masks: TensorDict | None = None  # parameter name → 0/1 tensor of its shape multiplied into the gradient
    finalize_rng: bool = False  # finalize(state, stats, generator): the generator continues after training
    objective: Objective | None = None  # per-sample loss (logits, targets) -> (B,) replacing the cross-entropy
    targets: torch.Tensor | None = None  # per-sample training targets (n, ...) replacing data.train.y
    step_refs: TensorDict = field(default_factory=dict)  # name → (steps, ...): refs[name] = step_refs[name][t]
    shared_base: bool = False  # the template's values outside ``init`` are a frozen base shared by all clients

    def check_shared_base(self) -> None:
        """With ``shared_base``, everything the optimiser moves must be per-client (in ``init``)."""
        if self.shared_base:
            outside = [n for n in self.optimised_names() if n not in self.init]
            if outside:
                raise ValueError(f"shared_base: optimised parameters outside init: {outside[:3]}")

    def train_split(self, data: ClientData) -> Split:
        """The samples the program trains on: the client's inputs with ``targets`` when declared."""
        if self.targets is None:
            return data.train
        if len(self.targets) != len(data.train):
            raise ValueError(f"targets has {len(self.targets)} rows for {len(data.train)} training samples")
        return Split(data.train.x, self.targets.to(data.train.x.device))

    def finish(self, state: TensorDict, stats: TrainStats, gen: torch.Generator) -> tuple[Message, Any]:
        """Call ``finalize`` (with ``gen`` when the program asks for it)."""
        return self.finalize(state, stats, gen) if self.finalize_rng else self.finalize(state, stats)

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with the classes outside ``logit_mask`` set to 0 (unchanged without a mask)."""
        return logits if self.logit_mask is None else logits.masked_fill(~self.logit_mask, 0.0)

    def optimised_names(self) -> list[str]:
        """Parameter names the optimiser updates, in ``named_parameters`` order."""
        return [n for n, p in self.model.named_parameters()
                if p.requires_grad and (self.trainable is None or n in self.trainable)]

    def with_spec(self, **changes: Any) -> ClientProgram:
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, **changes))


def term_values(
    terms: tuple[LossTerm, ...], params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
    refs: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The sum of the declared terms on one batch (``mask`` weights per-sample terms; ``None`` = all real)."""
    total: torch.Tensor | None = None
    for t in terms:
        v = t.fn(dict(params), dict(buffers), dict(refs), x, y, logits)
        if t.per_sample:
            v = v.mean() if mask is None else (v * mask).sum() / mask.sum().clamp_min(1)
        total = v if total is None else total + v
    return total


def run_program(program: ClientProgram, data: ClientData, gen: torch.Generator) -> tuple[Message, Any]:
    """The reference execution: load ``init`` into the module and train it with ``train_local``.

    Gives exactly today's sequential results (same batches, same operations, same optimiser).  During training
    the logit mask is a forward hook and the frozen set (parameters outside ``trainable``) has
    ``requires_grad`` off, so autograd computes no gradient for it; both are undone before ``finalize`` runs,
    so the finalize sees the template as the batched executor leaves it.
    """
    model = program.model
    program.check_shared_base()
    loaded = model.load_state_dict(program.init, strict=not program.shared_base)
    if program.shared_base and loaded.unexpected_keys:
        raise KeyError(f"init keys the model does not have: {loaded.unexpected_keys[:3]}")
    undo = []
    if program.logit_mask is not None:  # training-mode forward passes see masked logits (loss, terms, SAM)
        undo.append(model.register_forward_hook(lambda m, i, o: program.masked(o) if m.training else o).remove)
    params = None
    if program.trainable is not None:
        named = dict(model.named_parameters())
        params = [named[n] for n in program.optimised_names()]
        frozen = [p for n, p in named.items() if n not in program.trainable and p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        undo.append(lambda: [p.requires_grad_(True) for p in frozen])
    try:
        stats = _train(program, model, data, gen, params)
    finally:
        for fn in reversed(undo):
            fn()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()
             if not program.shared_base or k in program.init}
    return program.finish(state, stats, gen)


def _train(program: ClientProgram, model: nn.Module, data: ClientData, gen: torch.Generator,
           params: list[torch.nn.Parameter] | None) -> TrainStats:
    extra = None
    step = [0]  # the optimiser step the terms are computing for (indexes ``step_refs``)
    if program.terms:
        terms, refs, per_step = program.terms, program.refs, program.step_refs

        def extra(m: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            now = {**refs, **{k: v[step[0]] for k, v in per_step.items()}} if per_step else refs
            out = term_values(terms, dict(m.named_parameters()), dict(m.named_buffers()), now, x, y, logits)
            assert out is not None
            return out

    objective = program.objective
    task = None if objective is None else (lambda logits, y: objective(logits, y).mean())
    before: Any = None
    spec = program.spec
    if spec.two_pass:
        def full_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = m(x)
            loss = task_loss(logits, y) if task is None else task(logits, y)
            return loss if extra is None else loss + extra(m, x, y, logits)

        before = sam_step(model, spec.sam_rho, spec.two_pass == "asam", spec.sam_eta, loss=full_loss,
                          names=program.optimised_names())
    if program.grad_masks:
        masks, second = program.grad_masks, before
        named = dict(model.named_parameters())

        def before(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:  # after SAM's second pass, if any
            if second is not None:
                second(m, x, y)
            for k, mk in masks.items():
                g = named[k].grad
                if g is not None:
                    g.mul_(mk.to(g.device, g.dtype))

    if program.step_refs:  # after any second pass and the gradient masks: the step is over, advance
        inner = before

        def before(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
            if inner is not None:
                inner(m, x, y)
            step[0] += 1

    return train_local(model, program.train_split(data), spec, gen, extra_loss=extra, params=params,
                       before_step=before, task=task)
