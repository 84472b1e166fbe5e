"""The batched executor: many clients' declared programs trained at once with ``torch.func``.

Small models in FL simulation are overhead-bound: one client's step is a few tiny kernels.  This executor
stacks the parameters, buffers and optimiser state of the clients of one round along a leading client axis,
runs the forward pass with ``vmap(functional_call)`` and a single backward pass (the summed per-client losses
have per-client gradients, because clients share no parameters), and applies SGD/Adam to the stacked tensors.

Fidelity to the sequential executor:

- every client draws its batches from its own generator, in the same order, with the same permutations as
  ``train_local`` (:func:`fedfuse.engine.executor.job_generator`);
- ragged clients: a model whose samples do not interact within a batch (no BatchNorm in training mode, no
  term that couples the batch) is *masked*: batches are padded to the largest one, padded samples carry
  weight 0 in a per-client mean, and a client whose steps are over is frozen (its update is zeroed).
  Otherwise clients are *bucketed*: only clients with exactly the same batch-size schedule run together;
- BatchNorm running statistics and ``num_batches_tracked`` are per-client buffers updated in place;
- parameters outside the program's ``trainable`` set, and parameters that receive no gradient, are left
  untouched, as ``torch.optim`` leaves a parameter whose ``grad`` is ``None``;
- models with randomness in training (dropout with ``p > 0``) and groups ``vmap`` cannot run fall back to the
  sequential execution of the same program (same seeds), so results never depend on a failed batching.

Results agree with the sequential executor up to floating-point summation order (batched matrix products,
a different reduction order in the loss): ≤ 1e-4 relative on parameters after a few local epochs on the
conformance tests.  Within this executor, runs are deterministic and resume bit-identically.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.func import grad_and_value, vmap

from fedfuse.engine.client import TrainStats
from fedfuse.engine.contract import Algorithm, Job
from fedfuse.engine.executor import SequentialExecutor, job_generator, seed_global
from fedfuse.engine.program import ClientProgram, run_program, step_loss
from fedfuse.engine.sam import stacked_perturbation
from fedfuse.runtime.precision import train_autocast
from fedfuse.types import ClientData


def unbatchable_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot be trained batched with results equal to the sequential executor (or None)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return f"{name or type(m).__name__}: dropout draws from the global RNG per client"
        if isinstance(m, nn.RNNBase) and m.dropout > 0 and m.num_layers > 1:
            return f"{name}: recurrent dropout"
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None:
            return f"{name}: cumulative BatchNorm averaging reads num_batches_tracked as a number"
    return None


def batch_coupled(program: ClientProgram) -> bool:
    """Whether padding a batch would change the result: BatchNorm statistics or a term reading the whole batch."""
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in program.model.modules()):
        return True
    return any(t.couples_batch for t in program.terms)


def _code(fn: Any) -> Any:
    """A function's code (closures of one definition share it), else the object itself."""
    return getattr(fn, "__code__", fn)


def _signature(program: ClientProgram) -> tuple:
    """Programs with equal signatures can share one vmapped computation."""
    def shapes(d: dict[str, torch.Tensor]) -> tuple:
        return tuple((k, tuple(v.shape), v.dtype, str(v.device)) for k, v in d.items())

    terms = tuple((t.name, t.couples_batch, _code(t.fn)) for t in program.terms)
    train = None if program.train is None else (tuple(program.train.y.shape[1:]), program.train.y.dtype)
    return (id(program.model), program.spec, _code(program.loss), terms, program.features, _code(program.transform),
            program.trainable, shapes(program.init), shapes(program.refs), train)


