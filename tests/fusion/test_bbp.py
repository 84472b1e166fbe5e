"""BBP-MAP (fusion/bbp.py): the cost against its formula, growth for dissimilar units, permutation recovery,
determinism, the fast scalar path, certified assignments and skipping settled passes."""

import math

import numpy as np
import pytest
import torch

from fedfuse.fusion.bbp import bbp_cost, bbp_map
from fedfuse.fusion.match import match_group
from fedfuse.fusion.permute import (
    Member,
    PermGroup,
)


def test_bbp_identical_clients_same_layer_no_new_atoms():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(30, 24))
    J = 4
    res = bbp_map([w.copy() for _ in range(J)], sigma=0.1, sigma0=0.1, mu0=0.0, rng=np.random.default_rng(0))
    assert res.atoms.shape == w.shape  # no spurious new atoms
    assert all(np.array_equal(a, np.arange(30)) for a in res.assign)
    assert np.array_equal(res.counts, np.full(30, J))
    # posterior mean g/p = (mu0 s0 + J s w)/(s0 + J s) with s = s0 = 10, mu0 = 0
    np.testing.assert_allclose(res.atoms, J * 10 * w / (10 + J * 10), rtol=1e-12)
    # and through match_group with the plain-mean estimator: exactly the same layer
    state = {"l.weight": torch.as_tensor(w[:, :23]), "l.bias": torch.as_tensor(w[:, 23]),
             "n.weight": torch.zeros(2, 30)}
    g = PermGroup("l", 30, (Member("l.weight", 0), Member("l.bias", 0), Member("n.weight", 1, role="out")))
    gm = match_group([state] * J, g, estimator="mean", sigma=0.1, sigma0=0.1)
    assert gm.size == 30
    torch.testing.assert_close(gm.tensors["l.weight"], state["l.weight"], rtol=0, atol=1e-12)
    torch.testing.assert_close(gm.tensors["l.bias"], state["l.bias"], rtol=0, atol=1e-12)


def test_bbp_recovers_a_permutation_with_the_code_hyperparameters():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(40, 30))  # |w|^2 ~ 30: matching beats opening atoms at sigma = sigma0 = 1
    perm = rng.permutation(40)
    res = bbp_map([w, w[perm]], rng=np.random.default_rng(0))
    assert res.atoms.shape[0] == 40
    assert np.array_equal(res.assign[1], perm)  # local unit l of client 2 is unit perm[l] of client 1
    np.testing.assert_allclose(res.atoms, 2 * w / 3, rtol=1e-12)  # (w + w) / (1 + 2)


def test_bbp_cost_matches_the_formula_unit_by_unit():
    rng = np.random.default_rng(3)
    D, L, Lj, J, gamma = 5, 4, 3, 3, 7.0
    s, s0 = np.full(D, 1 / 0.5), np.full(D, 1 / 2.0)
    mu0 = np.array([0, 0, 0, 0, 0.1])
    prior = mu0 * s0
    g = rng.normal(size=(L, D))
    counts = np.array([1, 2, 2, 1])
    p = s0 + counts[:, None] * s
    swj = rng.normal(size=(Lj, D)) * s
    cost = bbp_cost(swj, g, p, counts, s, s0, prior, gamma, J, cap=700)
    assert cost.shape == (Lj, L + Lj)
    for l in range(Lj):
        for i in range(L):
            want = ((g[i] + swj[l]) ** 2 / (p[i] + s) - g[i] ** 2 / p[i]).sum() + math.log(counts[i] / (J - counts[i]))
            assert cost[l, i] == pytest.approx(want, rel=1e-12)
        for k in range(1, Lj + 1):
            want = ((swj[l] + prior) ** 2 / (s0 + s) - prior**2 / s0).sum() - 2 * math.log(k) + 2 * math.log(gamma / J)
            assert cost[l, L + k - 1] == pytest.approx(want, rel=1e-12)
    # the cap bounds how many new atoms may open (but every unit keeps a column)
    assert bbp_cost(swj, g, p, counts, s, s0, prior, gamma, J, cap=L + 1).shape == (Lj, L + 1)


def test_bbp_grows_for_dissimilar_units_and_respects_the_hand_computed_decision():
    # One unit each, D = 1, s = s0 = 1, mu0 = 0, J = 2, gamma = 7:
    # match score = (a + b)^2/3 - a^2/2 + log(1/1); new score = b^2/2 + 2 log(3.5).
    for a, b, grows in ((3.0, 3.0, False), (3.0, -3.0, True), (0.1, 0.1, True)):
        res = bbp_map([np.array([[a]]), np.array([[b]])], iters=0)
        match, new = (a + b) ** 2 / 3 - a**2 / 2, b**2 / 2 + 2 * math.log(3.5)
        assert (new > match) == grows
        assert res.atoms.shape[0] == (2 if grows else 1)


