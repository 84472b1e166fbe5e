"""FedMut: the mutation radius schedule, the paired mutation coefficients, a round against the construction,
determinism."""


import numpy as np
import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.algorithms.fedmut import mutate, mutation_coefficients, mutation_radius
from fedfuse.fusion.average import weighted_average
from fedfuse.rng import numpy_rng
from fedfuse.runner import experiment
from support import BN_MODEL, check_same_seed_same_run
from support import baseline_cfg as cfg_for
from support import fake_state_results as fake_results


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


@pytest.mark.parametrize("algorithm", ["fedmut"])
def test_same_seed_same_metrics(algorithm):
    check_same_seed_same_run(cfg_for(algorithm=algorithm), "global_accuracy")
