"""Ditto: a personal model v trained on F_k(v) + λ/2‖v − w^t‖², the global model trained and averaged as FedAvg's;
each client evaluates v."""

from __future__ import annotations

import torch

from fedfuse.algorithms.ditto import PERSONAL, proximal_pull
from fedfuse.config import RunConfig, apply
from fedfuse.engine.client import task_loss
from fedfuse.engine.context import seeded_state
from fedfuse.runner import experiment
from fedfuse.types import Message
from support import check_same_seed_same_run


def _cfg(**kw) -> RunConfig:
    base = dict(algorithm="ditto", dataset="digits", model="mlp", model_options={"widths": [16]}, clients=4,
                clients_per_round=2, rounds=2, batch_size=32, lr=0.05, seed=2, plots=False, local_epochs=1,
                partition_options={"alpha": 0.5, "min_size": 20}, algorithm_options={"lam": 0.5})
    base.update(kw)
    return apply(RunConfig(), base)


def test_the_proximal_pull_by_hand():
    v = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    w = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([[1.0]])}
    assert proximal_pull(v, w, 0.5).item() == 0.25 * (1 + 4 + 4)
    p = {k: t.clone().requires_grad_(True) for k, t in v.items()}
    proximal_pull(p, w, 0.5).backward()
    for k in v:  # ∇ = λ(v − w)
        torch.testing.assert_close(p[k].grad, 0.5 * (v[k] - w[k]))


def test_one_personal_step_is_v_minus_eta_grad_f_plus_lambda_pull():
    """With one SGD step (batch = the whole training split), v⁺ = v − η(∇F_k(v) + λ(v − w^t)) by autograd on the
    formula; v starts as w^0, the run's initial model, and w^t is a different received model."""
    exp = experiment(_cfg(batch_size=10_000))
    algo, data, ctx = exp.algo, exp.fed.clients[0], exp.ctx
    w0 = seeded_state(ctx, ctx.seed)
    wt = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in w0.items()}
    _, state = algo.fit(Message(wt), None, data, torch.Generator().manual_seed(0))
    v = {k: t.clone().requires_grad_(True) for k, t in w0.items()}
    model = ctx.model()
    logits = torch.func.functional_call(model, v, (data.train.x,))
    (task_loss(logits, data.train.y) + proximal_pull(v, wt, 0.5)).backward()
    for k in w0:
        torch.testing.assert_close(state[PERSONAL][k], w0[k] - 0.05 * v[k].grad, rtol=1e-5, atol=1e-6)


def test_the_global_model_is_fedavgs_step_and_the_personal_model_stays_home():
    """The reply is the standard step from w^t (the personal training ran first on the same generator); the
    personal model is the client's state, evaluated, never sent; a never-sampled client evaluates w^0."""
    exp = experiment(_cfg(rounds=1))
    exp.run()
    trained = exp.history[0]["clients"]
    assert all(PERSONAL in exp.client_states[c] for c in trained)
    untouched = [c for c in range(4) if c not in trained]
    data = exp.fed.clients[untouched[0]]
    gen = torch.Generator()
    got = exp.algo.evaluate(Message(exp.state["global"]), None, data, gen)
    ref = exp.algo.evaluate(Message(exp.state["global"]), {PERSONAL: seeded_state(exp.ctx, exp.ctx.seed)}, data, gen)
    assert got == ref
    own = exp.algo.evaluate(Message(exp.state["global"]), exp.client_states[trained[0]], exp.fed.clients[trained[0]],
                            gen)
    assert own["test_accuracy"] == exp.history[0]["client_test_accuracy"][str(trained[0])]
    assert exp.history[0]["global_accuracy"] is not None  # the global model is still the run's


def test_the_work_counts_both_trainings():
    exp = experiment(_cfg(rounds=1))
    exp.run()
    avg = experiment(_cfg(rounds=1, algorithm="fedavg", algorithm_options={}), fed=exp.fed)
    avg.run()
    assert exp.history[0]["client_flops"] == 2 * avg.history[0]["client_flops"]  # one personal epoch, one global
    assert exp.history[0]["optimised_parameters_per_client"] == 2 * avg.history[0]["optimised_parameters_per_client"]
    assert exp.history[0]["bytes_up"] == avg.history[0]["bytes_up"]


def test_same_seed_same_run():
    check_same_seed_same_run(_cfg(), metric="personal_accuracy")


def test_the_declared_privacy_mechanisms_run(tmp_path):
    """The entry admits SecAgg and central DP on the global model: under secagg=true the server's model equals the
    plain run's (float tolerance) from the masked sums alone; under dp=central the run reports ε and moves."""
    plain = experiment(_cfg(rounds=2, clients=6, clients_per_round=4))
    plain.run()
    secure = experiment(_cfg(rounds=2, clients=6, clients_per_round=4, secagg=True), fed=plain.fed)
    secure.algo.aggregate_fit = None  # the server never sees an individual reply
    secure.run()
    for k, v in plain.state["global"].items():
        torch.testing.assert_close(secure.state["global"][k].double(), v.double(), rtol=0, atol=1e-5)
    dp = experiment(_cfg(rounds=2, clients=6, clients_per_round=4, dp="central", dp_noise=1.0, dp_clip=1.0,
                         sampling="poisson"), fed=plain.fed)
    dp.run()
    assert dp.history[-1]["dp_epsilon"] is not None and dp.history[-1]["dp_epsilon"] > 0
