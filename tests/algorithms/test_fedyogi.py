"""FedYogi: two server steps by hand (Reddi et al. 2021, Algorithm 2, no bias correction):
``m = β₁ m + (1 − β₁) Δ``, ``v = v − (1 − β₂) Δ² sign(v − Δ²)``, ``x ← x + η m / (√v + τ)``."""

import torch

from support import server_steps


def test_two_server_steps_follow_the_yogi_recurrence():
    eta, b1, b2, tau = 0.1, 0.5, 0.75, 0.01
    steps = server_steps("fedyogi", {"eta": eta, "beta_1": b1, "beta_2": b2, "tau": tau})
    m = {k: torch.zeros_like(v) for k, v in steps[0][0].items()}
    v = {k: torch.zeros_like(t) for k, t in steps[0][0].items()}
    assert len(steps) == 2
    for x, mean, new in steps:
        for k in x:
            d = mean[k] - x[k]
            m[k] = b1 * m[k] + (1 - b1) * d
            v[k] = v[k] - (1 - b2) * d * d * torch.sign(v[k] - d * d)
            torch.testing.assert_close(new[k], x[k] + eta * m[k] / (v[k].sqrt() + tau), rtol=0, atol=1e-6)