def test_bbp_is_deterministic_given_the_generator():
    rng = np.random.default_rng(8)
    atoms = [rng.normal(size=(12, 6)) * 0.3 for _ in range(3)]
    r1 = bbp_map(atoms, rng=np.random.default_rng(5))
    r2 = bbp_map(atoms, rng=np.random.default_rng(5))
    assert np.array_equal(r1.atoms, r2.atoms)
    assert all(np.array_equal(a, b) for a, b in zip(r1.assign, r2.assign))
    for a in r1.assign:  # each client's units land on distinct global units
        assert len(set(a.tolist())) == len(a) and a.max() < r1.atoms.shape[0]
    np.testing.assert_array_equal(np.bincount(np.concatenate(r1.assign), minlength=r1.atoms.shape[0]), r1.counts)


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_bbp_fast_scalar_path_equals_the_elementwise_formula(precision):
    """Scalar σ, σ0 (one product per update) and per-dimension arrays (elementwise bbp_cost) agree exactly."""
    rng = np.random.default_rng(5)
    theta = rng.normal(0, 0.5, size=(25, 17))
    clients = [(theta + rng.normal(0, 0.2, size=theta.shape))[rng.permutation(25)][: 25 - 3 * j] for j in range(4)]
    clients.append(rng.normal(0, 0.5, size=(12, 17)))  # unrelated units: new atoms
    mu0 = np.r_[np.zeros(16), 0.1]
    kw = dict(gamma=7.0, mu0=mu0, iters=3, cap=40)
    fast = bbp_map(clients, sigma=1.0, sigma0=1.0, rng=np.random.default_rng(3), precision=precision, **kw)
    slow = bbp_map(clients, sigma=np.ones(17), sigma0=np.ones(17), rng=np.random.default_rng(3), **kw)
    assert fast.atoms.shape[0] > 25  # the unrelated client opened atoms
    for a, b in zip(fast.assign, slow.assign):
        assert np.array_equal(a, b)
    np.testing.assert_array_equal(fast.counts, slow.counts)
    np.testing.assert_allclose(fast.atoms, slow.atoms, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fast.p, slow.p, rtol=0, atol=0)


def test_bbp_certified_assignments_equal_the_solver():
    """The dual-certificate shortcut returns exactly the solver's assignments, and it does fire."""
    rng = np.random.default_rng(11)
    theta = rng.normal(0, 0.3, size=(40, 30))
    clients = [(theta + rng.normal(0, 0.1, size=theta.shape))[rng.permutation(40)] for _ in range(5)]
    clients += [rng.normal(0, 0.3, size=(15, 30)), np.vstack([clients[0][:10], rng.normal(0, 0.3, size=(8, 30))])]
    mu0 = np.r_[np.zeros(29), 0.1]
    a = bbp_map(clients, mu0=mu0, rng=np.random.default_rng(2))
    b = bbp_map(clients, mu0=mu0, rng=np.random.default_rng(2), certify=False)
    assert a.atoms.shape[0] > 40  # new atoms were opened
    for x, y in zip(a.assign, b.assign):
        assert np.array_equal(x, y)
    np.testing.assert_array_equal(a.g, b.g)
    assert a.solver_stats["certified"] > 0 and b.solver_stats["certified"] == 0


def test_certified_assignment_hand_cases():
    from fedfuse.fusion.bbp import _certified_assignment

    c = np.array([0.0, -1.0, -2.0])  # new-atom column offsets (decreasing)
    score = np.array([[5.0, 1.0], [1.0, 4.0], [0.0, 0.5]])
    new = np.array([0.0, 0.0, 3.0])  # row 2 prefers a new atom (3 + 0 > 0.5)
    assert _certified_assignment(score, new, c).tolist() == [0, 1, 2]
    score2 = np.array([[5.0, 1.0], [4.0, 1.0]])  # both rows want atom 0: no certificate
    assert _certified_assignment(score2, np.zeros(2), c) is None
    tie = np.array([[5.0, 5.0], [1.0, 4.0]])  # row 0 has two best atoms: not unique
    assert _certified_assignment(tie, np.zeros(2), c) is None
    two_new = np.array([[0.0, 0.0], [0.0, 0.0]])
    assert _certified_assignment(two_new, np.array([3.0, 2.5]), c).tolist() == [2, 3]  # 3 > 0 and 2.5 - 1 > 0


