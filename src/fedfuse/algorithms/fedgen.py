"""FedGen (Zhu, Hong, Zhou, ICML 2021, "Data-free knowledge distillation for heterogeneous federated
learning"): FedAvg plus a server-side conditional generator G_w(z | y) over the classifier's *input* features,
learnt from the clients' heads and handed back to them as an inductive bias.

Follows the paper (Eq. 4 generator objective, Eq. 5 client objective, Algorithm 1) with the numbers of the
authors' code (``zhuangdizhu/FedGen``: ``serverpFedGen.py``, ``userpFedGen.py``, ``generator.py``,
``model_config.py``), which FedMR's Table 1 says it reused ("the same server settings as FedGen"):

* **Generator** (``generator.py``): input = uniform noise ε ∈ [0,1)^{noise_dim} ⊕ one-hot(y) → Linear
  (hidden) → BatchNorm → ReLU → Linear → z ∈ R^{d}, d = the model head's input width (latent layer −1).
  CIFAR config: hidden 512, noise 64.
* **Server, every round** (``train_generator``), before averaging: label weights
  α_{y,k} = c_k(y) / Σ_j c_j(y) from the selected clients' label counts (every count starts at 1; labels with
  max count ≤ 1 are not sampled); ``gen_epochs × teacher_iters`` = 10 × 5 Adam steps (lr 3e-4, weight decay
  1e-2, ×0.98 per round) on batches of y drawn uniformly from the qualified labels, minimising
  ensemble_alpha · Σ_k mean(α_{y,k} · CE(h_k(z), y)) + ensemble_eta · L_div, where h_k is client k's trained
  head and L_div = exp(−mean_{ij} ‖ε_i − ε_j‖²_mean · |z_i − z_j|_mean) the code's diversity loss;
  ensemble_beta > 0 adds the code's adversarial student term (−β·KL(σ(Σ_k α h_k(z)) ‖ σ(h_global(z))))).
* **Server aggregation**: FedAvg, sample-weighted (``aggregate_parameters``); BN statistics averaged with the
  same weights, ``num_batches_tracked`` = max (the code averages parameters only).  It is FedAvg's server rule,
  so FedAvg's options (``server_lr``, robust ``fusion``, ``clip_norm``) act on FedGen's global model too.
* **Client** (Eq. 5, ``UserpFedGen.train``), from the second round on: loss = CE(f(x), y)
  + (B_gen/B)·α_t·CE(h(G(ŷ)), ŷ) + β_t·KL(σ(h(G(y))) ‖ f(x)), with ŷ ~ Uniform(all labels), G in eval mode
  and not trained, σ(h(G(y))) detached, α_t = max(1e-4, generative_alpha·0.98^t), β_t likewise
  (generative_alpha = generative_beta = 10, B_gen = 32).  Clients report their label counts (1 + samples seen
  per label) with their model.

Communication counts the generator in every download (it is part of the payload).  The server's generator
training FLOPs are reported as the ``server_flops`` diagnostic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedfuse.algorithms.base import ClientState, RoundInfo, ServerState, state_of
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.engine.client import TrainStats
from fedfuse.engine.program import Batch, ClientProgram, LossTerm
from fedfuse.options import opt
from fedfuse.rng import torch_generator
from fedfuse.types import ClientData, Message, Privacy, ServerView, TensorDict, no, not_built

GEN = "gen/"


class Generator(nn.Module):
    """G(z | y): [ε ~ U[0,1)^noise, one-hot(y)] → Linear → BN → ReLU → Linear → latent (FedGen's generator)."""

    def __init__(self, num_classes: int, latent_dim: int, noise_dim: int = 64, hidden_dim: int = 512) -> None:
        super().__init__()
        self.num_classes, self.noise_dim = num_classes, noise_dim
        self.fc = nn.Linear(noise_dim + num_classes, hidden_dim)
        self.bn = nn.BatchNorm1d(hidden_dim)
        self.out = nn.Linear(hidden_dim, latent_dim)

    def forward(self, y: torch.Tensor, gen: torch.Generator | None = None,
                eps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """z = G(ε, y) with ε drawn from ``gen`` (or the given ``eps``, e.g. noise drawn up front)."""
        if eps is None:
            eps = torch.rand((y.shape[0], self.noise_dim), generator=gen, device=gen.device if gen else None)
        eps = eps.to(self.fc.weight.device)
        # = F.one_hot(y, C), written as a comparison so that it runs under vmap (one_hot checks the values)
        onehot = (y.long().unsqueeze(1) == torch.arange(self.num_classes, device=y.device)).float()
        return self.out(F.relu(self.bn(self.fc(torch.cat([eps, onehot], 1))))), eps


def diversity_loss(eps: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """FedGen's DiversityLoss('l1'): exp(−mean over pairs of mean-squared noise distance × mean-abs output distance)."""
    z = z.reshape(z.shape[0], -1)
    dz = (z.unsqueeze(0) - z.unsqueeze(1)).abs().mean(-1)
    de = (eps.unsqueeze(0) - eps.unsqueeze(1)).pow(2).mean(-1)
    return torch.exp(torch.mean(-de * dz))


def label_weights(counts: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """(C, K) α_{y,k} = c_k(y)/Σ_j c_j(y) and the labels some client holds more than once (``qualified``)."""
    c = np.asarray(counts, dtype=np.float64).T  # (C, K)
    w = c / np.maximum(c.sum(axis=1, keepdims=True), 1e-12)
    qualified = [int(y) for y in range(c.shape[0]) if c[y].max() > 1]
    return w, qualified


def decayed(value: float, r: int, decay: float = 0.98, floor: float = 1e-4) -> float:
    """The code's ``exp_lr_scheduler``: max(floor, value · decay^r)."""
    return max(floor, float(value) * decay ** r)


class FedGen(FedAvg):
    name = "fedgen"
    description = "FedGen: FedAvg + server-learnt conditional feature generator distilled into the clients"
    privacy = (
        Privacy(ServerView.MODELS,
                ("the generator is trained against every selected client's own head and label counts, one by "
                 'one'),
                central_dp=no('each head is used individually by the generator objective; noise on the mean '
                               'does not cover it'),
                local_dp=not_built('DP-SGD on the client step plus noisy label counts would cover what the '
                                    'server reads'),
                secagg=no("the generator needs each client's head, not their sum")),
    )

    @dataclass
    class Options(FedAvg.Options):
        hidden_dim: int = opt(512, "generator hidden width (code, CIFAR config)", ge=1)
        noise_dim: int = opt(64, "generator noise width (code, CIFAR config)", ge=1)
        gen_lr: float = opt(3e-4, "generator Adam learning rate (code ensemble_lr)", gt=0.0)
        gen_weight_decay: float = opt(1e-2, "generator Adam weight decay (code)", ge=0.0)
        gen_lr_decay: float = opt(0.98, "generator learning rate × this per round (code ExponentialLR)", gt=0.0,
                                  le=1.0)
        gen_epochs: int = opt(10, "generator epochs per round (code: ensemble_epochs 50 // teacher_iters)", ge=0)
        teacher_iters: int = opt(5, "generator steps per epoch (code n_teacher_iters)", ge=1)
        gen_batch_size: int = opt(0, "server generator batch (0 = the run's batch_size, as the code)", ge=0)
        ensemble_alpha: float = opt(1.0, "weight of the teacher (ensemble CE) loss", ge=0.0)
        ensemble_beta: float = opt(0.0, "weight of the adversarial student loss (0 in the code's configs)", ge=0.0)
        ensemble_eta: float = opt(1.0, "weight of the diversity loss", ge=0.0)
        generative_alpha: float = opt(10.0, "client weight of CE on generated features (decays 0.98/round)", ge=0.0)
        generative_beta: float = opt(10.0, "client weight of KL to the generator's prediction (decays 0.98/round)",
                                     ge=0.0)
        client_gen_batch: int = opt(32, "generated samples per client step (code gen_batch_size)", ge=1)

    def __init__(self, ctx: Any, options: Any = None) -> None:
        super().__init__(ctx, options)
        model = ctx.model({})
        self.head_name = model.head_name
        self.latent_dim = int(model.head.in_features)

    def _new_generator(self) -> Generator:
        return Generator(self.ctx.num_classes, self.latent_dim, self.opt.noise_dim, self.opt.hidden_dim).to(
            self.ctx.device)

    def init_state(self) -> ServerState:
        state = super().init_state()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.ctx.seed + 1)
            g = self._new_generator()
        state["generator"] = state_of(g)
        state["gen_opt"] = None
        return state

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        tensors = {**state["global"], **{GEN + k: v for k, v in state["generator"].items()}}
        msg = Message(tensors, {"round": info.index})
        return {c: msg for c in clients}

    # ---- client -------------------------------------------------------------------------------------------
    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """FedAvg's step on Eq. 5's loss.  The generator G is frozen (eval mode) and its values travel as
        ``refs``; every random draw of the two generator terms (the noise ε for the batch's labels, the labels
        ŷ and noise of the teacher batch, in this order per step) is drawn up front from the client's own
        stream (run seed, round, client) as ``refs`` with one row per optimiser step (read with ``batch.step``), so
        every executor uses the same draws.  Rows are zero-padded to the longest schedule of any client, so
        clients' constants have equal shapes.  The KL term is per sample (its batch mean is ``batchmean``), the
        teacher term reads no batch."""
        r = int(payload.meta.get("round", 0))
        weights = {k: v for k, v in payload.tensors.items() if not k.startswith(GEN)}
        model = self.ctx.model({})
        spec = self.ctx.train
        n, bg = len(data.train), self.opt.client_gen_batch
        steps = spec.schedule(n)
        terms: tuple[LossTerm, ...] = ()
        refs: TensorDict = {}
        if r > 0 and steps and (self.opt.generative_alpha > 0 or self.opt.generative_beta > 0):
            alpha, beta = decayed(self.opt.generative_alpha, r), decayed(self.opt.generative_beta, r)
            ratio, noise, C = bg / self.ctx.train.batch_size, self.opt.noise_dim, self.ctx.num_classes
            sgen = torch_generator(self.ctx.seed, "fedgen-client", r, data.cid)
            rows = max(len(steps), *(len(spec.schedule(int(s))) for s in self.ctx.client_sizes))
            eps1 = torch.zeros(rows, max(steps), noise)
            ys = torch.zeros(rows, bg, dtype=torch.long)
            eps2 = torch.zeros(rows, bg, noise)
            for t, b in enumerate(steps):  # the order a step-by-step loop draws them
                eps1[t, :b] = torch.rand((b, noise), generator=sgen)
                ys[t] = torch.randint(0, C, (bg,), generator=sgen)
                eps2[t] = torch.rand((bg, noise), generator=sgen)
            dev = data.train.x.device
            refs = {k: v for k, v in payload.tensors.items() if k.startswith(GEN)}  # G's state, "gen/…"
            refs.update({"eps1": eps1.to(dev), "ys": ys.to(dev), "eps2": eps2.to(dev)})
            g, head, hp = self._client_generator(), model.head, self.head_name + "."

            def generated(refs: TensorDict, y: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
                return functional_call(g, {k[len(GEN):]: v for k, v in refs.items() if k.startswith(GEN)},
                                       (y,), {"eps": eps})[0]

            def head_of(params: TensorDict, z: torch.Tensor) -> torch.Tensor:
                return functional_call(head, {k[len(hp):]: v for k, v in params.items() if k.startswith(hp)}, (z,))

            def latent(b: Batch) -> torch.Tensor:
                with torch.no_grad():
                    eps = b.refs["eps1"][b.step][: b.y.shape[0]]
                    target = F.softmax(head_of(b.params, generated(b.refs, b.y, eps)), dim=1)
                # KL(target ‖ softmax(logits)) per sample (its batch mean is F.kl_div(..., "batchmean")), written
                # with xlogy because kl_div has no vmap batching rule
                return b.mean(beta * (torch.xlogy(target, target) - target * F.log_softmax(b.logits, dim=1)).sum(1))

            def teacher(b: Batch) -> torch.Tensor:
                ys = b.refs["ys"][b.step]
                with torch.no_grad():
                    z = generated(b.refs, ys, b.refs["eps2"][b.step])
                return ratio * alpha * F.cross_entropy(head_of(b.params, z), ys)

            terms = (LossTerm("fedgen-latent", latent), LossTerm("fedgen-teacher", teacher))
        hist = torch.bincount(data.train.y.long().cpu(), minlength=self.ctx.num_classes).numpy()
        with_terms = bool(terms)

        def finalize(state: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            fit = self.fit_stats(model, data, stats)
            if with_terms:  # the generator's forward and the head on the generated samples, every step
                fit.flops += (stats.samples + stats.steps * bg) * self.generator_flops_per_sample()
            seen = max(stats.samples // max(n, 1), 1) if stats.samples else 0
            return Message(state, {"label_counts": (1 + seen * hist).tolist()}, fit), client_state

        return ClientProgram(model=model, init=weights, spec=spec, finalize=finalize, terms=terms, refs=refs)

    def _client_generator(self) -> Generator:
        """The clients' frozen generator template (eval mode; values come from ``refs``)."""
        if "_gen_client" not in self.__dict__:
            with torch.random.fork_rng(devices=[]):
                self._gen_client = self._new_generator().eval()
            for p in self._gen_client.parameters():
                p.requires_grad_(False)
        return self._gen_client

    def generator_flops_per_sample(self) -> float:
        """Forward FLOPs of the generator plus forward/backward of the head on one generated sample."""
        i, h, d, c = self.opt.noise_dim + self.ctx.num_classes, self.opt.hidden_dim, self.latent_dim, \
            self.ctx.num_classes
        return 2.0 * (i * h + h * d) + 3 * 2.0 * d * c

    # ---- server -------------------------------------------------------------------------------------------
    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        gstate, opt_state, diag = self.train_generator(state, info, results)
        fused = super().aggregate_fit(state, info, results)  # FedAvg's server rule: every FedAvg option acts
        return {**fused, "generator": gstate, "gen_opt": opt_state, "diag": diag}

    def _head_params(self, tensors: TensorDict) -> TensorDict:
        prefix = self.head_name + "."
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    def train_generator(self, state: ServerState, info: RoundInfo,
                        results: dict[int, Message]) -> tuple[TensorDict, Any, dict[str, float]]:
        order = sorted(results)
        counts = np.array([results[c].meta.get("label_counts", [1] * self.ctx.num_classes) for c in order])
        w, qualified = label_weights(counts)
        steps = int(self.opt.gen_epochs) * int(self.opt.teacher_iters)
        if not qualified or steps == 0:
            return state["generator"], state.get("gen_opt"), {"server_flops": 0.0}
        g = self._new_generator()
        g.load_state_dict(state["generator"])
        g.train()
        lr = float(self.opt.gen_lr) * float(self.opt.gen_lr_decay) ** info.index
        opt = torch.optim.Adam(g.parameters(), lr=lr, weight_decay=float(self.opt.gen_weight_decay))
        if state.get("gen_opt"):
            opt.load_state_dict(state["gen_opt"])
            for group in opt.param_groups:
                group["lr"] = lr
        head = self.ctx.model({}).head
        heads = [{k: v.detach() for k, v in self._head_params(results[c].tensors).items()} for c in order]
        student = {k: v.detach() for k, v in self._head_params(state["global"]).items()}
        wt = torch.tensor(w, dtype=torch.float32, device=self.ctx.device)  # (C, K)
        bs = int(self.opt.gen_batch_size) or self.ctx.train.batch_size
        sgen = torch_generator(self.ctx.seed, "fedgen-server", info.index)
        labels = torch.tensor(qualified, dtype=torch.long)
        teacher_sum = div_sum = 0.0
        for _ in range(steps):
            y = labels[torch.randint(0, len(labels), (bs,), generator=sgen)].to(self.ctx.device)
            z, eps = g(y, sgen)
            teacher = torch.zeros((), device=self.ctx.device)
            teacher_logit = 0.0
            for k, hp in enumerate(heads):
                logit = functional_call(head, hp, (z,))
                wk = wt[y, k]
                teacher = teacher + (F.cross_entropy(logit, y, reduction="none") * wk).mean()
                teacher_logit = teacher_logit + logit * wk[:, None]
            div = diversity_loss(eps, z)
            loss = self.opt.ensemble_alpha * teacher + self.opt.ensemble_eta * div
            if self.opt.ensemble_beta > 0:
                s_logit = functional_call(head, student, (z,))
                student_loss = F.kl_div(F.log_softmax(s_logit, 1), F.softmax(teacher_logit, 1), reduction="batchmean")
                loss = loss - self.opt.ensemble_beta * student_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            teacher_sum += float(teacher.detach())
            div_sum += float(div.detach())
        i = self.opt.noise_dim + self.ctx.num_classes
        gen_fwd = 2.0 * (i * self.opt.hidden_dim + self.opt.hidden_dim * self.latent_dim)
        head_fwd = 2.0 * self.latent_dim * self.ctx.num_classes
        server_flops = steps * bs * 3.0 * (gen_fwd + len(heads) * head_fwd)
        diag = {"generator_teacher_loss": teacher_sum / steps, "generator_diversity_loss": div_sum / steps,
                "server_flops": server_flops}
        return state_of(g), opt.state_dict(), diag

    def diagnostics(self, state: ServerState, fed: Any, info: RoundInfo) -> dict[str, Any]:
        return dict(state.get("diag", {}))


__all__ = ["FedGen", "Generator", "decayed", "diversity_loss", "label_weights"]
