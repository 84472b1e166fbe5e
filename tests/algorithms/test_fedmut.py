"""FedMR's baselines: FedMut mutation coefficients, FedExP step size, (A)SAM perturbation, determinism."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedfuse.algorithms.base import RoundInfo
from fedfuse.algorithms.fedexp import fedexp_step_size
from fedfuse.algorithms.fedmut import mutate, mutation_coefficients, mutation_radius
from fedfuse.algorithms.fedsam import train_sam
from fedfuse.config import RunConfig, apply
from fedfuse.engine.client import TrainConfig, train_local
from fedfuse.engine.loop import strip_timing
from fedfuse.engine.sam import sam_perturbation
from fedfuse.fusion.average import weighted_average
from fedfuse.models import build_model
from fedfuse.rng import numpy_rng
from fedfuse.runner import experiment
from fedfuse.types import FitStats, Message, Split


def cfg_for(**kw) -> RunConfig:
    base = dict(
        dataset="digits", partition="dirichlet", model="mlp", clients=6, clients_per_round=4, rounds=3,
        local_epochs=1, batch_size=32, lr=0.05, seed=7, plots=False, out=None,
        model_options={"widths": [16]}, partition_options={"alpha": 0.5, "min_size": 20},
    )
    base.update(kw)
    return apply(RunConfig(), base)


BN_MODEL = dict(model="resnet9", model_options={"width_mult": 0.25})


def fake_results(model, k, seed=0, nbt_step=3):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(k):
        s = {}
        for key, v in model.state_dict().items():
            s[key] = v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v + nbt_step * (i + 1)
        out[i] = Message(s, stats=FitStats(num_examples=10 + i))
    return out


# ---- FedMut ---------------------------------------------------------------------------------------------


def test_mutation_radius_schedule():
    assert mutation_radius(0) == pytest.approx(0.3)
    assert mutation_radius(25) == pytest.approx(0.15)
    assert mutation_radius(50) == 0.0 and mutation_radius(80) == 0.0


@pytest.mark.parametrize("k", [1, 2, 4, 5, 10])
def test_mutation_coefficients_follow_the_paired_construction(k):
    r = 0.2
    keys = [f"k{i}" for i in range(30)]
    coeffs = mutation_coefficients(keys, k, r, np.random.default_rng(0))
    orders = set()
    for key in keys:
        c = coeffs[key]
        assert len(c) == k
        paired = c[: k - 1] if k % 2 else c
        if k % 2:
            assert c[-1] == 0.0  # the last slot is the plain global model when K is odd
        assert sorted(paired) == sorted([1.0] * (k // 2) + [-1.0 + r] * (k // 2))  # ⌊K/2⌋ pairs (1, −1 + r)
        orders.add(tuple(c))
    if k >= 4:
        assert len(orders) > 1  # independent shuffles per key


def test_mutate_hand_case_and_mean():
    g = {"w": torch.tensor([1.0, 2.0]), "bn.num_batches_tracked": torch.tensor(7)}
    d = {"w": torch.tensor([0.5, -1.0]), "bn.num_batches_tracked": torch.tensor(3)}
    coeffs = {"w": [1.0, -0.8], "bn.num_batches_tracked": [1.0, -0.8]}
    slots = mutate(g, d, coeffs, alpha=4.0)
    torch.testing.assert_close(slots[0]["w"], torch.tensor([3.0, -2.0]))
    torch.testing.assert_close(slots[1]["w"], torch.tensor([1.0 - 1.6, 2.0 + 3.2]))
    assert all(int(s["bn.num_batches_tracked"]) == 7 for s in slots)  # integer buffers are not mutated
    # pairs (1, -1 + r): the slot mean is global + alpha * r / 2 * delta
    torch.testing.assert_close((slots[0]["w"] + slots[1]["w"]) / 2, g["w"] + 4.0 * 0.2 / 2 * d["w"])


def test_fedmut_round_matches_the_construction():
    exp = experiment(cfg_for(algorithm="fedmut", **BN_MODEL))
    algo = exp.algo
    state = algo.init_state()
    res = fake_results(exp.ctx.model(), 4, seed=1)
    new = algo.aggregate_fit(state, RoundInfo(index=10, total=20), res)
    g = weighted_average([m.tensors for m in res.values()], None, base=state["global"])
    for key, v in g.items():
        assert torch.equal(new["global"][key], v)
    keys = [k for k, v in g.items() if v.is_floating_point()]
    r = 0.3 * (1 - 10 / 50)
    coeffs = mutation_coefficients(keys, 4, r, numpy_rng(exp.cfg.seed, "fedmut", 10))
    for j, slot in enumerate(new["slots"]):
        for key in keys:
            expected = g[key] + (4.0 * coeffs[key][j]) * (g[key] - state["global"][key])
            torch.testing.assert_close(slot[key], expected, rtol=0, atol=1e-6)
        for key in g:
            if not g[key].is_floating_point():
                assert torch.equal(slot[key], g[key])  # num_batches_tracked: the global (max) value
    payloads = algo.configure_fit(new, RoundInfo(11, 20), [5, 1, 3, 0])
    for i, c in enumerate([0, 1, 3, 5]):
        assert payloads[c].tensors is new["slots"][i]


# ---- FedExP ---------------------------------------------------------------------------------------------


def test_fedexp_step_size_hand_case():
    ups = [{"w": torch.tensor([3.0, 0.0, 0.0])}, {"w": torch.tensor([0.0, 3.0, 0.0])},
           {"w": torch.tensor([0.0, 0.0, 3.0])}]
    eta, mean = fedexp_step_size(ups, ["w"], eps=0.0)
    assert eta == pytest.approx((27 / 3) / (2 * 3))  # mean ||d_i||^2 = 9, ||mean||^2 = 3 -> 1.5
    torch.testing.assert_close(mean["w"], torch.ones(3, dtype=torch.float64))
    eta, _ = fedexp_step_size([{"w": torch.tensor([2.0, 0.0])}, {"w": torch.tensor([0.0, 2.0])}], ["w"], 1e-3)
    assert eta == 1.0  # 4 / (2 (2 + eps)) < 1 -> clipped to 1 (FedAvg)
    # data weights p = (1/4, 3/4): mean = (1.5, 1.5); sum p ||d||^2 = 9 + 3 = 12; ||mean||^2 = 4.5; eps = 0.5
    eta, mean = fedexp_step_size([{"w": torch.tensor([6.0, 0.0])}, {"w": torch.tensor([0.0, 2.0])}], ["w"],
                                 0.5, weights=[10, 30])
    torch.testing.assert_close(mean["w"], torch.tensor([1.5, 1.5], dtype=torch.float64))
    assert eta == pytest.approx(12 / (2 * (4.5 + 0.5)))  # = 1.2
    eta, _ = fedexp_step_size([{"w": torch.tensor([6.0, 0.0])}, {"w": torch.tensor([0.0, 6.0])}], ["w"],
                              0.0, weights=[1, 1])
    assert eta == pytest.approx(36 / (2 * 18))
    with pytest.raises(ValueError):
        fedexp_step_size(ups, ["w"], 0.0, weights=[1, 2])


@pytest.mark.parametrize("opts", [{}, {"weighting": "uniform", "eps": 1e-3, "eps_decay": 0.996004}])
def test_fedexp_aggregate_extrapolates_params_and_averages_bn_stats(opts):
    """Default: data weights p_i and K·ε with ε = 0.1 (FedMR's benchmark code); FedExP's own code's form too."""
    exp = experiment(cfg_for(algorithm="fedexp", algorithm_options=opts, **BN_MODEL))
    algo = exp.algo
    state = algo.init_state()
    res = fake_results(exp.ctx.model(), 3, seed=2)
    t = 4
    new = algo.aggregate_fit(state, RoundInfo(t, 10), res)
    w = state["global"]
    pkeys = exp.ctx.param_keys()
    keys = [k for k in w if k in pkeys]
    n = [10.0, 11.0, 12.0] if opts.get("weighting", "samples") == "samples" else [1.0, 1.0, 1.0]
    p = [x / sum(n) for x in n]
    msgs = [res[c] for c in sorted(res)]
    ups = [{k: m.tensors[k] - w[k] for k in keys} for m in msgs]
    sq = sum(pi * float(u[k].double().pow(2).sum()) for pi, u in zip(p, ups) for k in keys)
    mean = {k: sum(pi * u[k].double() for pi, u in zip(p, ups)) for k in keys}
    msq = sum(float(mean[k].pow(2).sum()) for k in keys)
    eps = opts.get("eps", 0.1) * opts.get("eps_decay", 1.0) ** (t + 1)
    eta = max(1.0, sq / (2 * (msq + 3 * eps)))
    assert eta > 1.0 and new["eta_g"] == pytest.approx(eta)
    for k in keys:
        torch.testing.assert_close(new["global"][k].double(), w[k].double() + eta * mean[k], rtol=0, atol=1e-5)
    for k in w:
        if k.endswith(("running_mean", "running_var")):
            torch.testing.assert_close(new["global"][k], sum(pi * m.tensors[k] for pi, m in zip(p, msgs)))
        if k.endswith("num_batches_tracked"):
            assert int(new["global"][k]) == max(int(m.tensors[k]) for m in res.values())
    g_eval, _ = algo.global_model(new)  # the average of the last two iterates
    k0 = keys[0]
    torch.testing.assert_close(g_eval[k0], (new["global"][k0] + w[k0]) / 2)


# ---- FedSAM / FedASAM -----------------------------------------------------------------------------------


def test_sam_and_asam_perturbation_hand_case():
    w = nn.Parameter(torch.tensor([1.0, -2.0]))
    b = nn.Parameter(torch.tensor([0.5]))
    w.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.0])
    eps = sam_perturbation([("fc.weight", w), ("fc.bias", b)], rho=0.1)
    torch.testing.assert_close(eps[0], 0.1 * torch.tensor([3.0, 4.0]) / 5)
    eps = sam_perturbation([("fc.weight", w), ("fc.bias", b)], rho=0.1, adaptive=True, eta=0.0)
    # T = |w| = (1, 2): T g = (3, 8), ||T g|| = sqrt(73), eps = rho T^2 g / ||T g|| = rho (3, 16) / sqrt(73)
    torch.testing.assert_close(eps[0], 0.1 * torch.tensor([3.0, 16.0]) / math.sqrt(73))
    b.grad = torch.tensor([1.0])  # biases are not scaled by T
    eps = sam_perturbation([("fc.weight", w), ("fc.bias", b)], rho=1.0, adaptive=True, eta=0.0)
    n = math.sqrt(9 + 64 + 1)
    torch.testing.assert_close(eps[1], torch.tensor([1.0 / n]))


