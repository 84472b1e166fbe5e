"""FedNova: the momentum step norm and τ_eff-normalised averaging by hand, on pure functions and in aggregate_fit."""

from __future__ import annotations

import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.algorithms.fednova import normalised_states, step_norm
from fedfuse.config import RunConfig, apply
from fedfuse.runner import experiment
from fedfuse.types import FitStats, Message


def test_step_norm_by_hand():
    """SGD: τ.  Momentum ρ = 0.5, τ = 2: step 1's gradient counts 1 + ρ, step 2's 1 → 2.5."""
    assert step_norm(3) == 3.0
    assert step_norm(2, 0.5) == pytest.approx(2.5)


def test_normalised_average_by_hand():
    """x = 0; y1 = 2 after τ1 = 1 step, y2 = 3 after τ2 = 3; p = ½: τ_eff = 2, x + 2·(½·2/1 + ½·3/3) = 3
    (FedAvg: 2.5).  The BatchNorm statistic is not rescaled."""
    x = {"w": torch.tensor([0.0]), "bn.running_mean": torch.tensor([0.0])}
    states = [{"w": torch.tensor([2.0]), "bn.running_mean": torch.tensor([1.0])},
              {"w": torch.tensor([3.0]), "bn.running_mean": torch.tensor([5.0])}]
    out = normalised_states(x, states, [1.0, 3.0], [1.0, 1.0], {"w"})
    assert [s["w"].item() for s in out] == [4.0, 2.0]  # x + (τ_eff/τ_i)(y_i − x)
    assert [s["bn.running_mean"].item() for s in out] == [1.0, 5.0]
    assert sum(s["w"].item() for s in out) / 2 == 3.0


def test_aggregate_fit_uses_the_reported_step_counts():
    """Two clients (n = 10 and 30, τ = 1 and 6) on the digits MLP: x ← x + τ_eff Σ p_i (y_i − x)/τ_i with
    p = (¼, ¾), τ_eff = ¼·1 + ¾·6; a client that took no step is left out."""
    cfg = apply(RunConfig(), dict(algorithm="fednova", dataset="digits", model="mlp", clients=4, clients_per_round=3,
                                  rounds=1, model_options={"widths": [8]}, plots=False))
    exp = experiment(cfg)
    state = exp.algo.init_state()
    x = state["global"]
    g = torch.Generator().manual_seed(0)
    ys = [{k: v + torch.randn(v.shape, generator=g) for k, v in x.items()} for _ in range(3)]
    res = {0: Message(ys[0], stats=FitStats(num_examples=10, steps=1)),
           1: Message(ys[1], stats=FitStats(num_examples=30, steps=6)),
           2: Message(ys[2], stats=FitStats(num_examples=50, steps=0))}
    new = exp.algo.aggregate_fit(state, RoundInfo(0, 1), res)["global"]
    tau_eff = 0.25 * 1 + 0.75 * 6
    for k in x:
        expect = x[k] + tau_eff * (0.25 * (ys[0][k] - x[k]) / 1 + 0.75 * (ys[1][k] - x[k]) / 6)
        assert torch.allclose(new[k], expect, atol=1e-5), k
