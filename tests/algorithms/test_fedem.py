"""FedEM: EM responsibilities by hand, what travels and is averaged, the client-cost accounting, the declared
M-step against training each learner alone, the mixture objective, determinism."""

import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.algorithms.fedem import e_step
from fedfuse.algorithms.ifca import unpack
from fedfuse.fusion.average import weighted_average
from fedfuse.rng import torch_generator
from fedfuse.runner import experiment
from fedfuse.types import Message
from support import check_same_seed_same_run, nbytes, nparams
from support import mixture_cfg as cfg_for


def test_fedem_responsibilities_hand_case_and_simplex():
    losses = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 2.0]])  # M=2 learners × n=3 samples
    pi = torch.tensor([0.5, 0.5])
    q, new_pi = e_step(losses, pi)
    e = torch.exp(torch.tensor(-1.0, dtype=torch.float64))
    torch.testing.assert_close(q[0], torch.stack([1 / (1 + e), e / (1 + e)]))
    torch.testing.assert_close(q[2], torch.tensor([0.5, 0.5], dtype=torch.float64))
    torch.testing.assert_close(new_pi, q.mean(0))
    q2, pi2 = e_step(torch.rand(4, 50) * 5, torch.tensor([0.1, 0.2, 0.3, 0.4]))
    torch.testing.assert_close(q2.sum(1), torch.ones(50, dtype=torch.float64))
    assert bool((q2 >= 0).all()) and float(pi2.sum()) == pytest.approx(1.0)
    # the prior matters: equal losses give q = π
    q3, _ = e_step(torch.zeros(2, 3), torch.tensor([0.25, 0.75]))
    torch.testing.assert_close(q3, torch.tensor([[0.25, 0.75]] * 3, dtype=torch.float64))


def test_fedem_accounting_and_aggregation():
    M = 3
    exp = experiment(cfg_for("fedem", algorithm_options={"m": M}))
    algo = exp.algo
    state = algo.init_state()
    assert not torch.equal(state["learners"][0]["fc.weight"], state["learners"][1]["fc.weight"])  # independent
    payloads = algo.configure_fit(state, RoundInfo(0, 1), [0, 4])
    assert payloads[0].nbytes == M * nbytes(exp)
    results, cstates = {}, {}
    for c in (0, 4):
        results[c], cstates[c] = algo.fit(payloads[c], algo.init_client_state(c), exp.fed.clients[c],
                                          torch_generator(1, c))
    r = results[0]
    assert r.nbytes == M * nbytes(exp) and r.stats.trained_params == M * nparams(exp)
    n = len(exp.fed.clients[0].train)
    assert r.stats.samples == M * n  # every learner trains on every sample
    fa = experiment(cfg_for("fedavg"))
    fa_meta = fa.algo.fit(Message(fa.algo.init_state()["global"]), None, fa.fed.clients[0], torch_generator(1, 0))[0]
    assert r.stats.flops > M * fa_meta.stats.flops  # M trainings + M E-step forward passes
    pi = cstates[0]["pi"]
    assert float(pi.sum()) == pytest.approx(1.0) and not torch.allclose(pi, torch.full((M,), 1 / M,
                                                                                     dtype=torch.float64))
    new = algo.aggregate_fit(state, RoundInfo(0, 1), results)
    for m in range(M):
        expect = weighted_average([unpack(results[c].tensors, M)[m] for c in (0, 4)],
                                  [results[c].stats.num_examples for c in (0, 4)])
        for k, v in expect.items():
            torch.testing.assert_close(new["learners"][m][k], v)
    assert algo.server_parameters(new) == M * nparams(exp)


def test_fedem_stale_average_includes_unsampled_clients():
    exp = experiment(cfg_for("fedem", algorithm_options={"m": 2, "stale_average": True}))
    algo = exp.algo
    state = algo.init_state()
    p = algo.configure_fit(state, RoundInfo(0, 1), [1])[1]
    res = {1: algo.fit(p, None, exp.fed.clients[1], torch_generator(0, 1))[0]}
    new = algo.aggregate_fit(state, RoundInfo(0, 1), res)
    n1, N = float(len(exp.fed.clients[1].train)), float(exp.ctx.client_sizes.sum())
    k = "fc.bias"
    expect = (N - n1) / N * state["learners"][0][k] + n1 / N * unpack(res[1].tensors, 2)[0][k]
    torch.testing.assert_close(new["learners"][0][k], expect)


@pytest.mark.parametrize("train", [dict(), dict(momentum=0.9, weight_decay=1e-3), dict(optimizer="adam", lr=0.01)])
def test_fedem_declared_m_step_equals_training_each_learner_alone(train):
    """The M-step as one program on the stacked learners (what every executor runs) equals the separate
    per-learner loop on the same batches: same π, states within float tolerance, identical accounting."""
    M = 3
    exp = experiment(cfg_for("fedem", algorithm_options={"m": M}, local_epochs=2, **train))
    algo = exp.algo
    state = algo.init_state()
    payload = algo.configure_fit(state, RoundInfo(0, 1), [2])[2]
    data = exp.fed.clients[2]
    assert algo.client_program(payload, None, data) is not None
    joint, js = algo.fit(payload, None, data, torch_generator(3, 2))
    algo.client_program = lambda *a: None  # force the separate loop on this instance
    alone, as_ = algo.fit(payload, None, data, torch_generator(3, 2))
    torch.testing.assert_close(js["pi"], as_["pi"], rtol=0, atol=0)
    for k, v in alone.tensors.items():
        torch.testing.assert_close(joint.tensors[k], v, rtol=1e-5, atol=1e-6)
    assert (joint.stats.samples, joint.stats.steps, joint.stats.flops, joint.stats.trained_params) == (
        alone.stats.samples, alone.stats.steps, alone.stats.flops, alone.stats.trained_params)
    assert joint.stats.train_loss == pytest.approx(alone.stats.train_loss, rel=1e-5)


def test_fedem_mixture_objective_hand_case():
    from fedfuse.fusion.mixture import mixture_objective

    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0]], [[0.0, 0.0], [3.0, -1.0]]])  # (B=2, M=2, C=2)
    targets = torch.tensor([[0.0, 0.25, 0.75], [1.0, 1.0, 0.0]])  # label, q_1, q_2
    ce = lambda z, y: float(-torch.log_softmax(torch.tensor(z), 0)[y])  # noqa: E731
    expect = torch.tensor([0.25 * ce([2.0, 0.0], 0) + 0.75 * ce([0.0, 1.0], 0), 1.0 * ce([0.0, 0.0], 1)])
    torch.testing.assert_close(mixture_objective(logits, targets), expect)


def test_fedem_keeps_the_separate_loop_for_gradient_clipping():
    exp = experiment(cfg_for("fedem", algorithm_options={"m": 2}, grad_clip=1.0))
    payload = exp.algo.configure_fit(exp.algo.init_state(), RoundInfo(0, 1), [0])[0]
    assert exp.algo.client_program(payload, None, exp.fed.clients[0]) is None
    reply, st = exp.algo.fit(payload, None, exp.fed.clients[0], torch_generator(0, 0))
    assert reply.stats.samples == 2 * len(exp.fed.clients[0].train) and float(st["pi"].sum()) == pytest.approx(1.0)


@pytest.mark.parametrize("algorithm", ["fedem"])
def test_same_seed_identical_metrics(algorithm):
    check_same_seed_same_run(cfg_for(algorithm), "personal_accuracy")
