"""The batched executor: many clients' declared programs trained at once with ``torch.func``.

Small models in FL simulation are overhead-bound: one client's step is a few tiny kernels.  This executor
stacks the parameters, buffers and optimiser state of the clients of one round along a leading client axis,
runs the forward pass with ``vmap(functional_call)`` and a single backward pass (the summed per-client losses
have per-client gradients, because clients share no parameters), and applies SGD/Adam to the stacked tensors.

Fidelity to the sequential executor:

- every client draws its batches from its own generator, in the same order, with the same permutations as
  ``train_local`` (:func:`fedfuse.engine.executor.job_generator`);
- ragged clients: a model whose samples do not interact within a batch (no BatchNorm in training mode, no
  batch-reading scalar loss term) is *masked*: batches are padded to the largest one, padded samples carry
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
from torch.func import functional_call, grad_and_value, vmap

from fedfuse.engine.client import TrainStats, task_loss
from fedfuse.engine.contract import Algorithm, Job
from fedfuse.engine.executor import SequentialExecutor, job_generator, seed_global
from fedfuse.engine.program import ClientProgram, run_program, term_values
from fedfuse.engine.sam import stacked_perturbation
from fedfuse.types import ClientData

_LOGIT_MASK = "\0logit_mask"  # the key of ClientProgram.logit_mask among a group's stacked references


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
    """Whether padding a batch would change the result: BatchNorm statistics or a batch-reading scalar term."""
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in program.model.modules()):
        return True
    return any(t.uses_batch and not t.per_sample for t in program.terms)


def _signature(program: ClientProgram) -> tuple:
    """Programs with equal signatures can share one vmapped computation."""
    terms = tuple((t.name, t.per_sample, t.uses_batch, getattr(t.fn, "__code__", t.fn)) for t in program.terms)

    def shapes(d: dict[str, torch.Tensor]) -> tuple:
        return tuple((k, tuple(v.shape), v.dtype, str(v.device)) for k, v in d.items())

    mask = None if program.logit_mask is None else tuple(program.logit_mask.shape)
    objective = None if program.objective is None else getattr(program.objective, "__code__", program.objective)
    targets = None if program.targets is None else (tuple(program.targets.shape[1:]), program.targets.dtype)
    per_step = tuple((k, tuple(v.shape[1:]), v.dtype, str(v.device)) for k, v in program.step_refs.items())
    return (id(program.model), program.spec, terms, program.trainable, shapes(program.init), shapes(program.refs),
            mask, shapes(program.grad_masks or {}), objective, targets, per_step, program.shared_base)


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
            if len(group) == 1:
                out[group[0][0].cid] = self._run_program(group[0][1], group[0][0])
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
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + n

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
        sizes = scheds[0]

        p0.check_shared_base()
        param_names = [n for n, _ in model.named_parameters() if not p0.shared_base or n in p0.init]
        buffer_names = [n for n, _ in model.named_buffers() if n in p0.init]
        # a shared frozen base (LoRA): the template's own tensors, one copy for every client (not vmapped)
        base = {n: t.detach() for n, t in (*model.named_parameters(), *model.named_buffers())
                if p0.shared_base and n not in p0.init}
        opt_names = p0.optimised_names()
        P = {n: torch.stack([p.init[n] for p in progs]).detach().clone() for n in param_names}
        Bf = {n: torch.stack([p.init[n] for p in progs]).detach().clone() for n in buffer_names}
        R = {k: torch.stack([p.refs[k] for p in progs]).detach() for k in p0.refs}
        G = {k: torch.stack([p.grad_masks[k] for p in progs]).to(device) for k in (p0.grad_masks or {})}
        S = {k: torch.stack([_pad_steps(p.step_refs[k], T) for p in progs]).to(device) for k in p0.step_refs}
        if p0.logit_mask is not None:  # one mask per client, batched with the references
            R[_LOGIT_MASK] = torch.stack([p.logit_mask for p in progs]).to(device)
        for n in opt_names:
            P[n].requires_grad_(True)
        terms, objective = p0.terms, p0.objective
        tied = len(list(model.named_parameters(remove_duplicate=False))) != len(list(model.named_parameters()))

        def loss_fn(params, buffers, refs, x, y, m):
            logits = functional_call(model, {**base, **params, **buffers}, (x,), strict=False, tie_weights=tied)
            if _LOGIT_MASK in refs:
                refs = dict(refs)
                logits = logits.masked_fill(~refs.pop(_LOGIT_MASK), 0.0)
            if objective is not None:
                per = objective(logits, y)
                task = per.mean() if m is None else (per * m).sum() / m.sum().clamp_min(1)
            elif m is None:
                task = task_loss(logits, y)
            else:
                per = task_loss(logits, y, reduction="none").reshape(y.shape[0], -1).mean(1)  # per sample
                task = (per * m).sum() / m.sum().clamp_min(1)
            extra = term_values(terms, params, buffers, refs, x, y, logits, m)
            return (task if extra is None else task + extra), task

        dims = (0, 0, 0, 0, 0, None if exact else 0)
        batched = vmap(loss_fn, in_dims=dims, randomness="error")
        # Without BatchNorm (no buffer written during the forward pass) the gradients are taken inside the
        # vmapped function (``vmap(grad)``): one fused per-client backward instead of autograd through the
        # batching rules, ~20 % less CPU per step on the MLP.  Which parameters get a gradient is learnt on
        # the first step (a parameter without one stays untouched, as in ``torch.optim``).
        writes_buffers = any(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in model.modules())
        fused = None

        def split_loss(opt_params, fixed, buffers, refs, x, y, m):
            return loss_fn({**fixed, **opt_params}, buffers, refs, x, y, m)
        opt = _StackedOptimizer(spec, [P[n] for n in opt_names])
        acc_dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        loss_acc = torch.zeros(C, dtype=acc_dtype, device=device)
        steps_of = torch.tensor([len(s) for s in scheds], device=device)
        was_training = model.training
        model.train()
        try:
            for t in range(T):
                if exact:
                    sel = idx[:, t, : sizes[t]]
                    m = None
                else:
                    sel, m = idx[:, t], mask[:, t]
                x, y = x_all[sel], y_all[sel]
                Rt = {**R, **{k: v[:, t] for k, v in S.items()}} if S else R  # this step's constants
                if fused is None:
                    total, task = batched(P, Bf, Rt, x, y, m)
                    grads = torch.autograd.grad(total.sum(), [P[n] for n in opt_names], allow_unused=True)
                    if not writes_buffers and opt_names:
                        used = [n for n, g in zip(opt_names, grads, strict=True) if g is not None]
                        fused = (used, vmap(grad_and_value(split_loss, has_aux=True), in_dims=(0, *dims),
                                            randomness="error"))
                else:
                    used, fn = fused
                    with torch.no_grad():
                        fixed = {n: v for n, v in P.items() if n not in used}
                    g, (_, task) = fn({n: P[n] for n in used}, fixed, Bf, Rt, x, y, m)
                    grads = tuple(g.get(n) for n in opt_names)
                if spec.two_pass:  # SAM/ASAM: the step uses the gradient at w + ε (fedfuse.engine.sam)
                    grads = self._second_pass(spec, opt_names, P, Bf, Rt, x, y, m, grads, batched, fused)
                if G:  # per-client gradient masks, after SAM's second pass and before clipping (as sequential)
                    grads = tuple(g if g is None or n not in G else g * G[n].to(g.dtype)
                                  for n, g in zip(opt_names, grads, strict=True))
                active = None if exact else (t < steps_of)
                opt.step(list(grads), active)
                loss_acc += task.detach().to(acc_dtype) * counts[:, t].to(acc_dtype)
        finally:
            model.train(was_training)

        keys = [k for k in model.state_dict() if not p0.shared_base or k in p0.init]
        losses = loss_acc.tolist()
        out: dict[int, Any] = {}
        for i, (job, prog) in enumerate(group):
            state = {}
            for k in keys:
                src = P[k] if k in P else Bf[k]
                state[k] = src[i].detach().clone()
            n_samples = int(sum(scheds[i]))
            stats = TrainStats(steps=len(scheds[i]), samples=n_samples, loss_sum=losses[i])
            out[job.cid] = prog.finish(state, stats, gens[i])
        return out

    @staticmethod
    def _second_pass(spec: Any, opt_names: list[str], P: dict[str, torch.Tensor], Bf: dict[str, torch.Tensor],
                     R: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, m: torch.Tensor | None,
                     grads: Sequence[torch.Tensor | None], batched: Any, fused: Any) -> tuple:
        """Gradients at w + ε for every client (ε per client, as :func:`fedfuse.engine.sam.sam_step`); BN
        buffers written by the perturbed pass are restored, so statistics come from the first pass."""
        eps = stacked_perturbation(opt_names, P, dict(zip(opt_names, grads, strict=True)), spec.sam_rho,
                                   spec.two_pass == "asam", spec.sam_eta)
        if fused is not None:
            used, fn = fused
            with torch.no_grad():
                moved = {n: P[n] + eps[n] if n in eps else P[n] for n in used}
                fixed = {n: v for n, v in P.items() if n not in used}
            g, _ = fn(moved, fixed, Bf, R, x, y, m)
            return tuple(g.get(n) for n in opt_names)
        saved = {n: b.clone() for n, b in Bf.items()}
        moved = dict(P)
        for n in opt_names:
            moved[n] = (P[n].detach() + eps[n] if n in eps else P[n].detach()).requires_grad_(True)
        total, _ = batched(moved, Bf, R, x, y, m)
        out = torch.autograd.grad(total.sum(), [moved[n] for n in opt_names], allow_unused=True)
        with torch.no_grad():
            for n, b in Bf.items():
                b.copy_(saved[n])
        return out

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


def _pad_steps(t: torch.Tensor, steps: int) -> torch.Tensor:
    """``t`` (its steps, ...) zero-padded to ``steps`` rows (the padded steps of a shorter client are inactive)."""
    if t.shape[0] >= steps:
        return t[:steps]
    return torch.cat([t, t.new_zeros((steps - t.shape[0], *t.shape[1:]))])


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
