"""FedAdam (and every server optimiser) on a model with BatchNorm: parameters take the Adam step, running
statistics the weighted average, ``num_batches_tracked`` the max as an integer; the moments persist across rounds."""

from __future__ import annotations

import math

import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.config import RunConfig, apply
from fedfuse.types import FitStats, Message


def test_adam_steps_parameters_and_averages_batchnorm_buffers():
    from fedfuse.runner import experiment

    cfg = apply(RunConfig(), dict(algorithm="fedadam", dataset="digits", model="resnet18", clients=4,
                                  clients_per_round=2, rounds=1, plots=False,
                                  model_options={"width_mult": 0.0625},
                                  algorithm_options={"eta": 0.5, "beta_1": 0.5, "beta_2": 0.75, "tau": 0.25}))
    exp = experiment(cfg)
    algo, state = exp.algo, exp.algo.init_state()
    x = state["global"]
    params = algo.ctx.param_keys()
    assert any(k.endswith("num_batches_tracked") for k in x) and any(k.endswith("running_mean") for k in x)
    g = torch.Generator().manual_seed(0)
    states = []
    for i in range(2):
        s = {k: (v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v + 3 * (i + 1))
             for k, v in x.items()}
        states.append(s)
    res = {0: Message(states[0], stats=FitStats(num_examples=10)),
           1: Message(states[1], stats=FitStats(num_examples=30))}
    new = algo.aggregate_fit(state, RoundInfo(0, 2), res)
    eta1 = 0.5 * math.sqrt(1 - 0.75) / (1 - 0.5)  # bias-corrected step, t = 1
    for k, v in x.items():
        mean = 0.25 * states[0][k].double() + 0.75 * states[1][k].double() if v.is_floating_point() else None
        if k in params:
            d = mean - v.double()
            m, vv = 0.5 * d, 0.25 * d * d
            expect = v.double() + eta1 * m / (vv.sqrt() + 0.25)
            assert torch.allclose(new["global"][k].double(), expect, atol=1e-5), k
        elif v.is_floating_point():
            assert torch.allclose(new["global"][k].double(), mean, atol=1e-6), k  # statistics: averaged
        else:
            assert new["global"][k].dtype == v.dtype and int(new["global"][k]) == int(v) + 6, k  # max
    assert set(new["server_opt"]["m"]) == {k for k in x if k in params} and new["server_opt"]["t"] == 1
    again = algo.aggregate_fit(new, RoundInfo(1, 2), res)
    assert again["server_opt"]["t"] == 2
