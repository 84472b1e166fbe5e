"""D-PSGD: gossip matrices, state mixing, the FedAvg special case, the peer byte accounting and determinism."""

import numpy as np
import pytest
import torch

from fedfuse.algorithms.dpsgd import gossip_matrix, mix_states, peer_graph
from fedfuse.runner import experiment
from support import peer_cfg

NPARAMS = 64 * 16 + 16 + 16 * 10 + 10  # mlp widths [16] on digits


@pytest.mark.parametrize("topology", ["ring", "full", "random-ring"])
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_gossip_matrix_is_symmetric_doubly_stochastic(topology, n):
    for r in range(3):
        adj = peer_graph(n, topology, r, seed=4)
        assert (adj == adj.T).all() and not adj.diagonal().any()
        w = gossip_matrix(adj, "metropolis")
        assert (w >= 0).all()
        np.testing.assert_allclose(w.sum(0), 1.0)
        np.testing.assert_allclose(w.sum(1), 1.0)
        np.testing.assert_allclose(w, w.T)
        assert ((w > 0) == (adj | np.eye(n, dtype=bool))).all()  # mixes exactly with the neighbours


def test_ring_and_full_weights_by_hand_and_random_graph_rows():
    np.testing.assert_allclose(gossip_matrix(peer_graph(5, "ring"))[0], [1 / 3, 1 / 3, 0, 0, 1 / 3])
    np.testing.assert_allclose(gossip_matrix(peer_graph(4, "full")), np.full((4, 4), 0.25))
    # star on 4 nodes (irregular): metropolis differs from the uniform average, both rows sum to 1
    adj = np.zeros((4, 4), dtype=bool)
    adj[0, 1:] = adj[1:, 0] = True
    w = gossip_matrix(adj)
    np.testing.assert_allclose(w[1], [0.25, 0.75, 0, 0])
    np.testing.assert_allclose(w.sum(0), 1.0)
    u = gossip_matrix(adj, "uniform")
    np.testing.assert_allclose(u[1], [0.5, 0.5, 0, 0])
    np.testing.assert_allclose(u.sum(1), 1.0)
    rnd = peer_graph(6, "random", r=1, seed=0, degree=3)
    assert (rnd.sum(1) == 3).all() and not rnd.diagonal().any()


def test_mix_states_hand_case_and_integer_buffers():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(7)}
    out = mix_states({0: a, 1: b}, {0: 0.25, 1: 0.75})
    torch.testing.assert_close(out["w"], torch.tensor([2.5, 5.0]))
    assert int(out["n"]) == 7


def test_dpsgd_on_the_full_graph_is_fedavg_with_full_participation():
    d = experiment(peer_cfg(algorithm="dpsgd", algorithm_options={"topology": "full"}))
    d.run()
    f = experiment(peer_cfg(algorithm="fedavg", algorithm_options={"weighting": "uniform"}))
    f.run()
    for k, v in f.state["global"].items():
        torch.testing.assert_close(d.state["global"][k], v, rtol=1e-5, atol=1e-6)
    assert d.history[-1]["bytes_up"] == 0 and d.history[-1]["bytes_down"] == 0


def test_dpsgd_ring_peer_bytes_and_determinism():
    a = experiment(peer_cfg(algorithm="dpsgd", rounds=3))
    sa = a.run()
    b = experiment(peer_cfg(algorithm="dpsgd", rounds=3)).run()
    assert sa["final"]["personal_accuracy"] == b["final"]["personal_accuracy"]
    # each of 5 participants sends its whole model (4-byte floats) to 2 ring neighbours, except in the last round
    per_round = 5 * 2 * NPARAMS * 4
    assert [h["bytes_peer"] for h in a.history] == [per_round, per_round, 0]
    assert a.history[0]["server_parameters"] == 0
