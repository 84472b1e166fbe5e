"""FedExP (Jhunjhunwala, Wang & Joshi, ICLR 2023): server-side extrapolation with a POCS-inspired step size.

With the client updates ``Δ_i = w_i − w`` of the K participating clients, their data weights ``p_i``
(``n_i`` normalised over the round's clients) and the weighted mean update ``Δ̄ = Σ_i p_i Δ_i``:

    η_g = max(1, Σ_i p_i ‖Δ_i‖² / (2 (‖Δ̄‖² + K·ε_t))),      w ← w + η_g · Δ̄

(the paper's ``w − η_g·Δ̄`` with pseudo-gradients ``w − w_i``).  This is the form both author codes use: the
FedExP authors' ``main.py`` and the FedMR authors' benchmark ``Training_FedExP.py`` weight clients by
``p_i`` and add ``S·ε`` (S = K clients per round) to the denominator.  They differ in ε:

* FedMR's benchmark (the code behind FedMR's Table 1): ``ε = 0.1`` per client, constant — the default here
  (``eps=0.1``, ``eps_decay=1``; K·ε = 1 for K = 10, "ε of order 1").
* FedExP's own code: ``ε = 1e-3`` for CIFAR-10/100 and CINIC-10, ``0.1`` for EMNIST, decayed every round by
  ``0.998²`` (``eps_decay=0.996004``; ``ε_t = ε · eps_decay^(t+1)`` with t the 0-based round).

FedExP's step size is its own server rule, so it takes only the averaging options (``weighting``,
``int_policy``): FedAvg's ``server_lr``, robust fusion and clipping are not offered (an unknown option is
refused).  ``weighting="uniform"`` gives the paper's 1/M form with equal weights.  Norms are over the trainable
parameters and the extrapolation is applied to them only.  BatchNorm running statistics are statistics, not
optimisation iterates: they take the p-weighted average (η = 1), and ``num_batches_tracked`` the max (the
author codes extrapolate every state entry; the CNNs they use have no BN).

The paper notes that FedExP's iterates oscillate and reports the average of the last two iterates,
``(w_t + w_{t−1}) / 2``; that is the evaluated global model by default (``eval_last_two=True``, as both
author codes do), while training continues from ``w_t``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedfuse.algorithms.base import RoundInfo, ServerState
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.fusion.average import weighted_average
from fedfuse.options import opt
from fedfuse.types import Message, Privacy, ServerView, TensorDict, not_built, yes


def fedexp_step_size(
    updates: list[TensorDict], keys: list[str], eps: float, weights: Sequence[float] | None = None
) -> tuple[float, TensorDict]:
    """``(η_g, Δ̄)``: the extrapolation step and the p-weighted mean update over ``keys`` (float64).

    ``η_g = max(1, Σ p_i ‖Δ_i‖² / (2 (‖Σ p_i Δ_i‖² + eps)))`` with ``p`` = ``weights`` normalised to sum 1
    (uniform when None); ``eps`` is the whole additive term (the algorithm passes K·ε_t).
    """
    k = len(updates)
    w = [1.0] * k if weights is None else [float(x) for x in weights]
    if len(w) != k or any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"need {k} non-negative weights with a positive sum, got {w}")
    p = [x / sum(w) for x in w]
    mean = {key: sum(pi * u[key].to(torch.float64) for pi, u in zip(p, updates)) for key in keys}
    sq_avg = sum(pi * float(u[key].to(torch.float64).pow(2).sum()) for pi, u in zip(p, updates) for key in keys)
    mean_sq = sum(float(mean[key].pow(2).sum()) for key in keys)  # type: ignore[union-attr]
    eta = max(1.0, sq_avg / (2.0 * (mean_sq + eps)))
    return eta, mean  # type: ignore[return-value]


class FedExP(FedAvg):
    name = "fedexp"
    description = "FedExP: FedAvg with adaptive server extrapolation max(1, sum p_i||d_i||^2 / (2(||d||^2 + K eps)))"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                'the mean update plus one scalar sum, Σ p_i‖Δ_i‖², sets the extrapolation step',
                central_dp=not_built('the step size Σ p_i‖Δ_i‖² is data-dependent: it would need its own '
                                      'clipping and noise'),
                local_dp=yes('the client step is plain SGD on the task loss: DP-SGD through Opacus (BN-free models)'),
                secagg=not_built('append n_i‖Δ_i‖² to the masked vector: the server then learns only the sums')),
    )

    @dataclass
    class Options(FedAvg.AverageOptions):
        weighting: str = opt("samples", "client weights p_i: 'samples' (n_i, both author codes) or 'uniform' "
                             "(the paper's 1/M)", choices=("samples", "uniform"))
        eps: float = opt(0.1, "per-client ε: K·ε is added to ||mean update||^2 (0.1 = FedMR's benchmark code; "
                         "FedExP's code: 1e-3 CIFAR, 0.1 EMNIST)", ge=0.0)
        eps_decay: float = opt(1.0, "ε_t = eps·eps_decay^(t+1) (1 = constant, FedMR's benchmark; FedExP's code: "
                               "0.996004 = 0.998^2)", gt=0.0, le=1.0)
        eval_last_two: bool = opt(True, "evaluate (w_t + w_{t-1}) / 2 (paper and both codes); False = w_t")

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        w = state["global"]
        cids = sorted(results)
        msgs = [results[c] for c in cids]
        pkeys = self.ctx.param_keys()
        keys = [k for k in w if k in pkeys and w[k].is_floating_point()]
        updates = [{k: m.tensors[k] - w[k] for k in keys} for m in msgs]
        weights = self.client_weights({c: results[c] for c in cids})
        avg = weighted_average([m.tensors for m in msgs], weights, base=w,
                               int_policy=self.opt.int_policy)  # type: ignore[arg-type]
        eps_t = float(self.opt.eps) * float(self.opt.eps_decay) ** (info.index + 1)
        eta, mean = fedexp_step_size(updates, keys, len(msgs) * eps_t, weights)
        new = dict(avg)
        for k in keys:
            new[k] = (w[k].to(torch.float64) + eta * mean[k]).to(w[k].dtype)
        return {**state, "global": new, "previous": w, "eta_g": eta}

    def global_model(self, state: ServerState) -> tuple[TensorDict, dict[str, Any]] | None:
        prev = state.get("previous")
        if not self.opt.eval_last_two or prev is None:
            return state["global"], {}
        return weighted_average([state["global"], prev], None, int_policy="max"), {}

    def diagnostics(self, state: ServerState, fed: Any, info: RoundInfo) -> dict[str, Any]:
        return {"fedexp_eta": state.get("eta_g")}
