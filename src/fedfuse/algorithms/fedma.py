"""FedMA (Wang et al., ICLR 2020): layer-wise matched averaging with freezing and local retraining.

One communication round has ``K + 1`` stages for a network with ``K`` hidden layers (permutation groups of
:func:`~fedfuse.fusion.permute.chain_spec`) and a head:

* stage 0 — each client trains its full model (round 0: from its own initialisation, ``init="distinct"`` as
  in ``IBM/FedMA``'s ``init_models``; later rounds: the model of its *original* size rebuilt from the global
  model through its assignment maps, as in the code's ``fedma_comm``/``reconstruct_local_net``) and uploads
  hidden layer 1; the server matches it (BBP-MAP by default, :func:`~fedfuse.fusion.match.match_group`);
* stage ``s = 1..K-1`` — the server sends the matched layer ``s`` and the client's assignment; the client
  replaces its layer ``s`` by the global one, scatters its layer ``s+1`` input columns to the global width
  (zeros for global units it did not match; conv→fc inputs move in blocks of H·W), freezes layers ``≤ s``,
  retrains the layers above and uploads layer ``s+1``, which the server matches;
* stage ``K`` — same with the last hidden layer; only the head remains, retrained with the code's last-layer
  schedule (``lr/10``, weight decay 1e-4, 3× the retraining epochs); the server averages the heads
  class-wise (row ``c`` weighted by the clients' counts of class ``c``).

The global model may be wider than the clients' models (BBP-MAP grows layers): its widths travel in
``meta["model_options"]`` so ``ctx.model(meta)`` builds it.  Every client takes part in every round.
Communications: one round = ``K + 1`` server↔client exchanges in fedfuse; the L46 report counts one FedMA
round of a network with ``K`` hidden layers as ``K`` communications and, like ``IBM/FedMA``'s ``main.py``, does
not count round 0 (local training from distinct initialisations + the first layer-wise matching, the code's
``BBP_MAP``): the report's "FedMA after ``c`` rounds" is fedfuse round index ``c`` (``rounds = c + 1``); see
``docs/fedma.md``.  BBP-MAP hyper-parameters default to the code's hard-coded values (σ = 1, σ0 = 1, γ = 7,
5 iterations, cap 700); the global units are the posterior means (paper and code).

**Retraining** (``retrain_schedule``): ``"code"`` (default) follows ``IBM/FedMA``'s ``local_retrain``: SGD with
momentum 0.9 at ``retrain_lr`` for ``retrain_epochs`` epochs — both for the layer-wise stages and for the full
retraining at the start of rounds ≥ 1 (``fedma_comm``) — and, when only the head remains, lr/10, weight decay
1e-4 and 3× the epochs.  ``"run"`` reuses the run's optimiser (e.g. Adam) and, in rounds ≥ 1, ``local_epochs``
for the full retraining (the head schedule then follows ``last_layer_schedule``).  Too few retraining epochs
leave the frozen-layer stages unable to recover (measured in ``docs/fedma.md``).
Models: ``mlp``, ``simple-mlp``, ``cnn``, ``cnn-cifar`` (chains with per-layer width options).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, RunContext, ServerState, state_of
from fedfuse.engine.client import TrainConfig, TrainStats, class_counts, retrain_config
from fedfuse.engine.context import client_initial_state, seeded_state
from fedfuse.engine.program import ClientProgram
from fedfuse.fusion.match import MatchingOptions, class_weighted_average, match_group
from fedfuse.fusion.permute import PermGroup, chain_spec, gather, scatter_units
from fedfuse.models.base import layer_index
from fedfuse.models.registry import width_options
from fedfuse.options import opt
from fedfuse.rng import numpy_rng
from fedfuse.types import ClientData, Message, Privacy, ServerView, TensorDict, no, not_built


def base_sizes(ctx: RunContext) -> list[int]:
    return [g.size for g in chain_spec(ctx.model())]


class FedMA(Algorithm):
    name = "fedma"
    description = "FedMA: layer-wise BBP-MAP matched averaging with freezing and retraining (one stage per layer)"
    privacy = (
        Privacy(ServerView.MODELS,
                ("BBP-MAP matches every client's neurons to the global ones by their weights (one layer per "
                 'stage)'),
                central_dp=no("a client's neurons can open new global neurons: the matched average has no "
                               'bounded sensitivity'),
                local_dp=not_built('DP-SGD on the client step would protect the examples; matching still sees '
                                    'each model'),
                secagg=no('masked neurons are uniformly random vectors: there is no cost between them to match'
                           ' on')),
    )
    reply_kind = "other"  # replies are the client's own-size layers, not the (grown) global ones it was sent

    @dataclass
    class Options(MatchingOptions):
        init: str = opt("distinct", "round-0 client models: own seeded initialisations (code's init_models) or "
                        "one shared initialisation", choices=("distinct", "shared"))
        retrain_schedule: str = opt("code", "retraining optimiser: 'code' = IBM/FedMA local_retrain (SGD momentum "
                                    "0.9 at retrain_lr; head: lr/10, wd 1e-4, 3x epochs; rounds >= 1 retrain the "
                                    "full model for retrain_epochs) or 'run' = the run's optimiser and "
                                    "local_epochs", choices=("code", "run"))
        retrain_epochs: int = opt(7, "epochs of each retraining step (L46 report: 7; code default 10; 0 = none)",
                                  ge=0)
        retrain_lr: float = opt(0.0, "retraining learning rate of the 'code' schedule (0 = the run's lr; "
                                "code: --retrain_lr)", ge=0.0)
        last_layer_schedule: bool = opt(True, "'run' schedule only: head-only retraining at lr/10, wd 1e-4, "
                                        "3x epochs (always on with 'code')")

    def __init__(self, ctx: RunContext, options: Any | None = None) -> None:
        super().__init__(ctx, options)
        self.spec = chain_spec(ctx.model())
        self.head = ctx.model().head_keys()

    # ---- server ------------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        sizes = base_sizes(self.ctx)
        glob = seeded_state(self.ctx, self.ctx.seed)
        return {"global": glob, "sizes": sizes, "partial": {}, "partial_sizes": [], "assign": {}}

    def num_stages(self, state: ServerState, info: RoundInfo) -> int:
        return len(self.spec) + 1

    def select_clients(self, info: RoundInfo, rng: np.random.Generator) -> list[int]:
        return list(range(self.ctx.num_clients))  # FedMA matches every client's model

    def _opts(self, sizes: list[int]) -> dict[str, Any]:
        return {"model_options": width_options(self.ctx.model_name, sizes)}

    def global_model(self, state: ServerState) -> tuple[TensorDict, dict[str, Any]]:
        return state["global"], self._opts(state["sizes"])

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        s = info.stage
        if s == 0:
            if info.index == 0:  # local models start from their own initialisation: nothing is sent
                return {c: Message(meta={"stage": 0, "init": True}) for c in clients}
            msg = Message(state["global"], {**self._opts(state["sizes"]), "stage": 0})
            # a client missing from the last matching (dropout, late, quarantined) has no map from the global model
            # back to its own layers: it continues from its own last local model (partial rounds)
            own = Message(meta={"stage": 0, "own": True})
            return {c: msg if str(c) in state["assign"] else own for c in clients}
        g = self.spec[s - 1]
        tensors = {k: v for k, v in state["partial"].items() if k in g.keys("in") + g.keys("stat")}
        size = state["partial_sizes"][s - 1]
        return {
            c: Message(tensors, {"stage": s, "size": size, "assign": [int(i) for i in state["assign"][str(c)][s - 1]]})
            for c in clients
        }

    def _match_options(self) -> dict[str, Any]:
        o = self.opt
        return dict(method=o.matching, estimator=o.estimator, metric=o.metric, iters=o.iters, sigma=o.sigma,
                    sigma0=o.sigma0, gamma=o.gamma, cap=o.cap)

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        s, K = info.stage, len(self.spec)
        cids = sorted(results)
        weights = [float(results[c].num_examples) for c in cids]
        state = {**state}
        if s == 0:
            state["partial"], state["partial_sizes"], state["assign"] = {}, [], {str(c): [] for c in cids}
        if s < K:
            g = self.spec[s]
            gm = match_group([results[c].tensors for c in cids], g, weights=weights,
                             rng=numpy_rng(self.ctx.seed, "fedma-match", info.index, s), **self._match_options())
            state["partial"] = {**state["partial"], **gm.tensors}
            state["partial_sizes"] = [*state["partial_sizes"], gm.size]
            state["assign"] = {str(c): [*state["assign"][str(c)], gm.assign[i].tolist()] for i, c in enumerate(cids)}
            return state
        counts = [results[c].meta["class_counts"] for c in cids]
        head = class_weighted_average([results[c].tensors for c in cids], self.head, counts, weights)
        sizes = list(state["partial_sizes"])
        template = state_of(self.ctx.model(self._opts(sizes)))
        glob = {**template, **state["partial"], **head}
        state["global"], state["sizes"] = glob, sizes
        return state

    def diagnostics(self, state: ServerState, fed, info: RoundInfo) -> dict[str, Any]:
        return {"global_widths": list(state["sizes"])}

    # ---- client ------------------------------------------------------------------------------------
    def _retrain(self, last: bool) -> tuple[TrainConfig, int]:
        o = self.opt
        return retrain_config(self.ctx.train, o.retrain_schedule, o.retrain_epochs, o.retrain_lr, last=last,
                              last_layer_schedule=o.last_layer_schedule)

    def _frozen_keys(self, model: torch.nn.Module, group: PermGroup) -> set[str]:
        idx = layer_index(model)
        top = max(idx[k] for k in group.keys("in") + group.keys("stat"))
        return {k for k, _ in model.named_parameters() if idx[k] <= top}

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """One FedMA stage of a client as a declared program.

        Stage 0 trains the whole own-size model (from its initialisation, its own last base, or the global model
        rebuilt through the client's assignments).  Stage s ≥ 1 grows layer s−1 to the matched global size,
        loads the received matched layer and retrains only the layers above it: the layers up to the matched
        one are a frozen set (``trainable`` = the rest), under the retraining spec (the code's local_retrain:
        its own optimiser, epochs and, for the last stage, the head's schedule).  The finalize replies with the
        next layer to match (or the head) and the class counts."""
        s, K = int(payload.meta["stage"]), len(self.spec)
        cid = data.cid
        counts = class_counts(data, self.ctx.num_classes)
        trainable: frozenset[str] | None = None
        if s == 0:
            if payload.meta.get("init") or payload.meta.get("own"):
                own = payload.meta.get("own") and client_state is not None and "base" in client_state
                start = client_state["base"] if own else client_initial_state(self.ctx, cid, self.opt.init)
            else:  # rebuild the original-size model from the global one through this client's assignments
                start = dict(payload.tensors)
                gspec = chain_spec(self.ctx.model(payload.meta))
                for g, a in zip(gspec, client_state["assign"]):
                    start = gather(start, g, a)
            sizes = base_sizes(self.ctx)
            model = self.ctx.model(self._opts(sizes))
            if payload.meta.get("init") or self.opt.retrain_schedule == "run":
                spec = self.ctx.train
            else:  # the code's fedma_comm: full retraining with local_retrain's schedule
                cfg, epochs = self._retrain(last=False)
                spec = cfg.replace(local_epochs=epochs)
        else:
            sizes = list(client_state["sizes"])
            cur = client_state["model"]
            g = chain_spec(self.ctx.model(self._opts(sizes)))[s - 1]
            start = scatter_units(cur, g, payload.meta["assign"], int(payload.meta["size"]), roles=("out",))
            start.update(payload.tensors)
            sizes[s - 1] = int(payload.meta["size"])
            model = self.ctx.model(self._opts(sizes))
            frozen = self._frozen_keys(model, g)
            trainable = frozenset(k for k, _ in model.named_parameters() if k not in frozen)
            cfg, epochs = self._retrain(last=s == K)
            spec = cfg.replace(local_epochs=epochs)
        trained = sum(p.numel() for k, p in model.named_parameters() if trainable is None or k in trainable)

        def finalize(new_state: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            if s < K:
                g = chain_spec(model)[s]
                up = {k: new_state[k] for k in g.keys("in") + g.keys("stat")}
            else:
                up = {k: new_state[k] for k in self.head}
            fit = self.fit_stats(model, data, stats)
            fit.trained_params = int(trained)
            assign = list(client_state["assign"]) if client_state and "assign" in client_state else []
            if s > 0:  # keep this round's maps for the next round's rebuild
                assign = [*assign[: s - 1], list(payload.meta["assign"])]
            base = new_state if s == 0 else (client_state or {}).get("base")  # own-size model of the last stage 0
            new_client = {"model": new_state, "sizes": sizes, "assign": assign, "base": base}
            return Message(up, {"class_counts": counts}, fit), new_client

        return ClientProgram(model=model, init=start, spec=spec, finalize=finalize, trainable=trainable)
