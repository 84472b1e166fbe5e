"""pFedMoE (Yi et al. 2024, "FedMoE: data-level personalization with mixture of experts for
model-heterogeneous personalized federated learning"; no official code found — built from the paper's
description as summarised in the FedMerge spec).

Each client holds a *local expert* (a feature extractor of the run's architecture), a local *head*, and a
local *gate*; the server holds one shared *global expert* (the same feature extractor, no head).  For an input
x the gate gives two weights (g_global, g_local) = softmax(gate(x)) (a linear layer on the flattened input,
or an MLP with ``gate_hidden`` units); the head classifies g_global·z_global(x) + g_local·z_local(x).
Everything is trained jointly on the client's cross-entropy; only the global expert travels (down and up)
and the server averages it n-weighted (full state, BN buffers included, ``num_batches_tracked``: max).
The local expert, head and gate stay on the client (client state; the local model is initialised per
client from the run seed and the client id).

Client cost: two feature extractors, a head and a gate are trained (``trained_params``; FLOPs of the whole
mixture per sample), one extractor is communicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState, evaluate_splits, state_of
from fedfuse.engine.client import TrainStats, train_flops_per_sample
from fedfuse.engine.context import seeded_state
from fedfuse.engine.program import ClientProgram
from fedfuse.fusion.average import weighted_average
from fedfuse.options import opt
from fedfuse.rng import derive_seed
from fedfuse.types import ClientData, FitStats, Message, Privacy, ServerView, TensorDict, not_built


class MoE(nn.Module):
    """Global expert + local expert mixed by an input gate, classified by the local model's head."""

    def __init__(self, global_expert: nn.Module, local_model: nn.Module, gate: nn.Module) -> None:
        super().__init__()
        self.global_expert = global_expert
        self.local_model = local_model
        self.gate = gate

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.gate(x.flatten(1)), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gates(x)
        z = g[:, :1] * self.global_expert.features(x) + g[:, 1:] * self.local_model.features(x)
        return self.local_model.head(z)


def make_gate(in_features: int, hidden: int) -> nn.Module:
    if hidden > 0:
        return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    return nn.Linear(in_features, 2)


class PFedMoE(Algorithm):
    name = "pfedmoe"
    description = "pFedMoE: shared global expert + local expert, per-client gate and head; only the expert travels"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                'only the global expert travels and is n-weighted averaged: a sum',
                central_dp=not_built('DP-FedAvg on the expert updates would fit; not wired'),
                local_dp=not_built('DP-SGD on the joint step would fit (gate and local expert too)'),
                secagg=not_built('the expert mean is a sum: masks would hide each expert')),
    )

    @dataclass
    class Options:
        gate_hidden: int = opt(0, "hidden units of the gate MLP; 0 = a linear gate on the flattened input", ge=0)

    def __init__(self, ctx, options=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(ctx, options)
        ref = ctx.model()
        self.head_keys = set(ref.head_keys())
        self.in_features = int(torch.tensor(ctx.input_shape).prod())
        self._moe: MoE | None = None

    # ---- model plumbing ------------------------------------------------------------------------
    def moe(self) -> MoE:
        if self._moe is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                self._moe = MoE(self.ctx.build(), self.ctx.build(),
                                make_gate(self.in_features, self.opt.gate_hidden)).to(self.ctx.device)
        return self._moe

    def expert_state(self, full: TensorDict) -> TensorDict:
        return {k: v for k, v in full.items() if k not in self.head_keys}

    def _local_init(self, cid: int) -> ClientState:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.ctx.seed, "pfedmoe-local", cid))
            local = state_of(self.ctx.build())
            gate = state_of(make_gate(self.in_features, self.opt.gate_hidden).to(self.ctx.device))
        return {"local": local, "gate": gate}

    def _load(self, payload: Message, client_state: ClientState) -> MoE:
        moe = self.moe()
        ge = moe.global_expert
        missing = ge.load_state_dict(payload.tensors, strict=False).missing_keys
        if set(missing) - self.head_keys:
            raise KeyError(f"global expert payload lacks {sorted(set(missing) - self.head_keys)[:3]}")
        moe.local_model.load_state_dict(client_state["local"])  # type: ignore[index]
        moe.gate.load_state_dict(client_state["gate"])  # type: ignore[index]
        return moe

    def trainable(self, moe: MoE) -> list[nn.Parameter]:
        ge = [p for k, p in moe.global_expert.named_parameters() if k not in self.head_keys]
        return ge + list(moe.local_model.parameters()) + list(moe.gate.parameters())

    # ---- server --------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        return {"expert": self.expert_state(seeded_state(self.ctx, self.ctx.seed))}

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        msg = Message(state["expert"])
        return {c: msg for c in clients}

    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]:
        msg = Message(state["expert"])
        return {c: msg for c in clients}

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        cs = sorted(results)
        avg = weighted_average([results[c].tensors for c in cs],
                               [float(results[c].num_examples) for c in cs], base=state["expert"])
        return {**state, "expert": avg}

    def global_model(self, state: ServerState) -> None:
        return None  # the global expert has no head

    def server_parameters(self, state: ServerState) -> int:
        keys = {k for k, _ in self.ctx.model().named_parameters()}
        return int(sum(v.numel() for k, v in state["expert"].items() if k in keys))

    # ---- client --------------------------------------------------------------------------------
    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """The client step as a declared program: the MoE module (received global expert, the client's local
        model and gate) trained with the run's local spec; the global expert's head is outside the trainable
        set (it never travels).  The finalize sends the global expert and keeps the local model and gate."""
        cs = client_state or self._local_init(data.cid)
        moe = self._load(payload, cs)
        init = {k: v.detach().clone() for k, v in moe.state_dict().items()}
        ids = {id(p) for p in self.trainable(moe)}
        trainable = frozenset(k for k, p in moe.named_parameters() if id(p) in ids)
        n_trained = int(sum(p.numel() for k, p in moe.named_parameters() if k in trainable))

        def finalize(state: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            flops = 0.0
            if stats.samples:
                flops = train_flops_per_sample(moe, data.train.x, data.train.y, key=("pfedmoe", self.ctx.model_name))
            fit = FitStats(num_examples=len(data.train), samples=stats.samples, steps=stats.steps,
                           train_loss=stats.mean_loss, flops=float(flops * stats.samples), trained_params=n_trained)
            part = {name: {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
                    for name in ("global_expert", "local_model", "gate")}
            return (Message(self.expert_state(part["global_expert"]), stats=fit),
                    {"local": part["local_model"], "gate": part["gate"]})

        return ClientProgram(model=moe, init=init, spec=self.ctx.train, finalize=finalize,
                             trainable=trainable)

    def evaluate(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> dict[str, float]:
        moe = self._load(payload, client_state or self._local_init(data.cid))
        return evaluate_splits(moe, data, self.ctx.eval_batch_size)
