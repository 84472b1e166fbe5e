"""FedMA's baselines on the same local models: one-shot averaging, one-shot matching, ensemble.

Each client trains its own model (``init="distinct"``: its own initialisation, as ``IBM/FedMA``'s
``init_models``; ``"shared"``: one common initialisation) for ``local_epochs`` per round, continuing from its
own model in later rounds; nothing flows back to the clients.  With the same seed, ``fedma``'s round-0
stage-0 models are bit-identical to these local models.  After each round the server fuses the uploads:

* ``oneshot-avg`` — sample-weighted element-wise average (BN statistics averaged, ``num_batches_tracked`` max).
  ``continuation="fedavg"`` turns it into the FedAvg baseline of ``IBM/FedMA``'s ``main.py`` (``fedavg_comm``)
  and of the L46 report: round 0 is the one-shot average of the independently trained local models (the
  report does not count it as a communication), every later round is a FedAvg round started from the global
  average, trained with the code's retraining schedule (SGD momentum 0.9 at ``retrain_lr``, weight decay 1e-4,
  ``retrain_epochs``; ``retrain_schedule="run"``: the run's optimiser and ``local_epochs``).  ``fedavg`` with
  its one shared initialisation is the other, equally legitimate, form;
* ``oneshot-match`` — layer-wise matching without retraining (:func:`~fedfuse.fusion.match.match_network`:
  BBP-MAP by default, or Hungarian; FedMA's class-weighted last layer);
* ``ensemble`` — no single model: predictions are the average of the client models' softmax probabilities.
  The loop's global evaluation needs one model, so the ensemble's global-test numbers are reported by
  ``diagnostics`` as ``ensemble_accuracy`` / ``ensemble_loss``; personalised evaluation uses the ensemble too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState, evaluate_splits
from fedfuse.engine.client import TrainConfig, TrainStats, class_counts, evaluate_model, retrain_config
from fedfuse.engine.context import client_initial_state
from fedfuse.engine.program import ClientProgram
from fedfuse.fusion.average import weighted_average
from fedfuse.fusion.match import MatchingOptions, match_network
from fedfuse.fusion.permute import chain_spec, group_sizes
from fedfuse.models.registry import width_options
from fedfuse.options import opt
from fedfuse.rng import numpy_rng
from fedfuse.types import ClientData, Message, Privacy, ServerView, TensorDict, no, not_built


class _LocalModels(Algorithm):
    """Clients train their own models and upload them; subclasses fuse the uploads."""

    @dataclass
    class Options:
        init: str = opt("distinct", "client models start from their own seeded initialisations (IBM/FedMA "
                        "init_models) or one shared initialisation", choices=("distinct", "shared"))

    def select_clients(self, info: RoundInfo, rng: np.random.Generator) -> list[int]:
        return list(range(self.ctx.num_clients))

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        return {c: Message(meta={"init": self.opt.init}) for c in clients}  # nothing is downloaded

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """Train the client's own model (its seeded initialisation the first time) with the run's local spec;
        reply with it and the client's class counts, and keep it."""
        start = client_state["model"] if client_state else client_initial_state(self.ctx, data.cid, self.opt.init)
        return self._program(start, self.ctx.train, data)

    def _program(self, start: TensorDict, spec: TrainConfig, data: ClientData) -> ClientProgram:
        model = self.ctx.model({})
        counts = class_counts(data, self.ctx.num_classes)

        def finalize(st: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            return Message(st, {"class_counts": counts}, self.fit_stats(model, data, stats)), {"model": st}

        return ClientProgram(model=model, init=dict(start), spec=spec, finalize=finalize)


class OneShotAverage(_LocalModels):
    name = "oneshot-avg"
    description = ("One-shot averaging of independently trained local models; continuation=fedavg: FedAvg "
                   "started from that average (IBM/FedMA's and the L46 report's FedAvg baseline)")
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                'one average of the locally trained models (a sum), then optionally FedAvg',
                central_dp=not_built('one Gaussian-noised mean of clipped models would do; not wired'),
                local_dp=not_built('DP-SGD on the local training would do; not wired'),
                secagg=not_built('the single mean is a sum: masks would hide each model')),
    )

    @dataclass
    class Options(_LocalModels.Options):
        continuation: str = opt("local", "after round 0: 'local' = clients keep training their own models "
                                "(one-shot averaging every round); 'fedavg' = FedAvg rounds from the average "
                                "(IBM/FedMA fedavg_comm, the L46 report's FedAvg)", choices=("local", "fedavg"))
        retrain_schedule: str = opt("code", "continuation=fedavg rounds: 'code' = SGD momentum 0.9, weight decay "
                                    "1e-4 at retrain_lr for retrain_epochs (IBM/FedMA local_retrain_fedavg); "
                                    "'run' = the run's optimiser and local_epochs", choices=("code", "run"))
        retrain_epochs: int = opt(7, "epochs per continuation=fedavg round with the 'code' schedule (L46 report: 7)",
                                  ge=0)
        retrain_lr: float = opt(0.0, "learning rate of the 'code' schedule (0 = the run's lr)", ge=0.0)

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        if self.opt.continuation == "fedavg" and info.index > 0:
            msg = Message(state["global"], {"continue": True})
            return {c: msg for c in clients}
        return super().configure_fit(state, info, clients)

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """The local models' step; in the FedAvg continuation, the received average retrained with the
        continuation's schedule (the code's local_retrain, or the run's optimiser)."""
        if not payload.meta.get("continue"):
            return super().client_program(payload, client_state, data)
        o = self.opt
        if o.retrain_schedule == "code":
            cfg, epochs = retrain_config(self.ctx.train, "code", o.retrain_epochs, o.retrain_lr, weight_decay=1e-4)
        else:
            cfg, epochs = retrain_config(self.ctx.train, "run", self.ctx.train.local_epochs)
        return self._program(payload.tensors, cfg.replace(local_epochs=epochs), data)

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        cids = sorted(results)
        weights = [float(results[c].num_examples) for c in cids]
        avg = weighted_average([results[c].tensors for c in cids], weights)
        return {**state, "global": avg}