class BatchedExecutor(SequentialExecutor):
    """Trains the clients of a declared program together (see the module docstring).

    ``max_group`` caps how many clients share one computation (memory); ``pad_waste`` bounds the padded
    steps a masked group may add, as a fraction of its real steps, before it is split by step count.
    """

    name = "batched"

    def __init__(self, clients: Sequence[ClientData], seed: int, *, max_group: int = 64,
                 pad_waste: float = 0.25) -> None:
        super().__init__(clients, seed)
        self.max_group = max_group
        self.pad_waste = pad_waste
        self.fallbacks: dict[str, int] = {}  # reason → clients run sequentially (for diagnostics and tests)

    # ---- the seam ------------------------------------------------------------------------------
    def fit(self, target: Algorithm, jobs: Sequence[Job]) -> dict[int, Any]:
        out: dict[int, Any] = {}
        pending: list[tuple[Job, ClientProgram]] = []
        for job in jobs:
            prog = target.client_program(job.payload, job.state, self.clients[job.cid])
            if prog is None:
                self._note("no declared client program")
                out[job.cid] = self.run_one(target.fit, job)
                continue
            reason = unbatchable_reason(prog.model)
            if reason is not None:
                self._note(reason)
                out[job.cid] = self._run_program(prog, job)
                continue
            pending.append((job, prog))
        for group in self.groups(pending):
            if len(group) == 1:  # nothing to batch with: the program alone is the same computation
                out[group[0][0].cid] = self._run_program(group[0][1], group[0][0])
                path, why = self.group_route(group[0][1])
                self.route_log.ran(path, 1, why)
                continue
            try:
                out.update(self.train_group(group))
            except (RuntimeError, NotImplementedError) as err:  # an op vmap cannot batch: same program, one by one
                reason = f"vmap failed: {str(err).splitlines()[0][:120]}"
                if reason not in self.fallbacks:
                    warnings.warn(f"batched executor: {reason}; running these clients sequentially", stacklevel=2)
                self._note(reason, len(group))
                for job, prog in group:
                    out[job.cid] = self._run_program(prog, job)
        return out

    def _note(self, reason: str, n: int = 1) -> None:
        """``n`` clients ran sequentially for ``reason``."""
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + n
        self.route_log.ran("sequential", n, reason)

    def _run_program(self, prog: ClientProgram, job: Job) -> Any:
        seed_global(self.seed, job)
        return run_program(prog, self.clients[job.cid], job_generator(self.seed, job))

    # ---- grouping ------------------------------------------------------------------------------
    def groups(self, pending: list[tuple[Job, ClientProgram]]) -> list[list[tuple[Job, ClientProgram]]]:
        """Clients with one signature; exact schedules for batch-coupled programs, else bounded padding."""
        by_sig: dict[tuple, list[tuple[Job, ClientProgram]]] = {}
        for item in pending:
            by_sig.setdefault(_signature(item[1]), []).append(item)
        groups: list[list[tuple[Job, ClientProgram]]] = []
        for items in by_sig.values():
            if batch_coupled(items[0][1]):
                exact: dict[tuple[int, ...], list] = {}
                for job, prog in items:
                    sched = tuple(prog.spec.schedule(len(self.clients[job.cid].train)))
                    exact.setdefault(sched, []).append((job, prog))
                buckets = list(exact.values())
            else:
                buckets = self._padded_buckets(items)
            for b in buckets:
                groups += [b[i : i + self.max_group] for i in range(0, len(b), self.max_group)]
        return groups

    def _padded_buckets(self, items: list[tuple[Job, ClientProgram]]) -> list[list[tuple[Job, ClientProgram]]]:
        steps = {job.cid: len(prog.spec.schedule(len(self.clients[job.cid].train))) for job, prog in items}
        order = sorted(items, key=lambda it: (-steps[it[0].cid], it[0].cid))
        buckets: list[list[tuple[Job, ClientProgram]]] = []
        real = 0
        for item in order:
            s = steps[item[0].cid]
            if buckets:
                top = steps[buckets[-1][0][0].cid]
                if (len(buckets[-1]) + 1) * top <= (1 + self.pad_waste) * (real + s):
                    buckets[-1].append(item)
                    real += s
                    continue
            buckets.append([item])
            real = s
        return buckets

    # ---- one vmapped group -----------------------------------------------------------------------
    def train_group(self, group: list[tuple[Job, ClientProgram]]) -> dict[int, Any]:
        """Train every client of ``group`` together; returns each client's finalised reply."""
        progs = [p for _, p in group]
        p0 = progs[0]
        p0.check()
        model, spec = p0.model, p0.spec
        datas = [prog.train_split(self.clients[job.cid]) for job, prog in group]
        scheds = [spec.schedule(len(d)) for d in datas]
        C, T = len(group), max(len(s) for s in scheds)
        exact = all(s == scheds[0] for s in scheds)
        x_all = torch.cat([d.x for d in datas]) if C > 1 else datas[0].x
        y_all = torch.cat([d.y for d in datas]) if C > 1 else datas[0].y
        device = x_all.device
        idx, mask, gens = self._batches(group, scheds, T)
        idx, mask = idx.to(device), mask.to(device)
        counts = mask.sum(-1)  # (C, T) real samples per step
        stacked = _Stacked(progs)
        step = self.group_step(p0, stacked.base, exact)
        opt = _StackedOptimizer(spec, [stacked.P[n] for n in step.opt_names])
        acc_dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        loss_acc = torch.zeros(C, dtype=acc_dtype, device=device)
        steps_of = torch.tensor([len(s) for s in scheds], device=device)
        was_training = model.training
        model.train()
        try:
            for t in range(T):
                sel, m = (idx[:, t, : scheds[0][t]], None) if exact else (idx[:, t], mask[:, t])
                grads, task = step.grads(stacked, _rows(x_all, sel), _rows(y_all, sel), m, t)
                opt.step(grads, None if exact else (t < steps_of))
                loss_acc += task.detach().to(acc_dtype) * counts[:, t].to(acc_dtype)
        finally:
            model.train(was_training)
        path, why = self.group_route(p0)
        self.route_log.ran(path, C, why)
        keys = [k for k in model.state_dict() if k in p0.init]
        losses = loss_acc.tolist()
        out: dict[int, Any] = {}
        for i, (job, prog) in enumerate(group):
            state = {k: (stacked.P[k] if k in stacked.P else stacked.B[k])[i].detach().clone() for k in keys}
            stats = TrainStats(steps=len(scheds[i]), samples=int(sum(scheds[i])), loss_sum=losses[i],
                               generator=gens[i])
            out[job.cid] = prog.finalize(state, stats)
        return out

    def group_route(self, program: ClientProgram) -> tuple[str, str | None]:
        """The path a group of ``program`` trains on, and why it is not this executor's own (``None``: it is)."""
        return "batched", None

    def group_step(self, program: ClientProgram, base: dict[str, torch.Tensor], exact: bool) -> _GroupStep:
        """The gradient computation of one group (the stacked executor overrides it for linear models)."""
        return _GroupStep(program, base, exact)

    def _batches(self, group: list[tuple[Job, ClientProgram]], scheds: list[list[int]],
                 T: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Generator]]:
        """Global sample indices (C, T, B) and masks, drawn exactly as ``train_local`` draws them, and each
        client's generator in the state training leaves it in (for a finalize that draws more)."""
        C = len(group)
        B = max((max(s) for s in scheds if s), default=1)
        idx = torch.zeros(C, T, B, dtype=torch.long)
        mask = torch.zeros(C, T, B)
        offset = 0
        gens = []
        for i, (job, prog) in enumerate(group):
            n = len(self.clients[job.cid].train)
            steps = len(scheds[i])
            gen = job_generator(self.seed, job)
            gens.append(gen)
            if steps:
                bs = min(prog.spec.batch_size, n)
                per_epoch = math.ceil(n / bs)
                rows, t = [], 0
                while t < steps:
                    perm = torch.randperm(n, generator=gen)
                    pad = torch.full((per_epoch * bs - n,), -1, dtype=torch.long)
                    rows.append(torch.cat([perm, pad]).view(per_epoch, bs))
                    t += per_epoch
                table = torch.cat(rows)[:steps]
                valid = table >= 0
                idx[i, :steps, :bs] = torch.where(valid, table + offset, torch.full_like(table, offset))
                mask[i, :steps, :bs] = valid.float()
            offset += n
        return idx, mask, gens


