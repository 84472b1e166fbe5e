"""FedAvgM: server momentum by hand over two rounds, ``m₁ = Δ₁``, ``m₂ = β m₁ + Δ₂``, ``x ← x + η m``."""

import torch

from support import server_steps


def test_two_server_steps_follow_the_momentum_recurrence():
    lr, beta = 0.5, 0.9
    (x0, mean1, x1), (x1_again, mean2, x2) = server_steps("fedavgm", {"server_lr": lr, "server_momentum": beta})
    d1 = {k: mean1[k] - x0[k] for k in x0}
    for k in x0:
        torch.testing.assert_close(x1[k], x0[k] + lr * d1[k], rtol=0, atol=1e-6)
        m2 = beta * d1[k] + (mean2[k] - x1_again[k])
        torch.testing.assert_close(x2[k], x1_again[k] + lr * m2, rtol=0, atol=1e-6)
    # the momentum carries: the second step differs from a momentum-free one
    k = next(iter(x0))
    assert not torch.allclose(x2[k], x1_again[k] + lr * (mean2[k] - x1_again[k]), atol=1e-4)
