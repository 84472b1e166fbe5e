"""Local training only: every client trains its own model; nothing is communicated.

All client models start from the same initial model (seeded), so differences come from data alone.
There is no global model; personalised accuracy is each client's own model on its own test split.
"""

from __future__ import annotations

import torch

from fedfuse.algorithms.base import (
    Algorithm,
    ClientState,
    RoundInfo,
    ServerState,
    evaluate_splits,
)
from fedfuse.engine.client import TrainStats
from fedfuse.engine.context import seeded_state
from fedfuse.engine.program import ClientProgram
from fedfuse.types import LOCAL_ONLY, ClientData, Message, TensorDict


class Local(Algorithm):
    name = "local"
    description = "Local: each client trains alone on its own data (no communication)"
    privacy = (LOCAL_ONLY,)

    def init_state(self) -> ServerState:
        return {}

    def init_client_state(self, cid: int) -> ClientState:
        return None  # created lazily from the initial model the first time the client trains

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        # The initial model is a shared seed known to every client, not a transmission: meta only.
        return {c: Message(meta={"init_seed": self.ctx.seed}) for c in clients}

    def _own_model(self, client_state: ClientState) -> tuple[torch.nn.Module, bool]:
        if client_state is not None:
            return self.ctx.load(client_state["model"]), True
        return self.ctx.load(seeded_state(self.ctx, self.ctx.seed)), False

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """Train the client's own model (the shared initial model the first time) with the run's local spec;
        the reply carries only its statistics, the model stays in the client's state."""
        model, _ = self._own_model(client_state)
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}

        def finalize(state: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            return Message(stats=self.fit_stats(model, data, stats)), {"model": state}

        return ClientProgram(model=model, init=init, spec=self.ctx.train, finalize=finalize)

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        return state

    def global_model(self, state: ServerState) -> None:
        return None

    def server_parameters(self, state: ServerState) -> int:
        return 0

    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]:
        return {c: Message() for c in clients}

    def evaluate(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> dict[str, float]:
        model, _ = self._own_model(client_state)
        return evaluate_splits(model, data, self.ctx.eval_batch_size)
