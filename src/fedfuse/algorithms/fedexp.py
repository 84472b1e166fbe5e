"""FedExP (Jhunjhunwala, Wang & Joshi, ICLR 2023): server-side extrapolation with a POCS-inspired step size.

With client updates ``Δ_i = w_i − w`` of the K participating clients and their plain mean ``Δ̄``:

    η_g = max(1, Σ_i ‖Δ_i‖² / (2K (‖Δ̄‖² + ε))),      w ← w + η_g · Δ̄

(the paper's ``w − η_g·Δ̄`` with pseudo-gradients ``w − w_i``).  Norms are over the trainable parameters;
the extrapolation is applied to the parameters only.  BatchNorm running statistics are statistics, not
optimisation iterates: they take the plain average (η = 1), and ``num_batches_tracked`` the max.  Client
averaging is uniform (the paper's 1/M; ``weighting="samples"`` for n_i weights).

The paper notes that FedExP's iterates oscillate and reports the average of the last two iterates,
``(w_t + w_{t−1}) / 2``; that is the evaluated global model by default (``eval_last_two=True``), while
training continues from ``w_t``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedfuse.algorithms.base import RoundInfo, ServerState
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.fusion.average import weighted_average
from fedfuse.types import Message, TensorDict


def fedexp_step_size(updates: list[TensorDict], keys: list[str], eps: float) -> tuple[float, TensorDict]:
    """``(η_g, Δ̄)``: the extrapolation step and the mean update over ``keys`` (float64 norms)."""
    k = len(updates)
    mean = {key: torch.stack([u[key].to(torch.float64) for u in updates]).mean(0) for key in keys}
    sq_sum = sum(float(u[key].to(torch.float64).pow(2).sum()) for u in updates for key in keys)
    mean_sq = sum(float(mean[key].pow(2).sum()) for key in keys)
    eta = max(1.0, sq_sum / (2.0 * k * (mean_sq + eps)))
    return eta, mean


class FedExP(FedAvg):
    name = "fedexp"
    description = "FedExP: FedAvg with adaptive server extrapolation max(1, sum||d_i||^2 / (2K(||mean d||^2+eps)))"

    @dataclass
    class Options(FedAvg.Options):
        weighting: str = "uniform"
        eps: float = 1e-3
        eval_last_two: bool = True  # evaluate (w_t + w_{t-1}) / 2 (paper); False = w_t

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        w = state["global"]
        msgs = [results[c] for c in sorted(results)]
        pkeys = self.ctx.param_keys()
        keys = [k for k in w if k in pkeys and w[k].is_floating_point()]
        updates = [{k: m.tensors[k] - w[k] for k in keys} for m in msgs]
        avg = weighted_average([m.tensors for m in msgs], self.client_weights(results), base=w,
                               int_policy=self.opt.int_policy)  # type: ignore[arg-type]
        if self.opt.weighting == "uniform":
            eta, mean = fedexp_step_size(updates, keys, float(self.opt.eps))
        else:  # weighted mean update, same step-size formula
            eta, _ = fedexp_step_size(updates, keys, float(self.opt.eps))
            mean = {k: (avg[k] - w[k]).to(torch.float64) for k in keys}
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
