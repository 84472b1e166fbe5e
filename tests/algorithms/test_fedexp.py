"""FedExP: the extrapolated step size by hand, parameters extrapolated and BatchNorm statistics averaged,
determinism."""


import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.algorithms.fedexp import fedexp_step_size
from fedfuse.runner import experiment
from support import BN_MODEL, check_same_seed_same_run
from support import baseline_cfg as cfg_for
from support import fake_state_results as fake_results


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


@pytest.mark.parametrize("algorithm", ["fedexp"])
def test_same_seed_same_metrics(algorithm):
    check_same_seed_same_run(cfg_for(algorithm=algorithm), "global_accuracy")
