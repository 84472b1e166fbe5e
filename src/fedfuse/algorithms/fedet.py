"""Fed-ET (Cho, Manoel, Joshi, Sim, Dimitriadis, IJCAI 2022, "Heterogeneous ensemble knowledge transfer for
training large models in federated learning"): clients train *small* models of several architectures; the
server trains a *large* model from their ensemble by weighted consensus distillation on public unlabelled data.

Per round (paper §3.2, steps (a)–(c) of Fig. 1).  We found no authors' code; the server settings (SGD lr 5e-3,
128 steps of batch 64, λ = 0.05, variance as confidence, the shared final layer) are those of a public
re-implementation and are options:

1. **Clients** train the small model of their group (client k uses ``small_models[k mod U]``) with plain
   cross-entropy and send it back.
2. **Weighted consensus** on the public set X_p: every returned model k gives log-probabilities
   log f_k(x); its confidence is the variance of that vector, σ²_k(x).  The consensus is
   ŷ(x) = argmax_c Σ_k [σ²_k(x)/Σ_j σ²_j(x)] log f_k(x)_c (confident models weigh more).
3. **Diversity regularisation**: the models whose prediction disagrees with ŷ(x) form a second,
   variance-weighted target s_div(x); samples without a dissenting model contribute no diversity term.
4. **Server update**: the large model starts from last round's, with its representation (final) layer
   replaced by the average of the small models' (they share it, so its width must match), and takes
   ``server_iters`` SGD steps (lr ``server_lr``, batch ``server_batch``) on
   CE(f_s(x), ŷ(x)) + λ·KL(σ(s_div(x)) ‖ f_s(x)), λ = ``diversity``.
5. **Transfer back**: each group's small model = sample-weighted FedAvg of that group's returned models, then
   its representation layer ← the server's (``transfer="head"``, the paper's shared layer).  When the widths
   differ, ``transfer="distill"`` instead distils every small model from the server model on X_p for
   ``back_iters`` steps (our extension for arbitrary small models); ``auto`` picks ``head`` when possible.

Public data: ``setup`` holds aside ``public_fraction`` of every client's training split (seeded; labels
discarded) as the server's unlabelled set — its distribution is the training pool's.  BatchNorm statistics of
the small models are averaged within a group (``num_batches_tracked`` = max); the server model's statistics
follow its training on X_p.

Accounting as MSfusion's Table 1: the server's work (ensemble inference on X_p, server training, transfer back)
is counted in FLOPs (``server_flops``) and ``flops_per_participant`` = (client FLOPs + server FLOPs) / clients
that took part.  The evaluated global model is the large server model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState, state_of
from fedfuse.engine.client import TrainStats, train_flops_per_sample
from fedfuse.engine.program import ClientProgram
from fedfuse.errors import UserError
from fedfuse.fusion.average import weighted_average
from fedfuse.options import opt
from fedfuse.rng import numpy_rng, torch_generator
from fedfuse.types import ClientData, Federation, Message, Privacy, ServerView, Split, TensorDict, no, not_built


def consensus_targets(logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted consensus labels, diversity targets and a has-dissent mask from (K, B, C) log-probabilities."""
    var = logps.var(dim=2)  # (K, B): confidence of every model on every sample
    w = var / var.sum(0, keepdim=True).clamp_min(1e-12)
    labels = (w.unsqueeze(2) * logps).sum(0).argmax(1)
    dissent = (logps.argmax(2) != labels.unsqueeze(0)).float()  # (K, B)
    dv = dissent * var
    has = dv.sum(0) > 0
    dw = dv / dv.sum(0, keepdim=True).clamp_min(1e-12)
    div = (dw.unsqueeze(2) * logps).sum(0)
    return labels, div, has


def forward_flops(model: nn.Module, x: torch.Tensor) -> float:
    """Forward FLOPs per sample of ``model`` on inputs like ``x`` (counted on a copy, BN untouched)."""
    import copy

    m = copy.deepcopy(model).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        m(x[:4])
    return counter.get_total_flops() / max(int(x[:4].shape[0]), 1)


