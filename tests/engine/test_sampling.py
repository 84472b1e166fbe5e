"""Client sampling policies (engine option ``sampling``): Fraboni et al.'s inclusion property,
determinism, resume, and that every policy runs with an ordinary algorithm."""

import json

import numpy as np
import pytest

from fedfuse.config import ConfigError, apply, validate
from fedfuse.engine.sampling import (
    ClusteredSampler,
    angle_matrix,
    clustered_distributions,
    draw,
    size_distributions,
)
from fedfuse.runner import experiment
from support import sampling_cfg


def _check_distributions(r: np.ndarray, m: int, p: np.ndarray) -> None:
    assert r.shape == (m, len(p))
    assert (r >= -1e-12).all()
    np.testing.assert_allclose(r.sum(axis=1), 1.0, atol=1e-9)  # each is a distribution
    np.testing.assert_allclose(r.sum(axis=0), m * p, atol=1e-9)  # Σ_k r_{k,i} = m p_i  (Proposition 1)


@pytest.mark.parametrize("m", [1, 3, 5])
def test_algorithm1_keeps_each_clients_expected_weight(m):
    p = np.array([5, 1, 1, 3, 9, 2, 2, 7], dtype=float)
    p /= p.sum()
    _check_distributions(size_distributions(m, p), m, p)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_algorithm2_keeps_each_clients_expected_weight_and_groups_similar_clients(seed):
    rng = np.random.default_rng(seed)
    k, m = 12, 4
    p = rng.uniform(0.5, 2.0, k)
    p /= p.sum()
    # four families of clients with almost parallel gradients
    centres = rng.normal(size=(4, 30))
    fam = np.arange(k) % 4
    grads = centres[fam] + 0.01 * rng.normal(size=(k, 30))
    r = clustered_distributions(m, p, grads, np.random.default_rng(seed))
    _check_distributions(r, m, p)
    # a distribution holds mostly one family: similar clients are not sampled together
    for row in r:
        by_family = np.bincount(fam, weights=row, minlength=4)
        assert by_family.max() > 0.5


def test_heavy_client_is_spread_over_several_distributions():
    p = np.array([0.6, 0.1, 0.1, 0.1, 0.1])
    r = clustered_distributions(3, p, np.random.default_rng(0).normal(size=(5, 4)), np.random.default_rng(0))
    _check_distributions(r, 3, p)
    assert (r[:, 0] > 0).sum() >= 2


def test_clustered_sampling_inclusion_frequency_matches_m_p():
    """Monte Carlo: the expected number of draws of client i is m·p_i, as the paper states."""
    rng = np.random.default_rng(7)
    k, m = 10, 3
    p = rng.uniform(0.2, 1.0, k)
    p /= p.sum()
    r = clustered_distributions(m, p, rng.normal(size=(k, 8)), rng)
    counts = np.zeros(k)
    trials = 4000
    for _ in range(trials):
        for c in draw(r, rng):
            counts[c] += 1
    np.testing.assert_allclose(counts / trials, m * p, atol=0.05)


def test_angle_matrix_hand_case():
    g = np.array([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [0.0, 0.0]])
    a = angle_matrix(g)
    np.testing.assert_allclose(a[0, 1], np.pi / 2)
    np.testing.assert_allclose(a[0, 2], np.pi)
    np.testing.assert_allclose(a[0, 0], 0.0, atol=1e-7)
    assert (a[3] == 0).all() and (a[:, 3] == 0).all()  # a client without gradient is at angle 0 (authors' code)


def test_sampler_sketch_preserves_angles_roughly():
    s = ClusteredSampler(2, 1, np.array([1, 1]))
    s.sketch_dim = 4096
    rng = np.random.default_rng(0)
    import torch

    a = torch.tensor(rng.normal(size=20000), dtype=torch.float32)
    b = 0.8 * a + 0.6 * torch.tensor(rng.normal(size=20000), dtype=torch.float32)
    sa = s._flat({"w": a}, {"w": torch.zeros_like(a)})
    sb = s._flat({"w": b}, {"w": torch.zeros_like(b)})
    cos = float(sa @ sb / (sa.norm() * sb.norm()))
    true = float(a @ b / (a.norm() * b.norm()))
    assert sa.numel() == 4096 and abs(cos - true) < 0.05


@pytest.mark.parametrize("policy", ["uniform", "size-weighted", "clustered", "clustered-size"])
def test_every_policy_runs_with_fedavg_and_is_deterministic(tmp_path, policy):
    a = experiment(sampling_cfg(tmp_path / "a", sampling=policy, algorithm="fedprox")).run()
    b = experiment(sampling_cfg(tmp_path / "b", sampling=policy, algorithm="fedprox")).run()
    assert a["final"]["global_accuracy"] == b["final"]["global_accuracy"]
    recs = [json.loads(x) for x in (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()]
    for rec in recs:
        assert 1 <= len(rec["clients"]) <= 3 and rec["clients"] == sorted(set(rec["clients"]))


def test_clustered_sampling_resumes_bit_identically(tmp_path):
    full = experiment(sampling_cfg(tmp_path / "full", algorithm="clusamp", rounds=4)).run()
    cut = sampling_cfg(tmp_path / "cut", algorithm="clusamp", rounds=2)
    experiment(cut).run()
    more = apply(cut, {"rounds": 4})
    resumed = experiment(more).run(resume=True)
    assert resumed["final"]["global_accuracy"] == full["final"]["global_accuracy"]


def test_unknown_policy_and_own_participants_are_rejected(tmp_path):
    with pytest.raises(ConfigError):
        validate(sampling_cfg(tmp_path, sampling="magic"))
    with pytest.raises(ValueError, match="chooses its own participants"):
        experiment(sampling_cfg(tmp_path, algorithm="fedma", sampling="clustered", model="simple-mlp",
                                model_options={}))
