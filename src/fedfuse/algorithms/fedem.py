"""FedEM (Marfoq et al. 2021, "Federated multi-task learning under a mixture of distributions"; code
omarfoq/FedEM).

Every client holds M learners (the M global components, all sent down and up every round) and its own
mixture weights π (client state, initialised 1/M).  A local round is

* E-step, on the client's training data with the received learners (eval mode, no gradient):
  q_m(x) ∝ π_m · exp(−ℓ_m(x)) (normalised over m), then π = mean_x q(x);
* M-step: each learner m trains for the run's local epochs on loss Σ_{x∈batch} q_m(x) ℓ_m(x) / |batch|.
  The learners share the batch order (their losses are decoupled, so training them one after another on
  the same permutation equals training them jointly).

Server: each learner is averaged n-weighted over the sampled clients (full state, BN buffers included,
``num_batches_tracked``: max).  ``stale_average=true`` is the code's form: the average runs over *all*
clients, the unsampled ones contributing their stale copy (= the current global learner).
Prediction: Σ_m π_m softmax(f_m(x)).

Declared client program: the E-step runs when the client prepares (:meth:`FedEM.client_program`); the
M-step trains the M learners as one module (:class:`Learners`, logits stacked to (B, M, C)) on the objective
Σ_m q_m(x) ℓ_m(x) per sample, whose responsibilities travel as extra target columns.  The learners share no
parameter, so each learner's gradient and optimiser step (SGD, momentum, weight decay, Adam: all per
parameter) are those of training it alone on the same batches; the batched executor trains many clients' M
learners at once.  Two cases keep the separate loop (``fit``): gradient clipping (``--grad-clip``, a norm per
learner, not over all M) and targets that are not one class per sample (language models).

Client cost (the point FedMerge makes): M models down and up, M models trained, M forward passes for the
E-step — all in the bytes, ``flops`` and ``trained_params`` accounting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState, evaluate_splits, state_of
from fedfuse.engine.client import (
    TrainStats,
    forward_flops_per_sample,
    make_optimizer,
    per_sample_losses,
    task_loss,
    train_flops_per_sample,
)
from fedfuse.engine.context import init_states, model_params
from fedfuse.engine.program import ClientProgram, run_program
from fedfuse.errors import UserError
from fedfuse.fusion.average import weighted_average
from fedfuse.fusion.mixture import e_step, mixture_loss, pack, unpack
from fedfuse.options import opt
from fedfuse.types import ClientData, FitStats, Message, Privacy, ServerView, Split, not_built


class Learners(nn.Module):
    """M learners as one module: ``forward(x)`` stacks their logits to (B, M, C)."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        self.learners = nn.ModuleList(models)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.learners], dim=1)


