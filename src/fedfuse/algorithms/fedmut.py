"""FedMut (Hu et al. 2024, "FedMut: Generalized Federated Learning via Stochastic Mutation").

Like FedMR the server keeps ``K`` slots (K = clients per round; the i-th sampled client trains slot i).  After
training, the global model is the uniform average of the trained slots, ``Δ = global − previous global``, and
each slot is re-seeded by a *mutation* around the global model:

    slot_j = global + α · v_j[key] · Δ[key]           (per state key)

For every state key the K coefficients ``v[key]`` are built from ⌊K/2⌋ pairs ``(1, −1 + r)`` — each pair in a
random order — and the list is then shuffled; with K odd the last slot is the plain global model.  The
mutation radius decays linearly: ``r = r0 · (1 − min(t / T, 1))`` with t the 0-based round index, r0 = 0.3,
T = 50 and α = 4 (the FedMut authors' ``Training_FedMut.py`` / ``options.py`` defaults; the copy of the
same file in the FedMR authors' repository defaults to α = 5, T = 100: ``--set alpha=5 --set bound=100``).
Integer buffers (``num_batches_tracked``) are not mutated: every slot gets the global (max) value.  The
evaluated global model is the average.  Local training is the run's (FedMut's code: SGD lr 0.01, momentum 0.5,
a fresh optimiser per round).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedfuse.algorithms.base import Algorithm, RoundInfo, ServerState
from fedfuse.fusion.average import clone_state, delta, weighted_average
from fedfuse.options import opt
from fedfuse.rng import numpy_rng
from fedfuse.types import Message, Privacy, ServerView, TensorDict, not_built


def mutation_radius(t: int, r0: float = 0.3, bound: int = 50) -> float:
    """``r0 · (1 − min(t / bound, 1))`` (author code: ``mut_acc_rate``, ``mut_bound``)."""
    return float(r0 * (1.0 - min(t / bound, 1.0))) if bound > 0 else 0.0


def mutation_coefficients(keys: list[str], k: int, r: float, rng: np.random.Generator) -> dict[str, list[float]]:
    """Per key, K coefficients: ⌊K/2⌋ pairs (1, −1 + r) in random order, shuffled; 0.0 for the odd last slot."""
    out: dict[str, list[float]] = {}
    for key in keys:
        coeffs: list[float] = []
        for _ in range(k // 2):
            pair = [1.0, -1.0 + r]
            if rng.random() <= 0.5:
                pair.reverse()
            coeffs += pair
        rng.shuffle(coeffs)
        if k % 2:
            coeffs.append(0.0)  # the last slot is the plain global model
        out[key] = coeffs
    return out


def mutate(
    global_state: TensorDict, update: TensorDict, coeffs: dict[str, list[float]], alpha: float
) -> list[TensorDict]:
    """``global + alpha · coeffs[key][j] · update[key]`` for every slot j (float keys only)."""
    k = len(next(iter(coeffs.values()))) if coeffs else 1
    slots: list[TensorDict] = []
    for j in range(k):
        s: TensorDict = {}
        for key, v in global_state.items():
            if v.is_floating_point() and key in coeffs and key in update:
                s[key] = v + (alpha * coeffs[key][j]) * update[key].to(v.dtype)
            else:
                s[key] = v.clone()
        slots.append(s)
    return slots


class FedMut(Algorithm):
    name = "fedmut"
    description = "FedMut: K slots; global = average; slots re-seeded by paired stochastic mutations along Δ"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                'the global model is the uniform mean of the trained slots; mutations derive from it alone',
                central_dp=not_built('noise on the clipped mean would fit; the mutations reuse only the noised'
                                      ' mean'),
                local_dp=not_built('DP-SGD on the client step would fit'),
                secagg=not_built('the uniform mean is a sum: masks would hide each slot')),
    )

    @dataclass
    class Options:
        alpha: float = opt(4.0, "mutation scale α (FedMut code --radius 4; FedMR repo's copy: 5)", ge=0.0)
        r0: float = opt(0.3, "initial mutation acceleration rate r0 (code --mut_acc_rate)", ge=0.0, le=1.0)
        bound: int = opt(50, "rounds over which r decays linearly to 0 (FedMut code --mut_bound 50; "
                         "FedMR repo's copy: 100)", ge=0)
        weighting: str = opt("uniform", "global model = 'uniform' average of the trained slots (code) or "
                             "'samples'-weighted", choices=("uniform", "samples"))
        int_policy: str = opt("max", "num_batches_tracked in the average", choices=("max", "sum", "first"))

    @property
    def k(self) -> int:
        return min(self.ctx.clients_per_round, self.ctx.num_clients)

    def init_state(self) -> ServerState:
        state = super().init_state()
        state["slots"] = None
        return state

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        slots = state["slots"] or [state["global"]] * self.k
        return {c: Message(slots[i], {"slot": i}) for i, c in enumerate(sorted(clients))}

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        msgs = [results[c] for c in sorted(results)]
        weights = None if self.opt.weighting == "uniform" else [float(m.num_examples) for m in msgs]
        g = weighted_average([m.tensors for m in msgs], weights, base=state["global"],
                             int_policy=self.opt.int_policy)
        upd = delta(g, state["global"])
        keys = [k for k, v in g.items() if v.is_floating_point()]
        r = mutation_radius(info.index, self.opt.r0, int(self.opt.bound))
        rng = numpy_rng(self.ctx.seed, "fedmut", info.index)
        coeffs = mutation_coefficients(keys, self.k, r, rng)
        slots = mutate(g, upd, coeffs, float(self.opt.alpha)) if self.k > 1 else [clone_state(g)]
        return {**state, "global": g, "slots": slots, "radius": r}

    def global_model(self, state: ServerState) -> tuple[TensorDict, dict[str, Any]] | None:
        return state["global"], {}
