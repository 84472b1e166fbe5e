"""Mixture objectives (fusion/mixture.py): the language-model mixture loss Σ_m q_m ℓ_m by hand, padding ignored."""

import pytest
import torch

from fedfuse.adapters.evaluate import IGNORE
from fedfuse.fusion.mixture import mixture_objective as lm_mixture_objective


def test_lm_mixture_objective_hand_case():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4, 5)  # B=2 rows, M=3 adapters, T=4 tokens, V=5
    y = torch.tensor([[1, 2, IGNORE, 0], [IGNORE, IGNORE, IGNORE, 4]])
    q = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    got = lm_mixture_objective(logits, torch.cat([y.float(), q], dim=1))
    for b in range(2):
        counted = [t for t in range(4) if y[b, t] != IGNORE]
        want = sum(float(q[b, m]) * sum(-torch.log_softmax(logits[b, m, t], -1)[y[b, t]] for t in counted)
                   / len(counted) for m in range(3))
        assert float(got[b]) == pytest.approx(float(want), rel=1e-6)
