"""FedProx: μ = 0 is FedAvg bit for bit; a large μ keeps the model nearer the global one."""

import torch

from fedfuse.runner import experiment
from support import small_cfg


def test_fedprox_with_mu_zero_equals_fedavg(tmp_path):
    a = experiment(small_cfg(tmp_path, out=None))
    a.run()
    b = experiment(small_cfg(tmp_path, out=None, algorithm="fedprox", algorithm_options={"mu": 0.0}), fed=a.fed)
    b.run()
    for k, v in a.state["global"].items():
        torch.testing.assert_close(b.state["global"][k], v, rtol=0, atol=0)


def test_fedprox_pulls_towards_global(tmp_path):
    a = experiment(small_cfg(tmp_path, out=None, rounds=1, local_epochs=3))
    a.run()
    b = experiment(small_cfg(tmp_path, out=None, rounds=1, local_epochs=3, algorithm="fedprox",
                             algorithm_options={"mu": 10.0}), fed=a.fed)
    b.run()
    init = a.algo.init_state()["global"]
    dist = lambda s: sum(float((s[k] - init[k]).pow(2).sum()) for k in init)  # noqa: E731
    assert dist(b.state["global"]) < dist(a.state["global"])
