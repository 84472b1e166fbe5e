"""FedMerge on LoRA adapters (Chen et al., *FedMerge: Federated Model Merging for
Personalization*, "Foundation model FL"; author code shutong043/FedMerge merges the LoRA matrices): the server
keeps d adapters and sends each client one merged rank-r adapter.

Notation as :mod:`fedfuse.algorithms.fedmerge` with Θ_j the j-th global *adapter* (its ``lora_A`` and
``lora_B`` tensors) on a frozen base:

1. client i receives θ_i = Σ_j w_ij Θ_j, merged tensor by tensor (A with A, B with B, as the authors' code
   does: the client's ΔW is then (Σ_j w_ij B_j)(Σ_j w_ij A_j), not Σ_j w_ij B_j A_j — see docs/lora.md);
2. it trains θ_i with the run's local optimiser (base frozen) and returns Δθ_i (adapter tensors only);
3. logits (App. D, delta form of Eq. 9): g_ij = s_i w_ij ⟨Δθ_i, Θ_j − θ_i⟩ over ``merge_params`` adapter
   tensors, a ← a + merge_step · G / max|G| (``merge_update="fixed"``, FedMerge paper §4.1) or a + merge_step · G;
4. adapters: the author code's column-normalised weights Θ_j ← Θ_j + theta_lr Σ_i ŵ_ij Δθ_i with
   ŵ_ij = w_ij n_i / Σ_k w_kj n_k (``theta_update="column_normalised"``, the default here) or the papers'
   Eq. 8/10, Θ_j ← Θ_j + theta_lr Σ_i s_i w_ij Δθ_i (``"paper"``).  With uniform weights the paper form moves
   every merged adapter by only 1/d of the clients' mean update (each Θ_j gets 1/d of it, and the merge
   averages them), so it learns d times slower than FedIT; measured on the role split it is clearly worse
   (docs/lora.md), so the code's form is the default for adapters.

Every fusion step calls :mod:`fedfuse.fusion.merge`'s public functions unchanged.  The d adapters start with
independent ``A`` (seeded) and ``B`` = 0, so every merged adapter starts as the identity (ΔW = 0) like a
fresh LoRA.  The uniform merge of d independent ``A`` has 1/√d of a single adapter's scale, which slows the
LoRA path (ΔW = B A) early on; ``init_scale="merge"`` multiplies each initial ``A_j`` by √d so the first
merged adapter has a fresh LoRA's scale for every d (docs/lora.md shows both, measured).
There are no buffers or integer entries in an adapter; tensors a client did not train cannot occur
(every client trains the whole adapter).

``fedem-lora`` (FedEM with a personalised router over LoRA modules, that paper's App. B.2) lives here too:
M adapters are all sent, trained with the E-step responsibilities and averaged; each client's router is
its mixture weights π (learned by EM), and its prediction is Σ_m π_m softmax(f_m(x)).  Its client step is a
declared program, as FedEM's: the E-step when the client prepares, then the M adapters train as one
:class:`~fedfuse.adapters.lora.AdapterStack` on the objective Σ_m q_m ℓ_m per row (ℓ_m the row's mean token
loss under adapter m; tokens and responsibilities travel as target columns).  The adapters share no tensor, so
each one's gradient and optimiser step are those of training it alone on the same batches; LoRA dropout draws
its masks adapter after adapter within each step instead of adapter by adapter over the whole run.  Gradient
clipping (a norm per adapter) keeps the separate loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedfuse.adapters.evaluate import row_losses
from fedfuse.adapters.lora import cross_term_gap
from fedfuse.algorithms.base import ClientState, RoundInfo, ServerState
from fedfuse.algorithms.lora_base import LoraAlgorithm, LoraOptions, size_weights
from fedfuse.engine.client import TrainStats, make_optimizer, task_loss
from fedfuse.engine.program import ClientProgram, run_program
from fedfuse.errors import UserError
from fedfuse.fusion.average import delta, weighted_average
from fedfuse.fusion.merge import (
    cluster_ari,
    merge_entropy,
    merge_states,
    row_softmax,
    server_step,
)
from fedfuse.fusion.mixture import e_step, mixture_loss
from fedfuse.options import opt
from fedfuse.types import ClientData, FitStats, Message, Privacy, ServerView, Split, TensorDict, no, not_built


def adapter_keys(keys: list[str], spec: str) -> list[str]:
    """Adapter tensors in the logit inner product: ``all`` | ``lora_A`` | ``lora_B`` | ``last-K`` modules."""
    if spec == "all":
        return list(keys)
    if spec in ("lora_A", "lora_B"):
        return [k for k in keys if f".{spec}." in k]
    if spec.startswith("last-"):
        n = int(spec.split("-", 1)[1])
        modules = list(dict.fromkeys(k.split(".lora_")[0] for k in keys))
        keep = set(modules[-n:])
        return [k for k in keys if k.split(".lora_")[0] in keep]
    raise UserError(f"merge_params={spec!r}; choose all, lora_A, lora_B or last-K")


def pack(adapters: list[TensorDict]) -> TensorDict:
    return {f"{m}/{k}": v for m, a in enumerate(adapters) for k, v in a.items()}


def unpack(tensors: TensorDict, count: int) -> list[TensorDict]:
    out: list[TensorDict] = [{} for _ in range(count)]
    for k, v in tensors.items():
        m, name = k.split("/", 1)
        out[int(m)][name] = v
    return out


class FedMergeLoRA(LoraAlgorithm):
    name = "fedmerge-lora"
    description = "FedMerge on LoRA adapters: d global adapters, each client receives one merged rank-r adapter"
    privacy = (
        Privacy(ServerView.DELTAS,
                'the merge logits of client i come from its own adapter delta, read individually',
                central_dp=no('per-client merge weights are computed from each delta'),
                local_dp=not_built('DP-SGD on the adapter step would make each delta DP'),
                secagg=no('the inner products need each delta before any sum')),
    )

    @dataclass
    class Options(LoraOptions):
        d: int = opt(4, "number of global adapters (the papers' parameter-scale study: 2..12)", ge=1)
        merge_params: str = opt("all", "adapter tensors in the merging-logit inner product: all, lora_A, "
                                "lora_B or last-K (the last K adapted modules)")
        merge_step: float = opt(0.01, "logit step (paper: 0.01 per round over 50 rounds)", ge=0.0)
        merge_update: str = opt("fixed", "fixed: largest logit change = merge_step (FedMerge paper §4.1, code's "
                                "search); gradient: a += merge_step · G", choices=("fixed", "gradient"))
        theta_lr: float = opt(1.0, "step on the global adapters (Eq. 8)", gt=0.0)
        theta_update: str = opt("column_normalised", "column_normalised (author code, default: measured better "
                                "here): ŵ_ij = w_ij n_i / Σ_k w_kj n_k; paper (Eq. 8): Θ_j += Σ_i s_i w_ij Δθ_i, "
                                "which moves a uniform merge by 1/d of the mean update",
                                choices=("paper", "column_normalised"))
        weights_first: bool = opt(False, "author code: update the logits first, then Θ with the new weights")
        size_norm: str = opt("sampled", "n in s_i = n_i / n: sampled clients' total or all clients' total",
                             choices=("sampled", "all"))
        init_scale: str = opt("peft", "initial A of the d adapters: peft (each a fresh peft LoRA; their uniform "
                              "merge has 1/√d of its scale) or merge (each scaled by √d so the uniform merge "
                              "has a fresh LoRA's scale)", choices=("peft", "merge"))

    def __init__(self, ctx: Any, options: Any | None = None) -> None:
        super().__init__(ctx, options)
        adapter_keys(["x.lora_A.w"], self.opt.merge_params if not self.opt.merge_params.startswith("last-")
                     else "all")

    @property
    def keys(self) -> list[str]:
        return adapter_keys(self.am.keys, self.opt.merge_params)

    def init_state(self) -> ServerState:
        d, m = int(self.opt.d), self.ctx.num_clients
        globals_ = [self.new_adapter("lora-merge-init", j) for j in range(d)]
        if self.opt.init_scale == "merge":  # Var(Σ_j A_j / d) = Var(A) / d: undo the shrinkage of the merge
            globals_ = [{k: v * d ** 0.5 if ".lora_A." in k else v for k, v in g.items()} for g in globals_]
        return {"globals": globals_, "logits": torch.zeros(m, d, dtype=torch.float64)}

    def weights(self, state: ServerState) -> torch.Tensor:
        return row_softmax(state["logits"])

    def merged(self, state: ServerState, cid: int) -> TensorDict:
        return merge_states(state["globals"], self.weights(state)[cid])

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        return {c: Message(self.merged(state, c)) for c in clients}

    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]:
        meta = self.eval_meta(state)
        return {c: Message(self.merged(state, c), dict(meta)) for c in clients}

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """Train the received merged adapter; reply with its delta (trained − received)."""
        def finalize(adapter: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            return Message(delta(adapter, payload.tensors), stats=self.adapter_stats(data, stats)), client_state

        return self.adapter_program(payload.tensors, data, finalize)

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        state = self.tag_round(state, info)
        if not results:
            return state
        o = self.opt
        clients = sorted(results)
        sizes = torch.tensor(size_weights(results, clients), dtype=torch.float64)
        total = float(sizes.sum()) if o.size_norm == "sampled" else float(self.ctx.client_sizes.sum())
        globals_, logits = server_step(
            state["globals"], state["logits"], clients, [results[c].tensors for c in clients], sizes, total,
            self.keys, step=o.merge_step, merge_update=o.merge_update, weights_first=o.weights_first,
            theta_update=o.theta_update, theta_lr=o.theta_lr,
        )
        return {**state, "globals": globals_, "logits": logits}

    def global_model(self, state: ServerState) -> None:
        return None

    def server_parameters(self, state: ServerState) -> int:
        return int(self.opt.d) * self.adapter_parameters()

    def evaluate(self, payload: Message, client_state: ClientState, data: ClientData,
                 gen: torch.Generator) -> dict[str, float]:
        return self.evaluate_mixture(([payload.tensors], [1.0]), data, payload.meta)

    def diagnostics(self, state: ServerState, fed: Any, info: RoundInfo) -> dict[str, Any]:
        out = super().diagnostics(state, fed, info)
        w = self.weights(state)
        wn = w.numpy()
        out["merge_entropy"] = merge_entropy(wn)
        out["merge_cross_term"] = float(np.mean([cross_term_gap(state["globals"], w[i].tolist())
                                                 for i in range(w.shape[0])]))
        groups = fed.groups()  # ground truth: diagnostics only
        out["ari"] = cluster_ari(wn, groups, self.ctx.seed) if groups else None
        if info.index + 1 == info.total:
            out["merge_weights"] = wn.round(4).tolist()
        return out


class FedEMLoRA(LoraAlgorithm):
    name = "fedem-lora"
    description = "FedEM over LoRA adapters: M shared adapters, a personalised router (mixture weights) per client"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                'each of the M adapters is an n-weighted mean over the clients: M sums',
                central_dp=not_built('DP-FedAvg per adapter would fit; not wired'),
                local_dp=not_built('DP-SGD on the M-step would fit; not wired'),
                secagg=not_built("M sums: masks would hide each client's adapters")),
    )

    @dataclass
    class Options(LoraOptions):
        m: int = opt(4, "number of shared adapters (all sent to and trained by every client)", ge=1)

    def init_state(self) -> ServerState:
        return {"adapters": [self.new_adapter("lora-em-init", j) for j in range(int(self.opt.m))]}

    def init_client_state(self, cid: int) -> ClientState:
        m = int(self.opt.m)
        return {"pi": torch.full((m,), 1.0 / m, dtype=torch.float64)}

    def _msg(self, state: ServerState) -> Message:
        return Message(pack(state["adapters"]), {"m": len(state["adapters"])})

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        msg = self._msg(state)
        return {c: msg for c in clients}

    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]:
        msg = self._msg(state)
        msg.meta.update(self.eval_meta(state))
        return {c: msg for c in clients}

    def _e_step(self, adapters: list[TensorDict], client_state: ClientState,
                data: ClientData) -> tuple[torch.Tensor, torch.Tensor]:
        """Responsibilities q (n × M, float32 on the data's device) and the client's new π."""
        pi = (client_state or self.init_client_state(data.cid))["pi"]
        self.am.module.eval()
        losses = torch.stack([row_losses(self.predictor(([a], [1.0])), data.train, self.ctx.eval_batch_size)
                              for a in adapters])
        q, pi = e_step(losses.cpu(), pi)
        return q.to(data.train.x.device, torch.float32), pi

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram | None:
        """E-step, then the M adapters trained as one stack on the mixture objective (module docstring)."""
        adapters = unpack(payload.tensors, int(payload.meta["m"]))
        M, n = len(adapters), len(data.train)
        if n == 0 or self.ctx.train.grad_clip > 0:
            return None
        q, pi = self._e_step(adapters, client_state, data)
        stack = self.am.stack(M)
        targets = torch.cat([data.train.y.to(torch.float32), q], dim=1)

        def finalize(state: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            fwd, train = self.flops_per_row(data)
            samples = M * int(stats.samples)  # per adapter, as the separate loop counts
            fit = FitStats(num_examples=n, samples=samples, steps=M * int(stats.steps),
                           train_loss=float(stats.mean_loss) / M, flops=float(train * samples + fwd * n * M),
                           trained_params=M * self.am.numel)
            return Message(pack(stack.adapters_of(state)), stats=fit), {"pi": pi}

        init = stack.state_of(adapters)
        return ClientProgram(model=stack, init=init, spec=self.ctx.train, finalize=finalize, trainable=frozenset(init),
                             loss=mixture_loss, train=Split(data.train.x, targets.to(data.train.x.device)))

    def fit(self, payload: Message, client_state: ClientState, data: ClientData,
            gen: torch.Generator) -> tuple[Message, ClientState]:
        """The declared program when there is one; otherwise (gradient clipping per adapter, or no data) the
        adapters train one after another on the same batch order."""
        program = self.client_program(payload, client_state, data)
        if program is not None:
            return run_program(program, data, gen)
        adapters = unpack(payload.tensors, int(payload.meta["m"]))
        n, cfg, am = len(data.train), self.ctx.train, self.am
        if n == 0:
            pi = (client_state or self.init_client_state(data.cid))["pi"]
            return Message(pack(adapters), stats=FitStats(trained_params=0)), {"pi": pi}
        q, pi = self._e_step(adapters, client_state, data)
        bs = min(cfg.batch_size, n)
        perms = [torch.randperm(n, generator=gen).to(data.train.x.device) for _ in range(cfg.local_epochs)]
        out, loss_sum, samples, steps = [], 0.0, 0, 0
        for m, a in enumerate(adapters):
            am.load(a)
            am.module.train()
            params = list(am.params.values())
            opt_ = make_optimizer(params, cfg)
            for perm in perms:
                for s in range(0, n, bs):
                    idx = perm[s : s + bs]
                    x, y = data.train.x[idx], data.train.y[idx]
                    tok = task_loss(am(x), y, reduction="none").view(y.shape)
                    counted = (y != -100).sum(1).clamp_min(1)
                    loss = (q[idx, m] * tok.sum(1) / counted).sum() / idx.numel()
                    opt_.zero_grad(set_to_none=True)
                    loss.backward()
                    if cfg.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                    opt_.step()
                    steps += 1
                    samples += int(idx.numel())
                    loss_sum += float(loss.detach()) * int(idx.numel())
            out.append(am.adapter())
        fwd, train = self.flops_per_row(data)
        fit = FitStats(num_examples=n, samples=samples, steps=steps, train_loss=loss_sum / max(samples, 1),
                       flops=float(train * samples + fwd * n * len(adapters)), trained_params=len(adapters) * am.numel)
        return Message(pack(out), stats=fit), {"pi": pi}

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        clients = sorted(results)
        state = self.tag_round(state, info)
        if not clients:
            return state
        M = len(state["adapters"])
        per = [unpack(results[c].tensors, M) for c in clients]
        w = size_weights(results, clients)
        return {**state, "adapters": [weighted_average([p[m] for p in per], w, base=old)
                                      for m, old in enumerate(state["adapters"])]}

    def global_model(self, state: ServerState) -> None:
        return None

    def server_parameters(self, state: ServerState) -> int:
        return int(self.opt.m) * self.adapter_parameters()

    def evaluate(self, payload: Message, client_state: ClientState, data: ClientData,
                 gen: torch.Generator) -> dict[str, float]:
        adapters = unpack(payload.tensors, int(payload.meta["m"]))
        pi = (client_state or self.init_client_state(data.cid))["pi"]
        return self.evaluate_mixture((adapters, [float(p) for p in pi]), data, payload.meta)
