"""FedAdagrad: two server steps by hand (Reddi et al. 2021, Algorithm 2 with β₁ = 0):
``v = v + Δ²``, ``x ← x + η Δ / (√v + τ)``."""

import torch

from support import server_steps


def test_two_server_steps_follow_the_adagrad_recurrence():
    eta, tau = 0.1, 0.01
    (x0, mean1, x1), (x1_again, mean2, x2) = server_steps("fedadagrad", {"eta": eta, "tau": tau})
    for k in x0:
        d1, d2 = mean1[k] - x0[k], mean2[k] - x1_again[k]
        torch.testing.assert_close(x1[k], x0[k] + eta * d1 / (d1.abs() + tau), rtol=0, atol=1e-6)
        v2 = d1 * d1 + d2 * d2  # the squares accumulate: the second step is damped by the first
        torch.testing.assert_close(x2[k], x1_again[k] + eta * d2 / (v2.sqrt() + tau), rtol=0, atol=1e-6)
