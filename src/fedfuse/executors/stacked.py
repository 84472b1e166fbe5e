"""The stacked executor: clients of a linear model trained as batched matrix products.

For a model built from linear layers (:class:`~fedfuse.models.mlp.MLP`), the clients of one group keep their
weights stacked along a leading client axis, ``W`` (C, out, in), and every layer of every client is one
``baddbmm`` over the stacked batches ``x`` (C, B, in).  A step is then: one stacked forward pass, the program's
loss per client, **one** autograd call for all clients (the summed per-client losses: clients share no
parameters, so each gets its own gradient) and the stacked optimiser update of the batched executor
(:class:`~fedfuse.executors.batched._StackedOptimizer`).  No per-client Python runs inside a step, and the model is
never called through ``functional_call`` or ``vmap``: what remains of the batched executor's per-step overhead
is the loss.

Layers run feature-major: a layer maps (C, in, B) to (C, out, B) as ``baddbmm(bias, W, hᵀ)``, so the weight is
the left factor and autograd returns its gradient contiguous (a gradient returned as the transpose of a
contiguous tensor made the stacked optimiser update 3-4× slower).

One step function still serves every executor.  The forward pass is the only part written here (per model
class, :data:`STACKED_FORWARDS`); the loss and the declared terms are :func:`fedfuse.engine.program.batch_loss`,
the part of :func:`~fedfuse.engine.program.step_loss` after the forward pass, ``vmap``-ped over the clients on
the stacked logits (and features, when the program declares ``features=True``).  The default loss without
terms (:func:`~fedfuse.engine.program.cross_entropy`) is computed on the stacked logits directly
(:func:`stacked_cross_entropy`: the same per-client mean over the real samples), which saves that ``vmap``.
Batching, padding masks, frozen clients, SAM/ASAM second passes, gradient transforms, clipping and the
optimiser are the batched executor's, unchanged.  A program this executor cannot stack runs on the batched
executor's ``vmap`` step; the reason is counted in :attr:`StackedExecutor.routes`:

- a model class without a stacked forward (convolutions, recurrent layers, attention, norms: ``vmap``);
- a model with module hooks or parametrizations (a stacked forward would skip them; HeteroFL's Scaler);
- tied parameters.

Results agree with the sequential executor up to floating-point summation order, as the batched executor's do
(``tests/executors/test_stacked.py``).  The stacked and the batched executors are separate names: the golden records pin
the batched executor's bits, and the stacked products round differently (docs/engine.md discusses the choice).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap
from torch.nn.utils import parametrize

from fedfuse.engine.client import task_loss
from fedfuse.engine.program import Batch, ClientProgram, batch_loss, cross_entropy
from fedfuse.engine.sam import stacked_perturbation
from fedfuse.executors.batched import BatchedExecutor, _GroupStep, _Stacked
from fedfuse.models.mlp import MLP
from fedfuse.runtime.precision import train_autocast
from fedfuse.types import ClientData

#: ``forward(model, weight, x) -> (features, logits)`` on client-stacked inputs ``x`` (C, B, ...), outputs (C, B, ...):
#: ``weight(name)`` is the (C, ...) stacked tensor of the model's parameter ``name``.
StackedForward = Callable[[nn.Module, Callable[[str], torch.Tensor], torch.Tensor],
                          tuple[torch.Tensor, torch.Tensor]]


def stacked_linear(ht: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` per client, feature-major: ``ht`` (C, in, B), ``weight`` (C, out, in), ``bias`` (C, out) →
    (C, out, B).  In this layout the weight is the left factor, so autograd returns its gradient contiguous
    (the optimiser then updates with unit strides), and each layer's output is the next layer's input as is."""
    if bias is None:
        return torch.bmm(weight, ht)
    return torch.baddbmm(bias.unsqueeze(2), weight, ht)