def _rows(data: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """``data[sel]`` for an index tensor ``sel`` into the first axis, as one ``index_select`` (the same values;
    ~2× faster on a CPU than advanced indexing for a step's gather)."""
    return data.index_select(0, sel.reshape(-1)).view(*sel.shape, *data.shape[1:])


class _Stacked:
    """A group's per-client tensors stacked along a leading client axis: parameters ``P`` (the optimised ones
    require grad), buffers ``B``, constants ``R``; ``base``: the template's entries outside ``init`` (one frozen
    copy shared by every client)."""

    def __init__(self, progs: list[ClientProgram]) -> None:
        p0 = progs[0]
        model = p0.model
        self.P = {n: torch.stack([p.init[n] for p in progs]).detach()  # stack copies
                  for n, _ in model.named_parameters() if n in p0.init}
        self.B = {n: torch.stack([p.init[n] for p in progs]).detach()
                  for n, _ in model.named_buffers() if n in p0.init}
        self.R = {k: torch.stack([p.refs[k] for p in progs]).detach() for k in p0.refs}
        self.base = {n: t.detach() for n, t in (*model.named_parameters(), *model.named_buffers())
                     if n not in p0.init}
        for n in p0.optimised_names():
            self.P[n].requires_grad_(True)


class _GroupStep:
    """The gradients of one optimiser step for every client of a group: :func:`step_loss` vmapped over the
    clients, a SAM second pass and the program's gradient transform (vmapped too)."""

    def __init__(self, program: ClientProgram, base: dict[str, torch.Tensor], exact: bool) -> None:
        self.program, self.base, self.spec = program, base, program.spec
        self.opt_names = program.optimised_names()
        self.dims = (0, 0, 0, 0, 0, None if exact else 0, None)  # params, buffers, refs, x, y, mask, step
        self.batched = vmap(self.loss, in_dims=self.dims, randomness="error")
        # Without BatchNorm (no buffer written during the forward pass) the gradients are taken inside the
        # vmapped function (``vmap(grad)``): one fused per-client backward instead of autograd through the
        # batching rules, ~20 % less CPU per step on the MLP.  Which parameters get a gradient is learnt on
        # the first step (a parameter without one stays untouched, as in ``torch.optim``).
        self.writes_buffers = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in program.model.modules())
        self.fused: tuple[list[str], Any] | None = None
        transform = program.transform
        self.transform = None if transform is None else vmap(transform, randomness="error")

    def loss(self, params: dict, buffers: dict, refs: dict, x: torch.Tensor, y: torch.Tensor,
             m: torch.Tensor | None, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        with train_autocast(x.device):  # the run's precision (fedfuse.runtime.precision); no-op at fp32
            return step_loss(self.program, params, buffers, refs, x, y, m, t, frozen=self.base)

    def split_loss(self, opt_params: dict, fixed: dict, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loss({**fixed, **opt_params}, *rest)

    def first_pass(self, P: dict, B: dict, R: dict, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor | None,
                   t: int) -> tuple[tuple, torch.Tensor]:
        if self.fused is None:
            total, task = self.batched(P, B, R, x, y, m, t)
            grads = torch.autograd.grad(total.sum(), [P[n] for n in self.opt_names], allow_unused=True)
            if not self.writes_buffers and self.opt_names:
                used = [n for n, g in zip(self.opt_names, grads, strict=True) if g is not None]
                self.fused = (used, vmap(grad_and_value(self.split_loss, has_aux=True), in_dims=(0, *self.dims),
                                         randomness="error"))
            return grads, task
        used, fn = self.fused
        with torch.no_grad():
            fixed = {n: v for n, v in P.items() if n not in used}
        g, (_, task) = fn({n: P[n] for n in used}, fixed, B, R, x, y, m, t)
        return tuple(g.get(n) for n in self.opt_names), task

    def grads(self, s: _Stacked, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor | None,
              t: int) -> tuple[list[torch.Tensor | None], torch.Tensor]:
        grads, task = self.first_pass(s.P, s.B, s.R, x, y, m, t)
        if self.spec.two_pass:  # SAM/ASAM: the step uses the gradient at w + ε (fedfuse.engine.sam)
            grads = self.second_pass(s, x, y, m, t, grads)
        if self.transform is not None:  # per client, after SAM's second pass and before clipping
            present = {n: g for n, g in zip(self.opt_names, grads, strict=True) if g is not None}
            with torch.no_grad():
                new = self.transform(present, {n: s.P[n].detach() for n in present}, s.R)
            grads = tuple(new.get(n, g) if g is not None else None for n, g in zip(self.opt_names, grads, strict=True))
        return list(grads), task

    def second_pass(self, s: _Stacked, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor | None, t: int,
                    grads: tuple) -> tuple:
        """Gradients at w + ε for every client (ε per client, as :func:`fedfuse.engine.sam.sam_step`); BN
        buffers written by the perturbed pass are restored, so statistics come from the first pass."""
        spec, names, P = self.spec, self.opt_names, s.P
        eps = stacked_perturbation(names, P, dict(zip(names, grads, strict=True)), spec.sam_rho,
                                   spec.two_pass == "asam", spec.sam_eta)
        if self.fused is not None:
            used, fn = self.fused
            with torch.no_grad():
                moved = {n: P[n] + eps[n] if n in eps else P[n] for n in used}
                fixed = {n: v for n, v in P.items() if n not in used}
            g, _ = fn(moved, fixed, s.B, s.R, x, y, m, t)
            return tuple(g.get(n) for n in names)
        saved = {n: b.clone() for n, b in s.B.items()}
        moved = dict(P)
        for n in names:
            moved[n] = (P[n].detach() + eps[n] if n in eps else P[n].detach()).requires_grad_(True)
        total, _ = self.batched(moved, s.B, s.R, x, y, m, t)
        out = torch.autograd.grad(total.sum(), [moved[n] for n in names], allow_unused=True)
        with torch.no_grad():
            for n, b in s.B.items():
                b.copy_(saved[n])
        return out


class _StackedOptimizer:
    """``torch.optim.SGD``/``Adam`` semantics (no dampening, no Nesterov, no AMSGrad) on client-stacked
    parameters; ``active`` (C,) freezes clients whose steps are over; gradients are clipped per client."""

    def __init__(self, spec: Any, params: list[torch.Tensor]) -> None:
        if spec.optimizer not in ("sgd", "adam"):
            raise ValueError(f"unknown optimizer {spec.optimizer!r}; choose sgd or adam")
        self.spec = spec
        self.params = params
        self.state: list[dict[str, torch.Tensor]] = [{} for _ in params]
        self.t = 0

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor | None], active: torch.Tensor | None) -> None:
        spec = self.spec
        self.t += 1
        if spec.grad_clip > 0:
            present = [g for g in grads if g is not None]
            if present:
                C = present[0].shape[0]
                norms = torch.stack([g.reshape(C, -1).norm(2, dim=1) for g in present], dim=1).norm(2, dim=1)
                coef = (spec.grad_clip / (norms + 1e-6)).clamp(max=1.0)
                grads = [None if g is None else g * coef.view(-1, *([1] * (g.dim() - 1))) for g in grads]
        if spec.optimizer == "sgd" and not spec.momentum and not spec.weight_decay and active is None:
            pairs = [(p, g) for p, g in zip(self.params, grads, strict=True) if g is not None]
            if pairs:  # plain SGD: one fused in-place update per tensor, no temporaries
                torch._foreach_add_([p for p, _ in pairs], [g for _, g in pairs], alpha=-spec.lr)
            return
        for p, g, st in zip(self.params, grads, self.state, strict=True):
            if g is None:
                continue
            if spec.weight_decay:
                g = g.add(p, alpha=spec.weight_decay)
            if spec.optimizer == "sgd":
                if spec.momentum:
                    if "buf" not in st:
                        st["buf"] = g.clone()
                    else:
                        st["buf"].mul_(spec.momentum).add_(g)
                    g = st["buf"]
                upd = g * spec.lr
            else:
                b1, b2, eps = 0.9, 0.999, 1e-8
                if "m" not in st:
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                st["m"].lerp_(g, 1 - b1)
                st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                bc1 = 1 - b1 ** self.t
                bc2 = 1 - b2 ** self.t
                denom = (st["v"].sqrt() / math.sqrt(bc2)).add_(eps)
                upd = st["m"] / denom * (spec.lr / bc1)
            if active is not None:
                upd = upd * active.view(-1, *([1] * (upd.dim() - 1))).to(upd.dtype)
            p.sub_(upd)
