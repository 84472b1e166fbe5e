"""MOON: the model-contrastive term μ·ℓ_con (global model positive, previous local model negative), its FLOPs and
its absence in a client's first round."""

from __future__ import annotations

import math

import pytest
import torch

from fedfuse.algorithms.moon import GLOB, PREV, PREVIOUS, moon_term
from fedfuse.config import RunConfig, apply
from fedfuse.engine.client import forward_flops_per_sample
from fedfuse.engine.program import Batch
from fedfuse.engine.representation import FeatureView, contrastive_loss
from fedfuse.runner import experiment
from fedfuse.types import Message
from support import check_same_seed_same_run


def _cfg(**kw) -> RunConfig:
    base = dict(algorithm="moon", dataset="digits", model="mlp", model_options={"widths": [16]}, clients=4,
                clients_per_round=4, rounds=2, batch_size=32, lr=0.05, seed=2, plots=False, local_epochs=1,
                partition_options={"alpha": 0.5, "min_size": 20})
    base.update(kw)
    return apply(RunConfig(), base)


def test_the_contrastive_loss_by_hand():
    """z = (1, 0), z_glob = (1, 0), z_prev = (0, 1), τ = 0.5: −log(e^{1/τ} / (e^{1/τ} + e^{0/τ})) = log(1 + e^{−2})."""
    z, zg, zp = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    assert contrastive_loss(z, zg, zp, 0.5).item() == pytest.approx(math.log(1 + math.exp(-2.0)), rel=1e-6)
    assert contrastive_loss(z, zg, zg, 0.5).item() == pytest.approx(math.log(2.0), rel=1e-6)  # previous = global


def test_the_term_reads_the_frozen_models_from_refs():
    """The declared term on a batch equals μ·ℓ_con computed directly from the three models' features."""
    exp = experiment(_cfg())
    model = exp.ctx.model()
    g = torch.Generator().manual_seed(0)
    glob = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    prev = {k: v - 0.1 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    x = exp.fed.clients[0].train.x[:5]
    z = model.features(x)
    refs = {**{GLOB + k: v for k, v in glob.items()}, **{PREV + k: v for k, v in prev.items()}}
    b = Batch(x, torch.zeros(5, dtype=torch.long), model(x), z, {}, {}, refs, 0)
    view = FeatureView(exp.ctx.build()).eval()
    got = moon_term(view, 2.0, 0.5).fn(b)
    fg = FeatureView(exp.ctx.build())
    fg.model.load_state_dict(glob)
    fp = FeatureView(exp.ctx.build())
    fp.model.load_state_dict(prev)
    want = 2.0 * contrastive_loss(z, fg(x), fp(x), 0.5)
    torch.testing.assert_close(got, want)


def test_the_first_round_has_no_term_and_later_rounds_count_two_frozen_passes():
    exp = experiment(_cfg(rounds=1))
    exp.run()
    algo, data = exp.algo, exp.fed.clients[0]
    payload = Message(exp.state["global"])
    first = algo.client_program(payload, None, data)
    assert first.terms == () and not first.features
    later = algo.client_program(payload, exp.client_states[0], data)
    assert [t.name for t in later.terms] == ["moon-contrastive"] and later.features
    reply, state = algo.fit(payload, exp.client_states[0], data, torch.Generator().manual_seed(0))
    plain = algo.fit_stats(exp.ctx.model(), data, _stats(reply))
    n = len(data.train)
    extra = 2 * forward_flops_per_sample(FeatureView(exp.ctx.build()), data.train.x, key=("t",)) * n
    assert extra == 2 * 2 * 64 * 16 * n  # the features pass: the hidden layer's multiply-adds, twice
    assert reply.stats.flops == plain.flops + extra
    assert torch.equal(state[PREVIOUS]["fc.weight"], reply.tensors["fc.weight"])  # the new previous model


def _stats(reply):
    from fedfuse.engine.client import TrainStats

    return TrainStats(steps=reply.stats.steps, samples=reply.stats.samples)


def test_mu_zero_is_fedavg():
    moon = experiment(_cfg(algorithm_options={"mu": 0.0}))
    moon.run()
    avg = experiment(_cfg(algorithm="fedavg"), fed=moon.fed)
    avg.run()
    for k, v in avg.state["global"].items():
        assert torch.equal(moon.state["global"][k], v), k


def test_same_seed_same_run():
    check_same_seed_same_run(_cfg())


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
