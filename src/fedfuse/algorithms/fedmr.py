"""FedMR (Hu et al., "FedMR: Federated Learning via Model Recombination"): layer-wise model recombination.

The server keeps ``K`` intermediate models (*slots*, ``K`` = clients per round), all starting from the same
initial model.  Slots are not tied to clients: in every round the i-th sampled client (sorted ids) trains
slot i.  After local training the server recombines the uploaded models: for every layer it draws an
independent uniform permutation of the ``K`` models and new model j takes that layer from model
``perm[j]`` (Algorithm 1, §4.2.2) — every uploaded layer is used by exactly one recombined model.

* **Layers** are modules with all their parameters *and* buffers (paper: "decomposes received local models
  into multiple layers"); BN statistics stay with their affine parameters.  The author code shuffles each
  ``state_dict`` key independently: ``granularity="key"``.
* **Two-stage training** (§4.3): the first ``warmup_rounds`` rounds are FedAvg (average of the full state,
  ``num_batches_tracked`` = max, everyone receives the global model); recombination starts from the
  pre-trained model afterwards.  Paper: none for the 4-layer CNN, 100 rounds for ResNet-20/VGG-16; author
  code: ``--first_stage_bound``, default 0.  The warm-up average is *uniform* over the K uploads, as the
  author code does (its ``Aggregation(w_locals, None)``); ``warmup_weighting="samples"`` is the
  sample-weighted FedAvg form.
* **FedMR-p** (§5.4.2): ``segments=p`` recombines p contiguous segments of layers instead of single layers;
  ``p = 1`` only re-dispatches whole models (the paper's "Indep" with shuffling); 0 = layer-wise.
* **Global model** (evaluation/deployment): the uniform average of the K intermediate models (paper Alg. 1
  l. 11 and the author code); BN statistics are averaged and ``num_batches_tracked`` takes the max.
* **Secure recombination** (App. B, not in the author code, ``secure=True``): a three-stage round in which
  the server never receives any client's own trained model (:mod:`fedfuse.algorithms.fedmr_secure`).
* **Diagnostics**: ``model_cosine`` — mean pairwise cosine similarity of the K uploaded (trained) models'
  parameters (paper Fig. 6) — in ``metrics.jsonl``, and ``fedmr_similarity.png`` at the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.algorithms.base import ClientState, RoundInfo, ServerState
from fedfuse.algorithms.fedmr_secure import SecureRecombination
from fedfuse.engine.peers import route_peers
from fedfuse.engine.program import ClientProgram, run_program
from fedfuse.fusion.average import clone_state, weighted_average
from fedfuse.fusion.recombine import (
    check_units,
    mean_pairwise_cosine,
    random_unit_permutations,
    recombine,
    segment_units,
    units_from_layers,
)
from fedfuse.options import opt
from fedfuse.rng import numpy_rng
from fedfuse.types import ClientData, Federation, Message, Privacy, ServerView, TensorDict, no, yes


def model_units(model: torch.nn.Module, granularity: str = "module", segments: int = 0) -> list[tuple[str, ...]]:
    """Recombination units of ``model`` (its ``layers()`` or one unit per state key), optionally segmented."""
    layers = model.layers() if hasattr(model, "layers") else [(k,) for k in model.state_dict()]
    groups = [tuple(layer.keys) if hasattr(layer, "keys") else tuple(layer) for layer in layers]
    units = segment_units(units_from_layers(groups, granularity), segments)
    check_units(units, list(model.state_dict().keys()))
    return units


class FedMR(SecureRecombination):
    name = "fedmr"
    description = "FedMR: K slot models, layer-wise random recombination after every round (two-stage, FedMR-p)"
    privacy = (
        Privacy(ServerView.MODELS,
                'the server recombines the layers of individual trained models into new ones',
                central_dp=no("each recombined model is made of single clients' layers: nothing is averaged to"
                               ' hide them'),
                local_dp=yes('DP-SGD on the client step (Opacus) makes each uploaded model (ε, δ)-DP with respect '
                             "to its client's examples; recombining DP models is post-processing"),
                secagg=no('a masked layer is random: recombining masked layers gives no usable model')),
        Privacy(ServerView.MODELS,
                ("secure=true: the server never gets a client's own model, but every uploaded layer is still "
                 "some client's trained layer"),
                central_dp=no("the uploads still carry single clients' layers; only who trained which is "
                               'hidden'),
                local_dp=yes('DP-SGD on the client step makes the model whose layers are exchanged (ε, δ)-DP; the '
                             'exchange and recombination are post-processing'),
                secagg=no('the peer exchange hides which client trained a layer (unlinkability), not the layer'
                           ' values'),
                when=(("secure", True),)),
    )
    echo_meta = ("slot",)  # the server notes which slot each reply trained (partial rounds keep the others)
    node_private = ("secure",)  # secure mode's trained model and private key never leave a Flower node

    @dataclass
    class Options:
        granularity: str = opt(
            "module", "recombination unit: 'module' = a layer with its buffers (paper); 'key' = every "
            "state-dict key on its own (author code, splits BN statistics from their affine parameters)",
            choices=("module", "key"))
        segments: int = opt(0, "FedMR-p: 0 = layer-wise; p >= 1 recombines p contiguous segments "
                            "(1 = re-dispatch whole models only)", ge=0)
        warmup_rounds: int = opt(0, "two-stage training: FedAvg rounds before recombination starts "
                                 "(paper: 0 for the CNN, 100 for ResNet-20/VGG-16; code --first_stage_bound)", ge=0)
        warmup_weighting: str = opt(
            "uniform", "warm-up averaging: 'uniform' over the K uploads (author code) or 'samples' "
            "(sample-weighted FedAvg)", choices=("uniform", "samples"))
        secure: bool = opt(False, "App. B client-side secure recombination before upload (not in the author code): "
                                  "three stages per round, layers travel encrypted client to client")
        secure_send_prob: float = opt(0.5, "secure exchange plan: probability a client sends a given layer in the "
                                      "first step of an App. B pass", ge=0.0, le=1.0)
        secure_min_passes: int = opt(1, "secure exchange: minimum number of exchange passes per round", ge=1)
        int_policy: str = opt("max", "num_batches_tracked in averages (warm-up, global model)",
                              choices=("max", "sum", "first"))

    # ---- helpers -------------------------------------------------------------------------------
    @property
    def k(self) -> int:
        return min(self.ctx.clients_per_round, self.ctx.num_clients)

    def units(self) -> list[tuple[str, ...]]:
        if not hasattr(self, "_units"):
            self._units = model_units(self.ctx.model(), self.opt.granularity, int(self.opt.segments))
        return self._units

    def param_key_list(self) -> list[str]:
        keys = self.ctx.param_keys()
        return [k for k in self.ctx.model().state_dict() if k in keys]

    def in_warmup(self, info: RoundInfo) -> bool:
        return info.index < int(self.opt.warmup_rounds)

    @staticmethod
    def ordered(results: dict[int, Message]) -> list[Message]:
        return [results[c] for c in sorted(results)]

    # ---- server hooks --------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        state = super().init_state()
        state["slots"] = None  # None = every slot equals state["global"] (start, warm-up)
        state["similarity"] = []
        return state

    def slot_states(self, state: ServerState) -> list[TensorDict]:
        if state.get("slots") is None:
            return [state["global"]] * self.k
        return state["slots"]

    def secure_round(self, info: RoundInfo) -> bool:
        return bool(self.opt.secure) and not self.in_warmup(info)

    def num_stages(self, state: ServerState, info: RoundInfo) -> int:
        """Secure rounds: 0 train (metadata up), 1 encrypted unit exchange, 2 upload recombined models."""
        return 3 if self.secure_round(info) else 1

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        if self.in_warmup(info):
            msg = Message(state["global"])
            return {c: msg for c in clients}
        if self.secure_round(info) and info.stage > 0:
            return self.secure_payloads(state, info, clients)
        slots = self.slot_states(state)
        if len(clients) > len(slots):
            raise ValueError(f"{len(clients)} clients sampled but FedMR keeps {len(slots)} slots")
        extra = {"secure_stage": 0, "round": info.index} if self.secure_round(info) else {}
        return {c: Message(slots[i], {"slot": i, **extra}) for i, c in enumerate(sorted(clients))}

    def exchange(self, info: RoundInfo, results: dict[int, Message]) -> tuple[dict[int, Message], int]:
        """Secure stage 1: relay the clients' encrypted envelopes (bytes = ciphertext handed to the relay)."""
        if self.secure_round(info) and info.stage == 1:
            return route_peers(results)
        return results, 0

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        if self.secure_round(info):
            if info.stage == 0:
                return self.secure_plan(state, info, results)
            if info.stage == 1:
                return self.settle_plan(state, info, results)
            state = {k: v for k, v in state.items() if k != "secure"}  # stage 2: the uploads, fused as below
        msgs = self.ordered(results)
        trained = [m.tensors for m in msgs]
        sim = mean_pairwise_cosine(trained, self.param_key_list())
        history = [*state.get("similarity", []), [info.index + 1, sim]]
        if self.in_warmup(info):
            weights = ([float(m.num_examples) for m in msgs]
                       if self.opt.warmup_weighting == "samples" else None)
            g = weighted_average(trained, weights, base=state["global"],  # type: ignore[arg-type]
                                 int_policy=self.opt.int_policy)
            return {**state, "global": g, "slots": None, "similarity": history}
        slots = self.slot_states(state)
        if len(trained) < len(slots):  # fewer uploads than slots (dropouts): untouched slots keep their models
            got = {int(m.meta["slot"]): m.tensors for m in msgs if "slot" in m.meta}
            if len(got) == len(trained):
                trained = [got[i] if i in got else clone_state(s) for i, s in enumerate(slots)]
            else:
                trained = trained + [clone_state(s) for s in slots[len(trained):]]
        rng = numpy_rng(self.ctx.seed, "fedmr-recombine", info.index)
        units = self.units()
        new = recombine(trained, units, random_unit_permutations(len(units), len(trained), rng))
        g = self.average(new)
        return {**state, "global": g, "slots": new, "similarity": history}

    def average(self, states: list[TensorDict]) -> TensorDict:
        """Uniform average of the intermediate models (the deployed global model)."""
        if len(states) == 1:
            return clone_state(states[0])
        return weighted_average(states, None, int_policy=self.opt.int_policy)  # type: ignore[arg-type]

    def global_model(self, state: ServerState) -> tuple[TensorDict, dict[str, Any]] | None:
        return state["global"], {}

    def server_parameters(self, state: ServerState) -> int:
        keys = self.ctx.param_keys()
        n = sum(v.numel() for k, v in state["global"].items() if k in keys)
        return int(n * (1 if state.get("slots") is None else len(state["slots"])))

    # ---- client hooks ------------------------------------------------------------------------------
    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram | None:
        """The standard local step; in secure stage 0 the trained model stays with the client (only metadata
        and a fresh public key go up); secure stages 1 and 2 train nothing (``fit`` runs them)."""
        stage = payload.meta.get("secure_stage")
        if stage not in (None, 0):
            return None
        return self._program(payload, client_state, data)

    def _program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        stage = payload.meta.get("secure_stage")
        program = self.standard_program(payload, client_state, data)
        if stage is None:
            return program
        return self.secure_keep(program, int(payload.meta["round"]))

    def fit(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> tuple[Message, ClientState]:
        stage = payload.meta.get("secure_stage")
        if stage == 1:
            return self.secure_send(payload, client_state, data.cid)
        if stage == 2:
            return self.secure_assemble(payload, client_state, data.cid)
        return run_program(self._program(payload, client_state, data), data, gen)

    # ---- diagnostics ---------------------------------------------------------------------------
    def diagnostics(self, state: ServerState, fed: Federation, info: RoundInfo) -> dict[str, Any]:
        hist = state.get("similarity") or []
        return {"model_cosine": hist[-1][1] if hist else None}

    def finish(self, state: ServerState, fed: Federation, out_dir: Path) -> None:
        hist = [(r, s) for r, s in state.get("similarity") or [] if s is not None]
        if not hist:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        r, s = np.array(hist).T
        ax.plot(r, s)
        ax.set_xlabel("round")
        ax.set_ylabel("mean pairwise cosine")
        ax.set_title(f"{self.name}: similarity of the K trained models")
        fig.tight_layout()
        fig.savefig(out_dir / "fedmr_similarity.png", dpi=110)
        plt.close(fig)
