"""Single-adapter LoRA baselines of FedMerge's foundation-model experiments (Chen et al.,
*FedMerge: Federated Model Merging for Personalization*, Baselines):

* ``fedit`` — FedIT (Zhang et al. 2024, "Towards building the federated GPT"): FedAvg over LoRA adapters.
  Server: one adapter; each sampled client trains it locally (frozen base) and sends it back; the server
  takes the sample-weighted average of A and B separately (what FedIT and the FedMerge code do; the product
  of averages is not the average of products — see docs/lora.md).  Personal model = the global adapter.
* ``fedlora`` — the papers' "FedLoRA" baseline (replaces FedAvg+): FedIT training, and before personalised
  evaluation each client fine-tunes the received global adapter on its own training split for ``ft_epochs``
  (not sent back).  (Yi et al.'s FedLoRA is a model-heterogeneous method; the FedMerge paper uses the name for
  FedIT + local fine-tuning, which is what this is.)
* ``local-lora`` — every client trains its own adapter, nothing is communicated.

All start from the same adapter (``A`` Kaiming-uniform from the run seed, ``B`` = 0), so the first merged or
averaged model is the base itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfuse.algorithms.base import ClientState, RoundInfo, ServerState
from fedfuse.algorithms.lora_base import LoraAlgorithm, LoraOptions, size_weights
from fedfuse.engine.client import TrainStats
from fedfuse.engine.program import ClientProgram
from fedfuse.fusion.average import weighted_average
from fedfuse.options import opt
from fedfuse.types import LOCAL_ONLY, ClientData, Message, Privacy, ServerView, TensorDict, not_built


class FedIT(LoraAlgorithm):
    name = "fedit"
    description = "FedIT: FedAvg of LoRA adapters on a frozen base LM (only A and B travel)"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                'FedAvg of the LoRA adapters A and B: only their sums are needed',
                central_dp=not_built('DP-FedAvg on the adapter updates would fit; not wired for LoRA runs'),
                local_dp=not_built('DP-SGD on the adapter parameters would fit; not wired for LoRA runs'),
                secagg=not_built('the adapter mean is a sum: masks would hide each adapter')),
    )

    @dataclass
    class Options(LoraOptions):
        pass

    def init_state(self) -> ServerState:
        return {"adapter": self.new_adapter("lora-init")}

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        msg = Message(state["adapter"])
        return {c: msg for c in clients}

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """Train the received global adapter on the frozen base; reply with the trained adapter."""
        def finalize(adapter: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            return Message(adapter, stats=self.adapter_stats(data, stats)), client_state

        return self.adapter_program(payload.tensors, data, finalize)

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        clients = sorted(results)
        state = self.tag_round(state, info)
        if not clients:
            return state
        states = [results[c].tensors for c in clients]
        return {**state, "adapter": weighted_average(states, size_weights(results, clients), base=state["adapter"])}

    def global_model(self, state: ServerState) -> None:
        return None  # the adapter is evaluated per client (configure_evaluate), not as a fedfuse model

    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]:
        msg = Message(state["adapter"], self.eval_meta(state))
        return {c: msg for c in clients}

    def server_parameters(self, state: ServerState) -> int:
        return self.adapter_parameters()

    def evaluate(self, payload: Message, client_state: ClientState, data: ClientData,
                 gen: torch.Generator) -> dict[str, float]:
        return self.evaluate_mixture(([payload.tensors], [1.0]), data, payload.meta)


class FedLoRA(FedIT):
    name = "fedlora"
    description = "FedLoRA (FedMerge's FedAvg+ for LoRA): FedIT, then local adapter fine-tuning before evaluation"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                "FedIT's adapter sum; the fine-tuning before evaluation stays on the client",
                central_dp=not_built('DP-FedAvg on the adapter updates would fit; not wired for LoRA runs'),
                local_dp=not_built('DP-SGD on the adapter parameters would fit; not wired for LoRA runs'),
                secagg=not_built('the adapter mean is a sum: masks would hide each adapter')),
    )

    @dataclass
    class Options(LoraOptions):
        ft_epochs: int = opt(1, "local fine-tuning epochs of the global adapter before evaluation", ge=0)
        ft_lr: float = opt(0.0, "fine-tuning learning rate (0 = the run's local learning rate)", ge=0.0)

    def evaluate(self, payload: Message, client_state: ClientState, data: ClientData,
                 gen: torch.Generator) -> dict[str, float]:
        adapter = payload.tensors
        if self.opt.ft_epochs > 0:
            adapter, _ = self.train_adapter(adapter, data, gen, epochs=int(self.opt.ft_epochs),
                                            lr=float(self.opt.ft_lr) or None)
        return self.evaluate_mixture(([adapter], [1.0]), data, payload.meta)


class LocalLoRA(LoraAlgorithm):
    name = "local-lora"
    description = "Local LoRA: each client fine-tunes its own adapter (no communication)"
    privacy = (LOCAL_ONLY,)

    @dataclass
    class Options(LoraOptions):
        pass

    def init_state(self) -> ServerState:
        return {}

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        return {c: Message(meta={"init_seed": self.ctx.seed}) for c in clients}  # a shared seed, not a transfer

    def _own(self, client_state: ClientState) -> dict[str, torch.Tensor]:
        return client_state["adapter"] if client_state else self.new_adapter("lora-init")

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """Train the client's own adapter; it stays in the client state, nothing is uploaded."""
        def finalize(adapter: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            return Message(stats=self.adapter_stats(data, stats)), {"adapter": adapter}

        return self.adapter_program(self._own(client_state), data, finalize)

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        return self.tag_round(state, info)

    def global_model(self, state: ServerState) -> None:
        return None

    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]:
        return {c: Message(meta=self.eval_meta(state)) for c in clients}

    def server_parameters(self, state: ServerState) -> int:
        return 0

    def evaluate(self, payload: Message, client_state: ClientState, data: ClientData,
                 gen: torch.Generator) -> dict[str, float]:
        return self.evaluate_mixture(([self._own(client_state)], [1.0]), data, payload.meta)