@pytest.mark.parametrize("adaptive", [False, True])
def test_sam_with_zero_radius_equals_plain_training_including_bn_stats(adaptive):
    torch.manual_seed(0)
    model = build_model("resnet9", (1, 8, 8), 10, width_mult=0.25)
    data = Split(torch.randn(40, 64), torch.randint(0, 10, (40,)))
    cfg = TrainConfig(local_epochs=2, batch_size=16, lr=0.05, momentum=0.9)
    a = {k: v.clone() for k, v in model.state_dict().items()}
    train_local(model, data, cfg, torch.Generator().manual_seed(1))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(a)
    train_sam(model, data, cfg, torch.Generator().manual_seed(1), rho=0.0, adaptive=adaptive)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, plain[k], rtol=0, atol=1e-6, msg=k)  # BN stats: one update per step


def test_sam_changes_the_trajectory_and_counts_double_flops():
    a = experiment(cfg_for(algorithm="fedavg", rounds=1))
    a.run()
    b = experiment(cfg_for(algorithm="fedasam", rounds=1), fed=a.fed)
    b.run()
    assert b.history[0]["client_flops"] == pytest.approx(2 * a.history[0]["client_flops"])
    assert any(not torch.equal(a.state["global"][k], b.state["global"][k]) for k in a.state["global"])


@pytest.mark.parametrize("algorithm", ["fedmut", "fedexp", "fedsam", "fedasam"])
def test_same_seed_same_metrics(algorithm):
    a = experiment(cfg_for(algorithm=algorithm))
    a.run()
    b = experiment(cfg_for(algorithm=algorithm), fed=a.fed)
    b.run()
    assert [strip_timing(h) for h in a.history] == [strip_timing(h) for h in b.history]
    assert a.history[-1]["global_accuracy"] is not None