def _mlp(model: nn.Module, weight: Callable[[str], torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`MLP`'s ``features_and_logits``, stacked: flatten, [linear → ReLU] per hidden layer, head."""
    assert isinstance(model, MLP)
    ht = x.reshape(x.shape[0], x.shape[1], -1).transpose(1, 2)  # (C, in, B): a view, no copy
    for i, lin in enumerate(model.hidden):
        ht = F.relu(stacked_linear(ht, weight(f"hidden.{i}.weight"),
                                   None if lin.bias is None else weight(f"hidden.{i}.bias")))
    logits = stacked_linear(ht, weight("fc.weight"), None if model.fc.bias is None else weight("fc.bias"))
    return ht.transpose(1, 2), logits.transpose(1, 2)


def stacked_cross_entropy(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Every client's :meth:`~fedfuse.engine.program.Batch.cross_entropy` (C,) from stacked ``logits``
    (C, B, K) and labels ``y`` (C, B): the mean of the per-sample losses over the real samples (``mask``)."""
    C, B = y.shape[0], y.shape[1]
    per = task_loss(logits.reshape(C * B, -1), y.reshape(-1), reduction="none").view(C, B)
    if mask is None:
        return per.mean(1)
    return (per * mask).sum(1) / mask.sum(1).clamp_min(1)


#: Model classes (exact types: a subclass may change the forward pass) with a stacked forward pass.
STACKED_FORWARDS: dict[type[nn.Module], StackedForward] = {MLP: _mlp}


def stacked_reason(program: ClientProgram) -> str | None:
    """Why ``program``'s clients cannot be trained stacked (``None``: they can)."""
    model = program.model
    if type(model) not in STACKED_FORWARDS:
        return f"{type(model).__name__}: no stacked forward pass"
    if program.tied:
        return "tied parameters"
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return f"{name or type(m).__name__}: module hooks"
        if parametrize.is_parametrized(m):
            return f"{name or type(m).__name__}: parametrized"
    g = nn.modules.module
    if g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks:
        return "global module hooks"
    return None


class _StackedStep(_GroupStep):
    """The gradients of one step for every client of a group from the stacked forward pass (see the module
    docstring); the SAM second pass and the gradient transform are the batched step's."""

    def __init__(self, program: ClientProgram, base: dict[str, torch.Tensor], exact: bool) -> None:
        super().__init__(program, base, exact)
        self.stacked_forward = STACKED_FORWARDS[type(program.model)]
        in_dims = (0, 0 if program.features else None, 0, 0, 0, 0, 0, None if exact else 0, None)
        self.client_loss = vmap(self._client_loss, in_dims=in_dims, randomness="error")
        # The default loss without terms is the per-client mean cross-entropy: computed on the stacked logits
        # directly (``Batch.cross_entropy``'s arithmetic), which saves the ``vmap`` of the loss.
        self.direct = program.loss is cross_entropy and not program.terms

    def _client_loss(self, logits: torch.Tensor, z: torch.Tensor | None, params: dict, buffers: dict, refs: dict,
                     x: torch.Tensor, y: torch.Tensor, m: torch.Tensor | None,
                     t: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch_loss(self.program, Batch(x, y, logits, z, params, buffers, refs, t, m))

    def stacked_loss(self, P: Mapping[str, torch.Tensor], B: dict, R: dict, x: torch.Tensor, y: torch.Tensor,
                     m: torch.Tensor | None, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(minimised, reported)`` per client (C,) at the stacked parameters ``P``."""
        C = x.shape[0]

        def weight(name: str) -> torch.Tensor:
            if name in P:
                return P[name]
            w = self.base[name]  # a frozen base entry outside init: one copy shared by every client
            return w.expand(C, *w.shape)

        with train_autocast(x.device):  # the run's precision (fedfuse.runtime.precision); no-op at fp32
            z, logits = self.stacked_forward(self.program.model, weight, x)
            if self.direct:
                loss = stacked_cross_entropy(logits, y, m)
                return loss, loss
            return self.client_loss(logits, z if self.program.features else None, dict(P), B, R, x, y, m, t)

    def first_pass(self, P: dict, B: dict, R: dict, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor | None,
                   t: int) -> tuple[tuple, torch.Tensor]:
        total, task = self.stacked_loss(P, B, R, x, y, m, t)
        grads = torch.autograd.grad(total.sum(), [P[n] for n in self.opt_names], allow_unused=True)
        return grads, task.detach()

    def second_pass(self, s: _Stacked, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor | None, t: int,
                    grads: tuple) -> tuple:
        """Gradients at w + ε for every client (ε per client, :func:`~fedfuse.engine.sam.stacked_perturbation`)."""
        spec, names, P = self.spec, self.opt_names, s.P
        eps = stacked_perturbation(names, P, dict(zip(names, grads, strict=True)), spec.sam_rho,
                                   spec.two_pass == "asam", spec.sam_eta)
        moved = dict(P)
        for n in names:
            moved[n] = (P[n].detach() + eps[n] if n in eps else P[n].detach()).requires_grad_(True)
        total, _ = self.stacked_loss(moved, s.B, s.R, x, y, m, t)
        return torch.autograd.grad(total.sum(), [moved[n] for n in names], allow_unused=True)


class StackedExecutor(BatchedExecutor):
    """The batched executor with stacked client steps for linear models (see the module docstring); every other
    program runs as under :class:`~fedfuse.executors.batched.BatchedExecutor`."""

    name = "stacked"

    def __init__(self, clients: Sequence[ClientData], seed: int, **kwargs: int | float) -> None:
        super().__init__(clients, seed, **kwargs)  # type: ignore[arg-type]
        self.routes: dict[str, int] = {}  # "stacked" or "vmap: <reason>" → groups (for diagnostics and tests)

    def group_route(self, program: ClientProgram) -> tuple[str, str | None]:
        reason = stacked_reason(program)
        return ("stacked", None) if reason is None else ("batched", reason)

    def group_step(self, program: ClientProgram, base: dict[str, torch.Tensor], exact: bool) -> _GroupStep:
        _, reason = self.group_route(program)
        route = "stacked" if reason is None else f"vmap: {reason}"
        self.routes[route] = self.routes.get(route, 0) + 1
        if reason is not None:
            return super().group_step(program, base, exact)
        return _StackedStep(program, base, exact)
