"""Server update rules (fedfuse.fusion.server): hand-computed optimiser steps, buffers, unsent keys, the seam."""

from __future__ import annotations

import math

import pytest
import torch

from fedfuse.fusion.average import weighted_average
from fedfuse.fusion.server import RuleContext, ServerAdaptive, ServerRule, ServerSGD


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def two_steps(opt, x0: torch.Tensor, d1: torch.Tensor, d2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    x1, s1 = opt.step({"w": x0}, {"w": d1}, None)
    x2, s2 = opt.step(x1, {"w": d2}, s1)
    return x1["w"], x2["w"], s2


def test_sgd_momentum_by_hand():
    """FedAvgM: m1 = Δ1, x1 = x + lr·m1; m2 = β m1 + Δ2, x2 = x1 + lr·m2 (β = 0.5, lr = 2)."""
    x1, x2, s = two_steps(ServerSGD(lr=2.0, momentum=0.5), t(1.0, 2.0), t(0.5, -1.0), t(1.0, 1.0))
    assert torch.equal(x1, t(2.0, 0.0))
    assert torch.equal(s["m"]["w"], t(1.25, 0.5)) and torch.equal(x2, t(4.5, 1.0)) and s["t"] == 2
    y, _ = ServerSGD(lr=0.5).step({"w": t(1.0)}, {"w": t(4.0)}, None)
    assert torch.equal(y["w"], t(3.0))  # no momentum: x + lr·Δ


def test_adam_by_hand_with_and_without_bias_correction():
    """β1 = 0.5, β2 = 0.75, τ = 1, η = 1; Δ = 2 then −2 from x = 0."""
    opt = ServerAdaptive("adam", eta=1.0, beta_1=0.5, beta_2=0.75, tau=1.0, bias_correction=True)
    x1, x2, s = two_steps(opt, t(0.0), t(2.0), t(-2.0))
    # step 1: m = 1, v = 1, η1 = √(1 − .75)/(1 − .5) = 1 → x1 = 1·1/(1 + 1)
    assert x1.item() == pytest.approx(0.5, abs=1e-15)
    # step 2: m = −0.5, v = .75 + .25·4 = 1.75, η2 = √(1 − .75²)/(1 − .5²)
    eta2 = math.sqrt(1 - 0.5625) / 0.75
    assert s["m"]["w"].item() == -0.5 and s["v"]["w"].item() == 1.75
    assert x2.item() == pytest.approx(0.5 + eta2 * -0.5 / (math.sqrt(1.75) + 1), abs=1e-15)
    plain = ServerAdaptive("adam", eta=1.0, beta_1=0.5, beta_2=0.75, tau=1.0)
    _, y2, _ = two_steps(plain, t(0.0), t(2.0), t(-2.0))
    assert y2.item() == pytest.approx(0.5 - 0.5 / (math.sqrt(1.75) + 1), abs=1e-15)


def test_yogi_by_hand():
    """β1 = 0, β2 = 0.5, τ = 0, η = 1: v grows where Δ² > v and shrinks where Δ² < v (the sign term)."""
    opt = ServerAdaptive("yogi", eta=1.0, beta_1=0.0, beta_2=0.5, tau=0.0)
    x1, x2, s = two_steps(opt, t(0.0, 0.0), t(2.0, 1.0), t(1.0, 2.0))
    # v1 = 0 − .5·Δ²·sign(0 − Δ²) = [2, .5]; x1 = Δ/√v1 = [√2, √2]
    assert torch.allclose(x1, t(math.sqrt(2), math.sqrt(2)), rtol=0, atol=1e-15)
    # v2 = [2 − .5·1·(+1), .5 − .5·4·(−1)] = [1.5, 2.5]
    assert torch.equal(s["v"]["w"], t(1.5, 2.5))
    assert torch.allclose(x2, x1 + t(1 / math.sqrt(1.5), 2 / math.sqrt(2.5)), rtol=0, atol=1e-15)


def test_adagrad_by_hand():
    """η = 1, τ = 0: v = 9 then 25; x = 0 + 3/3 = 1, then 1 + 4/5."""
    x1, x2, s = two_steps(ServerAdaptive("adagrad", eta=1.0, tau=0.0), t(0.0), t(3.0), t(4.0))
    assert x1.item() == 1.0 and s["v"]["w"].item() == 25.0 and x2.item() == pytest.approx(1.8, abs=1e-15)


def _bn_states() -> tuple[dict, list[dict]]:
    base = {"w": t(0.0, 0.0), "bn.running_mean": t(0.0), "bn.num_batches_tracked": torch.tensor(5),
            "frozen": t(7.0)}
    a = {"w": t(1.0, 2.0), "bn.running_mean": t(1.0), "bn.num_batches_tracked": torch.tensor(9)}
    b = {"w": t(3.0, -2.0), "bn.running_mean": t(4.0), "bn.num_batches_tracked": torch.tensor(7)}
    return base, [a, b]


def test_rule_optimises_parameters_only_and_averages_buffers():
    """BN running statistics take the weighted average, num_batches_tracked the max (still an integer tensor),
    a parameter nobody sent keeps its value and its moments; only sent parameters are stepped."""
    base, states = _bn_states()
    rule = ServerRule(optimizer=ServerAdaptive("adagrad", eta=1.0, tau=0.0))
    old = {"t": 3, "m": {"frozen": t(0.25)}, "v": {"frozen": t(4.0)}}
    new, s = rule.apply(base, states, [1.0, 3.0], old, param_keys={"w", "frozen"})
    # Δ = [.25·1 + .75·3, .25·2 − .75·2] = [2.5, −1]; adagrad's first step moves each coordinate by η·sign(Δ)
    assert torch.equal(new["w"], t(1.0, -1.0))
    assert torch.equal(new["bn.running_mean"], t(3.25))
    assert new["bn.num_batches_tracked"].dtype == torch.int64 and int(new["bn.num_batches_tracked"]) == 9
    assert torch.equal(new["frozen"], t(7.0)) and torch.equal(s["v"]["frozen"], t(4.0)) and s["t"] == 4
    assert set(s["v"]) == {"w", "frozen"}


def test_rule_without_optimizer_is_the_plain_average_bit_for_bit():
    base, states = _bn_states()
    new, s = ServerRule().apply(base, states, [1.0, 3.0], None, param_keys={"w"})
    ref = weighted_average(states, [1.0, 3.0], base=base)
    assert s is None and all(torch.equal(new[k], ref[k]) for k in ref)


def test_transform_seam_sees_the_fused_parameter_update():
    """A transform receives Δ of the sent parameters with the round and client count, and its output is what the
    optimiser steps on (here: halve the update, then plain SGD)."""
    base, states = _bn_states()
    seen: list[RuleContext] = []

    def halve(update: dict, ctx: RuleContext) -> dict:
        seen.append(ctx)
        return {k: v / 2 for k, v in update.items()}

    rule = ServerRule(optimizer=ServerSGD(lr=1.0)).with_transform(halve)
    new, _ = rule.apply(base, states, [1.0, 1.0], None, param_keys={"w", "frozen"}, round=4)
    assert torch.equal(new["w"], t(1.0, 0.0)) and torch.equal(new["bn.running_mean"], t(2.5))
    assert seen == [RuleContext(round=4, num_clients=2, keys=("w",))]
    no_opt, _ = ServerRule(transforms=(halve,)).apply(base, states, [1.0, 1.0], None, param_keys={"w"})
    assert torch.equal(no_opt["w"], t(1.0, 0.0))


def test_robust_fusion_and_clipping_compose_with_an_optimizer():
    """Median of three, then momentum SGD: an outlier moves nothing; clipping bounds each update first."""
    base = {"w": t(0.0)}
    states = [{"w": t(1.0)}, {"w": t(2.0)}, {"w": t(100.0)}]
    new, _ = ServerRule(fusion="median", optimizer=ServerSGD(lr=1.0, momentum=0.9)).apply(
        base, states, None, None, param_keys={"w"})
    assert new["w"].item() == 2.0
    clipped, _ = ServerRule(clip_norm=1.0, optimizer=ServerSGD(lr=2.0)).apply(
        base, states, [1.0, 1.0, 1.0], None, param_keys={"w"})
    assert clipped["w"].item() == pytest.approx(2.0)  # every update clipped to 1, mean 1, lr 2


def test_unknown_adaptive_kind_is_refused():
    with pytest.raises(ValueError, match="adagrad, adam or yogi"):
        ServerAdaptive("rmsprop", eta=0.1)