class OneShotMatching(_LocalModels):
    name = "oneshot-match"
    description = "One-shot matching: layer-wise BBP-MAP (or Hungarian) matched averaging, no retraining"
    privacy = (
        Privacy(ServerView.MODELS,
                "layer-wise matching (BBP-MAP or Hungarian) compares every client's neurons",
                central_dp=no('matched averaging has no bounded sensitivity to one client'),
                local_dp=not_built('DP-SGD on the local training would protect the examples; matching still '
                                    'sees each model'),
                secagg=no('masked neurons cannot be matched')),
    )

    @dataclass
    class Options(_LocalModels.Options, MatchingOptions):
        pass

    def init_state(self) -> ServerState:
        return {**super().init_state(), "sizes": group_sizes(chain_spec(self.ctx.model()))}

    def global_model(self, state: ServerState) -> tuple[TensorDict, dict[str, Any]]:
        return state["global"], {"model_options": width_options(self.ctx.model_name, state["sizes"])}

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        cids = sorted(results)
        o = self.opt
        glob, sizes, _ = match_network(
            [results[c].tensors for c in cids], chain_spec(self.ctx.model()), self.ctx.model().head_keys(),
            class_counts=[results[c].meta["class_counts"] for c in cids],
            weights=[float(results[c].num_examples) for c in cids],
            method=o.matching, estimator=o.estimator, metric=o.metric, iters=o.iters, sigma=o.sigma,
            sigma0=o.sigma0, gamma=o.gamma, cap=o.cap, rng=numpy_rng(self.ctx.seed, "oneshot-match", info.index),
        )
        return {**state, "global": glob, "sizes": sizes}

    def diagnostics(self, state: ServerState, fed, info: RoundInfo) -> dict[str, Any]:
        return {"global_widths": list(state["sizes"])}


class Ensemble(_LocalModels):
    name = "ensemble"
    description = "Ensemble of the local models: average of their predicted probabilities (no single global model)"
    privacy = (
        Privacy(ServerView.MODELS,
                'the ensemble is the set of local models itself: the server holds each one',
                central_dp=no('there is no sum to noise: every model is kept'),
                local_dp=not_built('DP-SGD on the local training would make each released model DP'),
                secagg=no('the server must hold each model individually')),
    )
    server_data = "it has no global model; its only measure, the ensemble's accuracy, is taken on the server's test set"

    def init_state(self) -> ServerState:
        return {"members": {}}

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        return {"members": {str(c): results[c].tensors for c in sorted(results)}}

    def global_model(self, state: ServerState) -> None:
        return None

    def server_parameters(self, state: ServerState) -> int:
        keys = self.ctx.param_keys()
        return int(sum(v.numel() for m in state["members"].values() for k, v in m.items() if k in keys))

    def _predict(self, members: list[TensorDict]):
        models = []
        for st in members:
            with torch.random.fork_rng(devices=[]):
                m = self.ctx.build()
            m.load_state_dict(st)
            m.eval()
            models.append(m)

        @torch.no_grad()
        def predict(x: torch.Tensor) -> torch.Tensor:
            return torch.stack([torch.softmax(m(x), -1) for m in models]).mean(0)

        return models, predict

    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]:
        tensors = {f"{c}/{k}": v for c, m in state["members"].items() for k, v in m.items()}
        return {c: Message(tensors) for c in clients}

    def evaluate(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> dict[str, float]:
        members: dict[str, TensorDict] = {}
        for key, v in payload.tensors.items():
            c, k = key.split("/", 1)
            members.setdefault(c, {})[k] = v
        if not members:
            return evaluate_splits(self.ctx.load(client_state["model"]), data, self.ctx.eval_batch_size)
        models, predict = self._predict(list(members.values()))
        return evaluate_splits(models[0], data, self.ctx.eval_batch_size, predict)

    def diagnostics(self, state: ServerState, fed, info: RoundInfo) -> dict[str, Any]:
        if not state["members"]:
            return {}
        models, predict = self._predict(list(state["members"].values()))
        st = evaluate_model(models[0], fed.test, self.ctx.eval_batch_size, predict)
        return {"ensemble_accuracy": st.accuracy, "ensemble_loss": st.loss}
