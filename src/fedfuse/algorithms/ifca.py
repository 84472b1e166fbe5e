"""IFCA (Ghosh et al. 2020, "An efficient framework for clustered federated learning"; code jichan3751/ifca).

K cluster models (independently initialised).  The server broadcasts *all* K models to every sampled client
(that is what the algorithm needs: the client must evaluate each of them), so the download is K models and the
upload one.  Each sampled client computes the loss of every cluster model on its local *training* data
(eval mode, no gradient), picks the lowest (ties → lowest index), trains that model locally (IFCA's
"model averaging" variant) and returns it with its cluster index.  The server averages each cluster's
members — unweighted (paper Alg. 1 and code; ``weighting="samples"`` for n-weighting), full state with BN
buffers (``num_batches_tracked``: max); a cluster nobody picked keeps its model.  Evaluation: a client
picks its cluster by the lowest loss on its training data and is evaluated with that model.

Client cost: K forward passes over the training data (counted in ``flops``) plus one model's training.
Diagnostic: ``ari`` between the clients' latest cluster choices and the true groups (clients never sampled
are left out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState, evaluate_splits
from fedfuse.engine.client import TrainStats, forward_flops_per_sample, per_sample_losses
from fedfuse.engine.context import init_states, model_params
from fedfuse.engine.program import ClientProgram
from fedfuse.errors import UserError
from fedfuse.fusion.average import weighted_average
from fedfuse.fusion.mixture import pack, unpack
from fedfuse.options import opt
from fedfuse.types import ClientData, Message, Privacy, ServerView, TensorDict, not_built


def pick_cluster(losses: Sequence[float]) -> int:
    """Index of the lowest loss (first on ties)."""
    return int(torch.tensor(list(losses), dtype=torch.float64).argmin())


class IFCA(Algorithm):
    name = "ifca"
    description = "IFCA: K cluster models; each client trains the one with the lowest loss on its data"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                "per-cluster means (sums) plus each client's chosen cluster index, which any scheme reveals",
                central_dp=not_built('DP-FedAvg per cluster would fit; the cluster choice would need its own '
                                      'mechanism'),
                local_dp=not_built('DP-SGD on the client step would fit; the choice also reads the local data'),
                secagg=not_built('one masked sum per cluster; the cluster index stays visible')),
    )

    @dataclass
    class Options:
        k: int = opt(5, "number of cluster models K", ge=1)
        weighting: str = opt("uniform", "average of a cluster's members: uniform (paper Alg. 1, code) or by "
                             "samples", choices=("uniform", "samples"))

    def init_state(self) -> ServerState:
        if self.opt.k < 1:
            raise UserError(f"k must be >= 1, got {self.opt.k}")
        if self.opt.weighting not in ("uniform", "samples"):
            raise UserError(f"weighting={self.opt.weighting!r}; choose uniform or samples")
        return {"models": init_states(self.ctx, self.opt.k, "ifca-init"), "assign": [-1] * self.ctx.num_clients}

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        msg = Message(pack(state["models"]), {"k": len(state["models"])})
        return {c: msg for c in clients}

    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]:
        msg = Message(pack(state["models"]), {"k": len(state["models"])})
        return {c: msg for c in clients}

    def choose(self, payload: Message, data: ClientData) -> tuple[int, list[float], list[TensorDict]]:
        states = unpack(payload.tensors, int(payload.meta["k"]))
        split = data.train if len(data.train) else data.val
        losses = []
        for s in states:
            model = self.ctx.load(s)
            ls = per_sample_losses(model, split, self.ctx.eval_batch_size)
            losses.append(float(ls.mean()) if ls.numel() else 0.0)
        return pick_cluster(losses), losses, states

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """Client-side preparation, then the standard step: pick the cluster model with the lowest loss on the
        client's data (``choose``), train it, reply with the trained state, the choice and the losses (the K
        forward passes of the choice are added to the FLOPs)."""
        j, losses, states = self.choose(payload, data)
        program = self.standard_program(Message(states[j]), client_state, data)
        finalize, model = program.finalize, program.model

        def chosen(state: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            reply, cstate = finalize(state, stats)
            assert reply.stats is not None
            if len(data.train):
                reply.stats.flops += len(states) * len(data.train) * forward_flops_per_sample(
                    model, data.train.x, key=(self.ctx.model_name,))
            return Message(reply.tensors, {"cluster": j, "cluster_losses": losses}, reply.stats), cstate

        return dataclasses.replace(program, finalize=chosen)

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        models = list(state["models"])
        assign = list(state["assign"])
        for c, r in results.items():
            assign[c] = int(r.meta["cluster"])
        for j in range(len(models)):
            members = [results[c] for c in sorted(results) if int(results[c].meta["cluster"]) == j]
            if not members:
                continue  # nobody picked cluster j: it keeps its model
            w = [1.0] * len(members) if self.opt.weighting == "uniform" else \
                [float(r.num_examples) for r in members]
            models[j] = weighted_average([r.tensors for r in members], w, base=models[j])
        return {**state, "models": models, "assign": assign}

    def global_model(self, state: ServerState) -> None:
        return None

    def server_parameters(self, state: ServerState) -> int:
        return len(state["models"]) * model_params(self.ctx)

    def evaluate(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> dict[str, float]:
        j, _, states = self.choose(payload, data)
        return evaluate_splits(self.ctx.load(states[j]), data, self.ctx.eval_batch_size)

    def diagnostics(self, state: ServerState, fed: Any, info: RoundInfo) -> dict[str, Any]:
        from sklearn.metrics import adjusted_rand_score

        groups = fed.groups()  # ground truth: diagnostics only
        known = [c for c, a in enumerate(state["assign"]) if a >= 0]
        if not groups or len(known) < 2:
            return {"ari": None}
        return {"ari": float(adjusted_rand_score([groups[c] for c in known], [state["assign"][c] for c in known]))}