class FedEM(Algorithm):
    name = "fedem"
    description = "FedEM: M shared learners + per-client mixture weights, trained by federated EM"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                'each of the M learners is an n-weighted mean over the clients: M sums',
                central_dp=not_built('DP-FedAvg per learner (M clipped means, M-fold composition) would fit; '
                                      'not wired'),
                local_dp=not_built('DP-SGD on the M-step would fit; the E-step reads the local data too'),
                secagg=not_built("M sums: masks would hide each client's learners")),
    )

    @dataclass
    class Options:
        m: int = opt(3, "number of learners M", ge=1)
        stale_average: bool = opt(False, "code's variant: average over all clients, unsampled ones with their "
                                  "stale copy (paper: sampled clients only)")

    def init_state(self) -> ServerState:
        if self.opt.m < 1:
            raise UserError(f"m must be >= 1, got {self.opt.m}")
        return {"learners": init_states(self.ctx, self.opt.m, "fedem-init")}

    def init_client_state(self, cid: int) -> ClientState:
        return {"pi": torch.full((self.opt.m,), 1.0 / self.opt.m, dtype=torch.float64)}

    def _message(self, state: ServerState) -> Message:
        return Message(pack(state["learners"]), {"m": len(state["learners"])})

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        msg = self._message(state)
        return {c: msg for c in clients}

    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]:
        msg = self._message(state)
        return {c: msg for c in clients}

    def _e_step(self, states: list, client_state: ClientState, data: ClientData) -> tuple[torch.Tensor, torch.Tensor]:
        """Responsibilities q (n, M) of the received learners on the client's data, and the new π."""
        pi = (client_state or self.init_client_state(data.cid))["pi"]
        losses = torch.stack([per_sample_losses(self.ctx.load(s), data.train, self.ctx.eval_batch_size)
                              for s in states])
        q, pi = e_step(losses, pi)
        return q.to(data.train.x.device, torch.float32), pi

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram | None:
        """E-step, then the M-step as one program on :class:`Learners` (see the module docstring)."""
        states = unpack(payload.tensors, int(payload.meta["m"]))
        M, n = len(states), len(data.train)
        if n == 0 or self.ctx.train.grad_clip > 0 or data.train.y.dim() != 1:
            return None
        q, pi = self._e_step(states, client_state, data)
        model = self._learners(M)
        init = {f"learners.{m}.{k}": v for m, s in enumerate(states) for k, v in s.items()}
        targets = torch.cat([data.train.y.to(torch.float32).unsqueeze(1), q], dim=1)
        one = model.learners[0]

        def finalize(state: dict, stats: TrainStats) -> tuple[Message, ClientState]:
            out = [{k[len(f"learners.{m}."):]: v for k, v in state.items() if k.startswith(f"learners.{m}.")}
                   for m in range(M)]
            fit = FitStats(num_examples=n, trained_params=M * model_params(self.ctx))
            key = (self.ctx.model_name,)
            fwd = forward_flops_per_sample(one, data.train.x, key=key)
            train = train_flops_per_sample(one, data.train.x, data.train.y, key=key)
            # per learner, as the separate loop counts: M trainings on the same batches
            fit.samples, fit.steps = M * stats.samples, M * stats.steps
            fit.train_loss = stats.mean_loss / M
            fit.flops = float(M * n * fwd + fit.samples * train)
            return Message(pack(out), stats=fit), {"pi": pi}

        return ClientProgram(model=model, init=init, spec=self.ctx.train, finalize=finalize, loss=mixture_loss,
                             train=Split(data.train.x, targets.to(data.train.x.device)))

    def _learners(self, M: int) -> Learners:
        """The (cached) M-learner template; its own values are never read."""
        cache = self.__dict__.setdefault("_stacks", {})
        if M not in cache:
            with torch.random.fork_rng(devices=[]):
                cache[M] = Learners([self.ctx.build() for _ in range(M)])
        return cache[M]

    def fit(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> tuple[Message, ClientState]:
        """The declared program when there is one; otherwise the learners train one after another on the same
        batch order (gradient clipping per learner; language-model targets)."""
        program = self.client_program(payload, client_state, data)
        if program is not None:
            return run_program(program, data, gen)
        states = unpack(payload.tensors, int(payload.meta["m"]))
        M = len(states)
        n, cfg = len(data.train), self.ctx.train
        fit = FitStats(num_examples=n, trained_params=M * model_params(self.ctx))
        if n == 0:
            pi = (client_state or self.init_client_state(data.cid))["pi"]
            return Message(pack(states), stats=fit), {"pi": pi}
        q, pi = self._e_step(states, client_state, data)
        # M-step: the same batch order for every learner
        bs = min(cfg.batch_size, n)
        perms = [torch.randperm(n, generator=gen).to(data.train.x.device) for _ in range(cfg.local_epochs)]
        out_states, loss_sum, samples, steps = [], 0.0, 0, 0
        for m, s in enumerate(states):
            model = self.ctx.load(s)
            model.train()
            opt = make_optimizer(model.parameters(), cfg)
            for perm in perms:
                for start in range(0, n, bs):
                    idx = perm[start : start + bs]
                    x, y = data.train.x[idx], data.train.y[idx]
                    lv = task_loss(model(x), y, reduction="none")
                    loss = (q[idx, m] * lv).sum() / idx.numel()
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    if cfg.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                    opt.step()
                    steps += 1
                    samples += int(idx.numel())
                    loss_sum += float(loss.detach()) * int(idx.numel())
            out_states.append(state_of(model))
        key = (self.ctx.model_name,)
        fwd = forward_flops_per_sample(model, data.train.x, key=key)
        train = train_flops_per_sample(model, data.train.x, data.train.y, key=key)
        fit.samples, fit.steps, fit.train_loss = samples, steps, loss_sum / max(samples, 1)
        fit.flops = float(M * n * fwd + samples * train)
        return Message(pack(out_states), stats=fit), {"pi": pi}

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        M = len(state["learners"])
        clients = sorted(results)
        per = [unpack(results[c].tensors, M) for c in clients]
        w = [float(results[c].num_examples) for c in clients]
        learners = []
        for m, old in enumerate(state["learners"]):
            states, weights = [p[m] for p in per], list(w)
            if self.opt.stale_average:
                rest = float(self.ctx.client_sizes.sum()) - sum(w)
                if rest > 0:
                    states, weights = [old, *states], [rest, *weights]
            learners.append(weighted_average(states, weights, base=old))
        return {**state, "learners": learners}

    def global_model(self, state: ServerState) -> None:
        return None

    def server_parameters(self, state: ServerState) -> int:
        return len(state["learners"]) * model_params(self.ctx)

    def evaluate(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> dict[str, float]:
        states = unpack(payload.tensors, int(payload.meta["m"]))
        pi = (client_state or self.init_client_state(data.cid))["pi"]
        models = []
        for s in states:  # one module per learner: the mixture needs them together
            mod = self._module(len(models))
            mod.load_state_dict(s)
            mod.eval()
            models.append(mod)

        def predict(x: torch.Tensor) -> torch.Tensor:
            return sum(float(p) * torch.softmax(mod(x), dim=-1) for p, mod in zip(pi, models))

        return evaluate_splits(models[0], data, self.ctx.eval_batch_size, predict=predict)

    def _module(self, m: int) -> torch.nn.Module:
        cache = self.__dict__.setdefault("_modules", {})
        if m not in cache:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                cache[m] = self.ctx.build()
        return cache[m]