class FedET(Algorithm):
    name = "fedet"
    description = "Fed-ET: small heterogeneous client models, large server model by weighted consensus distillation"
    privacy = (
        Privacy(ServerView.MODELS,
                ('weighted consensus distillation runs every small model on public data and weighs it by its '
                 'own confidence'),
                central_dp=no("the consensus reads each model's predictions one by one"),
                local_dp=not_built('DP-SGD on the small-model step would make each model DP'),
                secagg=no('each model must be evaluated individually on the public set')),
    )
    server_data = "its server distils on an unlabelled public set taken from the clients' training data"

    @dataclass
    class Options:
        small_models: list = opt([], "client model specs, e.g. [{model: cnn-cifar, hidden: [120, 128]}]; client k "
                                 "uses entry k mod U; empty = the server model at half width_mult (or itself)")
        public_fraction: float = opt(0.1, "fraction of every client's training split held aside as the server's "
                                     "unlabelled public set", gt=0.0, lt=1.0)
        server_iters: int = opt(128, "server distillation SGD steps per round", ge=0)
        server_lr: float = opt(5e-3, "server distillation learning rate", gt=0.0)
        server_batch: int = opt(64, "server distillation batch size", ge=1)
        server_momentum: float = opt(0.0, "server distillation SGD momentum", ge=0.0, lt=1.0)
        diversity: float = opt(0.05, "λ of the diversity regularisation KL term", ge=0.0)
        transfer: str = opt("auto", "server → small models: head (shared representation layer, paper), distill "
                            "(KD on the public set), auto = head when widths match", choices=("auto", "head",
                                                                                              "distill"))
        back_iters: int = opt(32, "distillation steps per small model for transfer=distill", ge=0)

    def __init__(self, ctx: Any, options: Any = None) -> None:
        super().__init__(ctx, options)
        self.public: torch.Tensor | None = None
        self.specs = self._specs()
        self._cache: dict[int, nn.Module] = {}
        server = ctx.model({})
        self.head_name = server.head_name
        self.server_head = {k: tuple(v.shape) for k, v in server.state_dict().items()
                            if k.startswith(self.head_name + ".")}
        same = all(self._head_shapes(g) == self.server_head for g in range(len(self.specs)))
        mode = self.opt.transfer
        if mode == "auto":
            mode = "head" if same else "distill"
        if mode == "head" and not same:
            raise UserError("fedet transfer=head needs small models whose final layer has the server's shape "
                            f"{self.server_head}; set their width (e.g. cnn-cifar hidden) or use transfer=distill")
        self.mode = mode

    # ---- models ------------------------------------------------------------------------------------
    def _specs(self) -> list[dict[str, Any]]:
        from fedfuse.models import model_options

        if self.opt.small_models:
            out = []
            for s in self.opt.small_models:
                s = dict(s)
                out.append({"model": s.pop("model", self.ctx.model_name), **s})
            return out
        base = {"model": self.ctx.model_name, **self.ctx.model_options}
        if "width_mult" in model_options(self.ctx.model_name):
            base["width_mult"] = 0.5 * float(base.get("width_mult", 1.0))
        return [base]

    def small(self, g: int) -> nn.Module:
        """The (cached) module of small-model group ``g``, initialised from a seed."""
        if g not in self._cache:
            from fedfuse.models import build_model

            spec = dict(self.specs[g])
            name = spec.pop("model")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.ctx.seed + 1000 + g)
                self._cache[g] = build_model(name, self.ctx.input_shape, self.ctx.num_classes, task=self.ctx.task,
                                             **spec).to(self.ctx.device)
        return self._cache[g]

    def _head_shapes(self, g: int) -> dict[str, tuple[int, ...]]:
        m = self.small(g)
        return {k: tuple(v.shape) for k, v in m.state_dict().items() if k.startswith(m.head_name + ".")}

    def group(self, cid: int) -> int:
        return cid % len(self.specs)

    # ---- data ---------------------------------------------------------------------------------------
    def setup(self, fed: Federation) -> Federation:
        """Hold aside ``public_fraction`` of every client's training split as the unlabelled public set."""
        import dataclasses

        clients, public = [], []
        for c in fed.clients:
            n = len(c.train)
            k = round(self.opt.public_fraction * n)
            k = min(k, max(n - 1, 0))
            perm = torch.from_numpy(numpy_rng(self.ctx.seed, "fedet-public", c.cid).permutation(n))
            take, keep = perm[:k].to(c.train.x.device), perm[k:].to(c.train.x.device)
            public.append(c.train.x[take])
            clients.append(dataclasses.replace(c, train=Split(c.train.x[keep], c.train.y[keep])))
        self.public = torch.cat(public).to(self.ctx.device) if public else None
        return dataclasses.replace(fed, clients=clients, info={**fed.info, "public_size": int(sum(
            len(p) for p in public))})

    # ---- server hooks -------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        state = super().init_state()
        state["edge"] = [state_of(self.small(g)) for g in range(len(self.specs))]
        if self.mode == "head":  # the shared representation layer starts equal everywhere
            head = {k: v for k, v in state["global"].items() if k.startswith(self.head_name + ".")}
            state["edge"] = [{**e, **self._rename_head(head, g)} for g, e in enumerate(state["edge"])]
        return state

    def _rename_head(self, head: TensorDict, g: int) -> TensorDict:
        """Server head tensors under group ``g``'s head key names."""
        prefix = self.small(g).head_name + "."
        return {prefix + k.split(".", 1)[1]: v.clone() for k, v in head.items()}

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        return {c: Message(state["edge"][self.group(c)], {"group": self.group(c)}) for c in clients}

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """The standard step on the client's small model (its architecture group ``g``), replying with it."""
        g = int(payload.meta["group"])
        model = self.small(g)

        def finalize(st: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            return Message(st, {"group": g}, self.fit_stats(model, data, stats)), client_state

        return ClientProgram(model=model, init=dict(payload.tensors), spec=self.ctx.train,
                             finalize=finalize)

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results or self.public is None or not len(self.public):
            return state
        order = sorted(results)
        xp = self.public
        # 2-3: ensemble predictions on the public set
        logps, server_flops = self._ensemble(results, order, xp)
        labels, div, has = consensus_targets(logps)
        # 4: server model, representation layer = mean of the small models' (shared layer)
        server = self.ctx.load(state["global"])
        if self.mode == "head":
            server.load_state_dict({**state["global"], **self._mean_head(results, order)})
        gen = torch_generator(self.ctx.seed, "fedet-server", info.index)
        server_flops += self._distill(server, xp, labels, div, has, int(self.opt.server_iters), gen)
        new_global = state_of(server)
        # 5: groups' small models
        edge = list(state["edge"])
        for g in range(len(self.specs)):
            members = [c for c in order if int(results[c].meta["group"]) == g]
            edge[g], flops = self._edge_update(g, edge[g], [results[c] for c in members], server, new_global, gen)
            for f in flops:  # added one by one, as they are spent
                server_flops += f
        client = float(sum(results[c].stats.flops if results[c].stats is not None else 0.0 for c in order))
        diag = {
            "server_flops": server_flops,
            "flops_per_participant": (client + server_flops) / len(order),
            "client_flops_per_participant": client / len(order),
            "consensus_dissent": float(has.float().mean()),
            "public_size": len(xp),
            "small_model_parameters": float(np.mean([sum(p.numel() for p in self.small(g).parameters())
                                                     for g in range(len(self.specs))])),
        }
        return {**state, "global": new_global, "edge": edge, "diag": diag}

    def _ensemble(self, results: dict[int, Message], order: list[int], xp: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Every reply's log-probabilities on the public set, stacked (client, sample, class), and the FLOPs spent."""
        logps, flops = [], 0.0
        with torch.no_grad():
            for c in order:
                m = self.small(int(results[c].meta["group"]))
                m.load_state_dict(results[c].tensors)
                m.eval()
                logps.append(torch.cat([F.log_softmax(m(xp[i:i + 512]), 1) for i in range(0, len(xp), 512)]))
                flops += forward_flops(m, xp) * len(xp)
        return torch.stack(logps), flops

    def _mean_head(self, results: dict[int, Message], order: list[int]) -> TensorDict:
        """The server's representation layer: the mean of the replies' shared layers (matched by key suffix)."""
        heads = [{k: v for k, v in results[c].tensors.items()
                  if k.startswith(self.small(int(results[c].meta["group"])).head_name + ".")} for c in order]
        avg = {}
        for key in self.server_head:
            suffix = key.split(".", 1)[1]
            avg[key] = torch.stack([next(v for k, v in h.items() if k.endswith("." + suffix)) for h in heads]
                                   ).float().mean(0)
        return avg

    def _edge_update(self, g: int, edge: TensorDict, replies: list[Message], server: nn.Module,
                     new_global: TensorDict, gen: torch.Generator) -> tuple[TensorDict, list[float]]:
        """Group ``g``'s small model: its replies averaged, then the server's shared layer copied in ("head") or
        distilled from the server ("back_iters" > 0); returns it and the FLOPs spent (forward, distillation)."""
        if replies:
            edge = weighted_average([r.tensors for r in replies], [float(r.num_examples) for r in replies],
                                    base=edge)
        if self.mode == "head":
            head = {k: v for k, v in new_global.items() if k.startswith(self.head_name + ".")}
            return {**edge, **self._rename_head(head, g)}, []
        if self.opt.back_iters <= 0:
            return edge, []
        xp = self.public
        m = self.small(g)
        m.load_state_dict(edge)
        with torch.no_grad():
            server.eval()
            teacher = torch.cat([F.log_softmax(server(xp[i:i + 512]), 1) for i in range(0, len(xp), 512)])
        flops = [forward_flops(server, xp) * len(xp), self._kd(m, xp, teacher, int(self.opt.back_iters), gen)]
        return state_of(m), flops

    def _distill(self, server: nn.Module, x: torch.Tensor, labels: torch.Tensor, div: torch.Tensor,
                 has: torch.Tensor, iters: int, gen: torch.Generator) -> float:
        """Server steps on CE(consensus) + λ·KL(diversity target); returns the FLOPs spent."""
        if iters <= 0:
            return 0.0
        opt = torch.optim.SGD(server.parameters(), lr=float(self.opt.server_lr),
                              momentum=float(self.opt.server_momentum))
        server.train()
        bs = min(int(self.opt.server_batch), len(x))
        lam = float(self.opt.diversity)
        perm, pos = torch.randperm(len(x), generator=gen), 0
        for _ in range(iters):
            if pos + bs > len(x):
                perm, pos = torch.randperm(len(x), generator=gen), 0
            idx = perm[pos:pos + bs].to(x.device)
            pos += bs
            out = server(x[idx])
            loss = F.cross_entropy(out, labels[idx])
            h = has[idx]
            if lam > 0 and bool(h.any()):
                kl = F.kl_div(F.log_softmax(out[h], 1), F.softmax(div[idx][h], 1), reduction="batchmean")
                loss = loss + lam * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return train_flops_per_sample(server, x, labels, key=("fedet-server",)) * iters * bs

    def _kd(self, model: nn.Module, x: torch.Tensor, teacher: torch.Tensor, iters: int,
            gen: torch.Generator) -> float:
        opt = torch.optim.SGD(model.parameters(), lr=float(self.opt.server_lr))
        model.train()
        bs = min(int(self.opt.server_batch), len(x))
        for _ in range(iters):
            idx = torch.randint(0, len(x), (bs,), generator=gen).to(x.device)
            loss = F.kl_div(F.log_softmax(model(x[idx]), 1), teacher[idx], reduction="batchmean", log_target=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        y = teacher.argmax(1)
        return train_flops_per_sample(model, x, y, key=("fedet-small", json.dumps(self.specs, default=str))) \
            * iters * bs

    def diagnostics(self, state: ServerState, fed: Any, info: RoundInfo) -> dict[str, Any]:
        return dict(state.get("diag", {}))


__all__ = ["FedET", "consensus_targets", "forward_flops"]
