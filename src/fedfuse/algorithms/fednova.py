"""FedNova (Wang, Liu, Liang, Joshi & Poor, NeurIPS 2020, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization"): normalised averaging of the clients' updates by their local work.

Client i runs τ_i local steps (its reported step count; it differs with the client's data size, epochs and the
run's ``max_steps``) and sends its model y_i.  With data weights p_i (n_i normalised over the round's clients)
and a_i the norm of its cumulative step coefficients — ‖a_i‖₁ = τ_i for plain SGD and
(τ_i − ρ(1 − ρ^τ_i)/(1 − ρ))/(1 − ρ) with local momentum ρ (the run's ``momentum``) — the server moves by

    x ← x + τ_eff · Σ_i p_i (y_i − x)/a_i,      τ_eff = Σ_i p_i a_i

instead of FedAvg's x + Σ_i p_i (y_i − x), removing the bias towards clients that take more steps.  This is
FedAvg's server rule applied to the normalised states x + (τ_eff/a_i)(y_i − x), so ``server_lr`` (the paper's
global learning rate), robust fusion and clipping compose with it.  Only parameters are normalised: BatchNorm
statistics are averaged with p_i, ``num_batches_tracked`` follows ``int_policy``.  A client that took no step
is left out of the round's normalised average.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedfuse.algorithms.base import RoundInfo, ServerState
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.types import Message, Privacy, ServerView, TensorDict, not_built


def step_norm(steps: int, momentum: float = 0.0) -> float:
    """‖a_i‖₁: τ for SGD; (τ − ρ(1 − ρ^τ)/(1 − ρ))/(1 − ρ) for SGD with momentum ρ."""
    if momentum <= 0:
        return float(steps)
    rho = float(momentum)
    return (steps - rho * (1 - rho ** steps) / (1 - rho)) / (1 - rho)


def normalised_states(x: TensorDict, states: Sequence[TensorDict], norms: Sequence[float],
                      weights: Sequence[float], keys: set[str]) -> list[TensorDict]:
    """Each state with its parameter update rescaled by τ_eff/a_i (τ_eff = Σ p_i a_i); other entries as sent."""
    total = float(sum(weights))
    tau_eff = sum(w * a for w, a in zip(weights, norms)) / total
    out = []
    for s, a in zip(states, norms):
        scale = tau_eff / a
        out.append({k: x[k] + scale * (v - x[k]) if k in keys and k in x and v.is_floating_point() else v
                    for k, v in s.items()})
    return out


class FedNova(FedAvg):
    name = "fednova"
    description = "FedNova: FedAvg with client updates normalised by their local step counts (tau_eff)"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL, "sums of p_i(y_i − x)/a_i and p_i·a_i give the normalised step",
                central_dp=not_built("the normalisation τ_eff/a_i rescales each update after any clipping: the "
                                     "sensitivity needs its own analysis"),
                local_dp=not_built("the client step is plain SGD on the task loss: DP-SGD (Opacus) fits it; "
                                   "not wired yet"),
                secagg=not_built("clients would send p_i(y_i − x)/a_i and p_i·a_i masked; not wired")),
    )
    accepts_late = False  # a late update's step count belongs to an older model

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        worked = {cid: r for cid, r in results.items() if r.stats is not None and r.stats.steps > 0}
        if not worked:
            return state
        x, cids = state["global"], list(worked)
        norms = [step_norm(worked[c].stats.steps, self.ctx.train.momentum) for c in cids]  # type: ignore[union-attr]
        normed = normalised_states(x, [worked[c].tensors for c in cids], norms, self.client_weights(worked),
                                   self.ctx.param_keys())
        return super().aggregate_fit(state, info, {c: Message(s, worked[c].meta, worked[c].stats)
                                                   for c, s in zip(cids, normed)})
