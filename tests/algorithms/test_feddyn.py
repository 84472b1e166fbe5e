"""FedDyn: the server's h-state and model by hand, the regulariser's gradient and the client's g-state update."""

from __future__ import annotations

import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.algorithms.feddyn import server_step
from fedfuse.config import RunConfig, apply
from fedfuse.engine.client import TrainStats
from fedfuse.engine.program import Batch
from fedfuse.runner import experiment


def test_server_step_by_hand():
    """x = 1, participants' mean 3 (θ = 2, 4), N = 4, α = ½, h = 0: h = −½·(2/4)·(3 − 1) = −½; θ = 3 + 1 = 4.
    A buffer (not in h) takes the mean."""
    t = torch.tensor
    h, theta = server_step({"w": t([0.0])}, {"w": t([1.0]), "bn.running_mean": t([0.0])},
                           {"w": t([3.0]), "bn.running_mean": t([2.0])}, alpha=0.5, participants=2, clients=4)
    assert h["w"].item() == -0.5 and theta["w"].item() == 4.0 and theta["bn.running_mean"].item() == 2.0


def test_regulariser_gradient_and_client_state_by_hand():
    """∇(−⟨g_i, θ⟩ + α/2‖θ − x‖²) = −g_i + α(θ − x); after training g_i ← g_i − α(θ_i − x)."""
    cfg = apply(RunConfig(), dict(algorithm="feddyn", dataset="digits", model="mlp", clients=4, clients_per_round=3,
                                  rounds=1, model_options={"widths": [8]}, plots=False,
                                  algorithm_options={"alpha": 0.5}))
    exp = experiment(cfg)
    algo = exp.algo
    msg = algo.configure_fit(exp.algo.init_state(), RoundInfo(0, 1), [0])[0]
    gen = torch.Generator().manual_seed(0)
    g = {k: torch.randn(v.shape, generator=gen) for k, v in msg.tensors.items() if k in algo.ctx.param_keys()}
    prog = algo.client_program(msg, {"g": g}, exp.fed.clients[0])
    theta = {k: (msg.tensors[k] + torch.randn(v.shape, generator=gen)).requires_grad_() for k, v in g.items()}
    term = prog.terms[0].fn(Batch(x=torch.zeros(1), y=torch.zeros(1), logits=torch.zeros(1), features=None,
                                  params=theta, buffers={}, refs=prog.refs, step=0))
    term.backward()
    for k, th in theta.items():
        assert torch.allclose(th.grad, -g[k] + 0.5 * (th.detach() - msg.tensors[k]), atol=1e-6), k
    trained = {k: v.detach() for k, v in theta.items()}
    _, state = prog.finalize(trained, TrainStats(steps=3, samples=30))
    for k in g:
        assert torch.allclose(state["g"][k], g[k] - 0.5 * (trained[k] - msg.tensors[k]))