@pytest.mark.parametrize("dim", [6, 40])
def test_bbp_skipping_settled_passes_equals_computing_every_pass(dim):
    """Once every client re-matches without changing the grouping, the remaining passes are skipped (only the
    atoms' order is kept up to date): assignments, counts and atoms equal the run that computes every pass, and
    the caller's generator ends in the same state."""
    rng = np.random.default_rng(21)
    theta = rng.normal(0, 0.3, size=(30, dim))
    clients = [(theta + rng.normal(0, 0.1, size=theta.shape))[rng.permutation(30)] for _ in range(6)]
    clients.append(rng.normal(0, 0.3, size=(9, dim)))  # unrelated units: atoms of their own
    mu0 = np.r_[np.zeros(dim - 1), 0.1]
    g1, g2 = np.random.default_rng(4), np.random.default_rng(4)
    fast = bbp_map(clients, mu0=mu0, iters=6, rng=g1)
    full = bbp_map(clients, mu0=mu0, iters=6, rng=g2, skip_settled=False)
    assert fast.solver_stats["settled"] > 0 and full.solver_stats["settled"] == 0
    assert (fast.counts == 1).any()  # some atoms hold one client's unit alone: they move to the end every pass
    for a, b in zip(fast.assign, full.assign):
        assert np.array_equal(a, b)
    np.testing.assert_array_equal(fast.counts, full.counts)
    np.testing.assert_allclose(fast.atoms, full.atoms, rtol=1e-12, atol=1e-12)
    assert g1.random() == g2.random()


@pytest.mark.parametrize("seed", range(6))
def test_bbp_two_clients_are_settled_after_the_first_match(seed):
    """Two equal-size clients: re-matching either one is the first match with the roles swapped (the objectives
    differ by a constant), so no pass is recomputed — and every pass computed agrees."""
    rng = np.random.default_rng(seed)
    dim = 5 + 10 * (seed % 3)
    theta = rng.normal(0, 0.3, size=(16, dim))
    noise = 0.1 + 0.1 * (seed % 2)
    clients = [(theta + rng.normal(0, noise, size=theta.shape))[rng.permutation(16)] for _ in range(2)]
    clients[1][:4] = rng.normal(0, 0.3, size=(4, dim))  # units the other client does not have: new atoms
    mu0 = np.r_[np.zeros(dim - 1), 0.1]
    fast = bbp_map(clients, mu0=mu0, rng=np.random.default_rng(seed))
    full = bbp_map(clients, mu0=mu0, rng=np.random.default_rng(seed), skip_settled=False, certify=False)
    assert fast.solver_stats["settled"] == 10 and fast.solver_stats["unchanged"] == 0
    for a, b in zip(fast.assign, full.assign):
        assert np.array_equal(a, b)
    np.testing.assert_array_equal(fast.counts, full.counts)
    np.testing.assert_allclose(fast.atoms, full.atoms, rtol=1e-12, atol=1e-12)


def test_bbp_settled_skipping_on_random_problems():
    """Random sizes, noise, σ, σ0, γ, caps and pass counts: skipping settled passes never changes the result
    of computing every pass with the solver (and it does skip in most problems)."""
    skipped = 0
    for seed in range(40):
        rng = np.random.default_rng(700 + seed)
        L, dim, J = int(rng.integers(1, 20)), int(rng.integers(2, 30)), int(rng.integers(1, 7))
        theta = rng.normal(0, 0.3, size=(L, dim))
        noise = rng.uniform(0.02, 0.5)
        sizes = [max(1, L - int(rng.integers(0, 3))) for _ in range(J)]
        clients = [(theta + rng.normal(0, noise, size=theta.shape))[rng.permutation(L)][:n] for n in sizes]
        kw = dict(sigma=float(rng.uniform(0.3, 2)), sigma0=float(rng.uniform(0.3, 2)), gamma=float(rng.uniform(1, 10)),
                  mu0=np.r_[np.zeros(dim - 1), 0.1], cap=int(rng.integers(L, 3 * L + 2)), iters=int(rng.integers(0, 7)))
        fast = bbp_map(clients, rng=np.random.default_rng(seed), **kw)
        full = bbp_map(clients, rng=np.random.default_rng(seed), skip_settled=False, certify=False, **kw)
        skipped += fast.solver_stats["settled"] > 0
        for a, b in zip(fast.assign, full.assign):
            assert np.array_equal(a, b), seed
        np.testing.assert_allclose(fast.atoms, full.atoms, rtol=1e-10, atol=1e-10)
    assert skipped >= 20
