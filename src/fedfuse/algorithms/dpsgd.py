"""D-PSGD (Lian et al., NeurIPS 2017, "Can decentralized algorithms outperform centralized algorithms?"):
serverless training where every participant averages its neighbours' models and takes local SGD steps.

Paper, Algorithm 1: x_{k+1,i} = Σ_j W_ij x_{k,j} − γ ∇F_i(x_{k,i}; ξ) with a symmetric doubly stochastic
mixing matrix W over the communication graph.  As in the D-PSGD baseline of the Dis-PFL code
(``rong-dai/DisPFL``, ``standalone/dpsgd``), which MSfusion's ring-topology table compares against, a round is
*combine then adapt*: participant i first replaces its model by Σ_j W_ij x_j over itself and its neighbours
(the models they trained last round), then trains it for ``local_epochs`` epochs; everyone is active every
round and nobody holds a global model.  W:

* ``mixing="metropolis"`` (default): Metropolis–Hastings weights W_ij = 1/(1 + max(d_i, d_j)) on the edges,
  W_ii = 1 − Σ_j W_ij — symmetric and doubly stochastic for every undirected graph, as the paper's analysis
  requires; on a ring (1/3 each) and on the full graph (1/N each) it equals the code's plain average;
* ``mixing="uniform"``: 1/(|N_i| + 1) over the neighbourhood, the code's average (row-stochastic only).

``topology``: ``ring`` (neighbours n±1 mod N, MSfusion's ring), ``full``, ``random-ring`` (a fresh ring over a
seeded random order every round: time-varying, still 2-regular and doubly stochastic) or ``random`` (every
participant listens to ``degree`` random others each round, the Dis-PFL code's ``cs=random``; directed, so
only row-stochastic).  With ``full`` topology and full participation a round is exactly FedAvg with uniform
weights (tested).

Communication uses the same peer path as MSfusion: ``fit`` returns ``sim/peer/{m}/…`` for every participant
m that will listen to it next round, the ``exchange`` hook routes them into mailboxes and counts them once as
``bytes_peer``; ``sim/own/…`` (the trained model) reaches the simulation only to report the average of all
local models as the "global" model.  BatchNorm running statistics are mixed with the same weights as the
parameters; ``num_batches_tracked`` takes the maximum over the neighbourhood.  Accuracy as in MSfusion's
Table 3: every participant's local model on its own test split (``personal_accuracy``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState, evaluate_splits
from fedfuse.engine.client import TrainStats
from fedfuse.engine.context import seeded_state
from fedfuse.engine.peers import TOPOLOGIES, deliver, mail_of, own_tensors, peer_graph, route_peers, unpack_mail
from fedfuse.engine.program import ClientProgram
from fedfuse.errors import UserError
from fedfuse.options import opt
from fedfuse.types import ClientData, Message, Privacy, ServerView, TensorDict, no, not_built


def gossip_matrix(adj: np.ndarray, mixing: str = "metropolis") -> np.ndarray:
    """Mixing matrix W over ``adj`` (see the module docstring); rows sum to 1."""
    n = adj.shape[0]
    w = np.zeros((n, n))
    deg = adj.sum(axis=1)
    if mixing == "metropolis":
        for i in range(n):
            for j in np.flatnonzero(adj[i]):
                w[i, j] = 1.0 / (1.0 + max(deg[i], deg[j]))
    elif mixing == "uniform":
        for i in range(n):
            w[i, adj[i]] = 1.0 / (deg[i] + 1.0)
    else:
        raise UserError(f"mixing={mixing!r}; choose metropolis or uniform")
    w[np.arange(n), np.arange(n)] = 1.0 - w.sum(axis=1)
    return w


def mix_states(states: Mapping[int, Mapping[str, torch.Tensor]], weights: Mapping[int, float]) -> TensorDict:
    """Σ_j w_j · state_j key by key; integer buffers (``num_batches_tracked``) take the maximum."""
    order = sorted(states)
    first = states[order[0]]
    out: TensorDict = {}
    for k, v in first.items():
        if v.is_floating_point():
            acc = torch.zeros_like(v, dtype=torch.float64)
            for j in order:
                acc += float(weights[j]) * states[j][k].to(torch.float64)
            out[k] = acc.to(v.dtype)
        else:
            out[k] = torch.stack([states[j][k] for j in order]).max(0).values.clone()
    return out


class DPSGD(Algorithm):
    name = "dpsgd"
    description = "D-PSGD: serverless gossip averaging with neighbours then local SGD (ring/full/random graphs)"
    privacy = (
        Privacy(ServerView.PEER_TO_PEER,
                "gossip averaging with graph neighbours: each peer sees its neighbours' models, no server",
                central_dp=no('no server step exists to noise'),
                local_dp=not_built('DP-SGD on the local step would make each gossiped model DP'),
                secagg=no('neighbours average plain models; there is no server sum to mask')),
    )

    @dataclass
    class Options:
        topology: str = opt("ring", "peer graph: ring (MSfusion's ring table), full, random-ring (time-varying "
                            "ring), random (degree random in-neighbours per round, Dis-PFL code)", choices=TOPOLOGIES)
        mixing: str = opt("metropolis", "mixing weights: metropolis (doubly stochastic, paper) or uniform "
                          "(1/(deg+1), Dis-PFL code); equal on ring and full graphs", choices=("metropolis",
                                                                                                "uniform"))
        degree: int = opt(2, "in-neighbours per participant for topology=random", ge=1)

    # ---- consensus quantities -------------------------------------------------------------------
    def graph(self, r: int) -> np.ndarray:
        return peer_graph(self.ctx.num_clients, self.opt.topology, r, self.ctx.seed, self.opt.degree)

    def mixing_matrix(self, r: int) -> np.ndarray:
        return gossip_matrix(self.graph(r), self.opt.mixing)

    def initial_state(self) -> TensorDict:
        return seeded_state(self.ctx, self.ctx.seed)

    # ---- server-side bookkeeping (simulation only: there is no server) --------------------------
    def init_state(self) -> ServerState:
        return {"global": self.initial_state(), "mailbox": {}}

    def select_clients(self, info: RoundInfo, rng: np.random.Generator) -> list[int]:
        return list(range(self.ctx.num_clients))  # every participant is active every round

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        out = {}
        for c in clients:
            out[c] = Message(deliver(state.get("mailbox", {}), c), {"round": info.index, "total": info.total})
        return out

    def exchange(self, info: RoundInfo, results: dict[int, Message]) -> tuple[dict[int, Message], int]:
        return route_peers(results)

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        owns = {c: own_tensors(m) for c, m in results.items()}
        mailbox = {c: mail_of(m) for c, m in results.items()}
        owns = {c: s for c, s in owns.items() if s}
        glob = mix_states(owns, {c: 1.0 / len(owns) for c in owns}) if owns else state["global"]
        diag = {"peer_bytes_per_participant": float(np.mean([m.meta.get("peer_bytes", 0) for m in results.values()]))}
        return {**state, "global": glob, "mailbox": mailbox, "diag": diag}

    def global_model(self, state: ServerState) -> tuple[TensorDict, dict[str, Any]]:
        """The average of all local models (reported for reference; training never uses it)."""
        return state["global"], {}

    def server_parameters(self, state: ServerState) -> int:
        return 0

    def diagnostics(self, state: ServerState, fed: Any, info: RoundInfo) -> dict[str, Any]:
        return dict(state.get("diag", {}))

    # ---- participant side ------------------------------------------------------------------------
    def combine(self, n: int, r: int, own: TensorDict, mail: dict[int, TensorDict]) -> TensorDict:
        """Σ_j W_nj x_j over n and the neighbours whose models arrived (missing ones: weight back to n)."""
        if r == 0 or not mail:
            return {k: v.clone() for k, v in own.items()}
        w = self.mixing_matrix(r)[n]
        weights = {j: float(w[j]) for j in mail}
        weights[n] = 1.0 - sum(weights.values())
        return mix_states({**mail, n: own}, weights)

    def send(self, n: int, r: int, total: int, tensors: TensorDict) -> tuple[TensorDict, int]:
        """``sim/peer/{m}/…`` copies of ``tensors`` for every m that listens to n in round r + 1."""
        out: TensorDict = {}
        sent = 0
        if r + 1 < total:
            adj = self.graph(r + 1)
            for m in np.flatnonzero(adj[:, n]):
                out.update({f"sim/peer/{int(m)}/{k}": v for k, v in tensors.items()})
                sent += int(sum(v.numel() * v.element_size() for v in tensors.values()))
        return out, sent

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """Node n's round as a declared program: gossip-average its own model with the models its neighbours
        sent (:meth:`combine`), train the result with the run's local spec, then send it to the neighbours."""
        n, r, total = data.cid, int(payload.meta["round"]), int(payload.meta["total"])
        own = client_state["model"] if client_state is not None else self.initial_state()
        x = self.combine(n, r, own, unpack_mail(payload.tensors, "sim/"))
        model = self.ctx.model({})

        def finalize(new: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            peer, sent = self.send(n, r, total, new)
            return (Message({**{f"sim/own/{k}": v for k, v in new.items()}, **peer}, {"peer_bytes": sent},
                            self.fit_stats(model, data, stats)), {"model": new})

        return ClientProgram(model=model, init=x, spec=self.ctx.train, finalize=finalize)

    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]:
        return {c: Message() for c in clients}

    def evaluate(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> dict[str, float]:
        own = client_state["model"] if client_state is not None else self.initial_state()
        return evaluate_splits(self.ctx.load(own), data, self.ctx.eval_batch_size)


__all__ = ["DPSGD", "gossip_matrix", "mix_states", "peer_graph", "route_peers", "unpack_mail"]
