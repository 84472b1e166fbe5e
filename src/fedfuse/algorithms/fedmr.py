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
* **Secure recombination** (App. B, not in the author code, ``secure=True``): before upload the round's
  clients exchange layers in the four-stage peer protocol of :func:`fedfuse.fusion.recombine.secure_exchange`
  (run in the ``exchange`` hook, its bytes counted as peer traffic), so the server only receives recombined
  models; passes are repeated until no received model is any single client's trained model.  The server then
  applies its usual layer-wise recombination.
* **Diagnostics**: ``model_cosine`` — mean pairwise cosine similarity of the K uploaded (trained) models'
  parameters (paper Fig. 6) — in ``metrics.jsonl``, and ``fedmr_similarity.png`` at the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.algorithms.base import Algorithm, RoundInfo, ServerState
from fedfuse.fusion.average import clone_state, weighted_average
from fedfuse.fusion.recombine import (
    assemble,
    check_units,
    mean_pairwise_cosine,
    random_permutations,
    recombine,
    secure_exchange,
    segment_units,
    unit_bytes,
    units_from_layers,
)
from fedfuse.options import opt
from fedfuse.rng import numpy_rng
from fedfuse.types import Federation, Message, TensorDict


def model_units(model: torch.nn.Module, granularity: str = "module", segments: int = 0) -> list[tuple[str, ...]]:
    """Recombination units of ``model`` (its ``layers()`` or one unit per state key), optionally segmented."""
    layers = model.layers() if hasattr(model, "layers") else [(k,) for k in model.state_dict()]
    groups = [tuple(layer.keys) if hasattr(layer, "keys") else tuple(layer) for layer in layers]
    units = segment_units(units_from_layers(groups, granularity), segments)
    check_units(units, list(model.state_dict().keys()))
    return units


class FedMR(Algorithm):
    name = "fedmr"
    description = "FedMR: K slot models, layer-wise random recombination after every round (two-stage, FedMR-p)"
    echo_meta = ("slot",)  # the server notes which slot each reply trained (partial rounds keep the others)

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
        secure: bool = opt(False, "App. B client-side secure recombination before upload (not in the author code)")
        secure_send_prob: float = opt(0.5, "secure exchange: probability a client sends a given layer in stage 1",
                                      ge=0.0, le=1.0)
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

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        if self.in_warmup(info):
            msg = Message(state["global"])
            return {c: msg for c in clients}
        slots = self.slot_states(state)
        if len(clients) > len(slots):
            raise ValueError(f"{len(clients)} clients sampled but FedMR keeps {len(slots)} slots")
        return {c: Message(slots[i], {"slot": i}) for i, c in enumerate(sorted(clients))}

    def exchange(self, info: RoundInfo, results: dict[int, Message]) -> tuple[dict[int, Message], int]:
        """App. B secure recombination among the round's clients (recombination stage only)."""
        if not self.opt.secure or self.in_warmup(info) or len(results) < 2:
            return results, 0
        cids = sorted(results)
        states = [results[c].tensors for c in cids]
        units = self.units()
        rng = numpy_rng(self.ctx.seed, "fedmr-secure", info.index, info.stage)
        ex = secure_exchange(
            len(cids), len(units), rng, send_prob=float(self.opt.secure_send_prob),
            min_passes=int(self.opt.secure_min_passes),
        )
        mixed = assemble(states, units, ex.sources)
        moved = sum(unit_bytes(states[0], units[u]) for _, _, u in ex.messages)
        out = {}
        for j, c in enumerate(cids):
            meta = {**results[c].meta, "secure_sources": ex.sources[j].tolist(), "secure_passes": ex.passes}
            out[c] = Message(mixed[j], meta)
        return out, int(moved)

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        msgs = self.ordered(results)
        trained = [m.tensors for m in msgs]
        sim = mean_pairwise_cosine(trained, self.param_key_list())
        history = [*state.get("similarity", []), [info.index + 1, sim]]
        if self.in_warmup(info):
            weights = ([float(m.meta.get("num_examples", 1.0)) for m in msgs]
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
        new = recombine(trained, units, random_permutations(len(units), len(trained), rng))
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
