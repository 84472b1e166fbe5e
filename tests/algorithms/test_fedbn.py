"""FedBN: the BatchNorm layers (affine parameters and statistics) stay on each client; every other entry is
averaged as FedAvg averages it."""

from __future__ import annotations

import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.config import RunConfig, apply
from fedfuse.engine.personal import OWN
from fedfuse.errors import ConfigError
from fedfuse.runner import experiment
from fedfuse.structure import batchnorm_keys
from fedfuse.types import FitStats, Message
from support import check_same_seed_same_run


def _cfg(**kw) -> RunConfig:
    base = dict(algorithm="fedbn", dataset="digits", model="resnet9", model_options={"width_mult": 0.25}, clients=4,
                clients_per_round=2, rounds=2, batch_size=32, lr=0.01, seed=1, plots=False, local_epochs=1,
                partition_options={"alpha": 1.0, "min_size": 20})
    base.update(kw)
    return apply(RunConfig(), base)


def test_the_bn_layers_are_declared_local_and_a_model_without_them_is_refused():
    exp = experiment(_cfg())
    bn = batchnorm_keys(exp.ctx.model())
    assert exp.client.own_keys() == bn and len(bn) == 60
    with pytest.raises(ConfigError, match="fedbn needs a model with BatchNorm layers"):
        experiment(_cfg(model="mlp", model_options={"widths": [16]}))


def test_the_server_averages_the_shared_entries_by_samples_and_leaves_bn_alone():
    """Two made-up replies (10 and 30 examples) of the shared entries: the new global entry is (10·a + 30·b)/40,
    by hand, and every BN entry is the server's as it was."""
    exp = experiment(_cfg())
    state = exp.algo.init_state()
    bn = exp.client.own_keys()
    shared = {k: v for k, v in state["global"].items() if k not in bn}
    a = {k: v + 1.0 for k, v in shared.items()}
    b = {k: v - 3.0 for k, v in shared.items()}
    replies = {0: Message(a, stats=FitStats(num_examples=10)), 1: Message(b, stats=FitStats(num_examples=30))}
    new = exp.algo.aggregate_fit(state, RoundInfo(0, 1), replies)["global"]
    for k in shared:
        torch.testing.assert_close(new[k], shared[k] + (10 * 1.0 + 30 * -3.0) / 40, rtol=0, atol=1e-6)
    assert all(torch.equal(new[k], state["global"][k]) for k in bn)


def test_each_client_keeps_its_own_trained_bn_statistics():
    exp = experiment(_cfg(rounds=3, clients_per_round=4))
    exp.run()
    stats = [exp.client_states[c][OWN]["bn1.running_mean"] for c in range(4)]
    assert all(not torch.equal(stats[0], s) for s in stats[1:])  # each client's own inputs' statistics
    assert all(int(exp.client_states[c][OWN]["bn1.num_batches_tracked"]) > 0 for c in range(4))
    rec = exp.history[-1]
    assert rec["global_accuracy"] is None and rec["personal_accuracy"] is not None
    bn_bytes = sum(exp.state["global"][k].numel() * exp.state["global"][k].element_size()
                   for k in exp.client.own_keys())
    full = sum(v.numel() * v.element_size() for v in exp.state["global"].values())
    assert rec["bytes_down"] == 4 * (full - bn_bytes) and rec["bytes_up"] == rec["bytes_down"]


def test_fedbn_differs_from_fedavg_only_by_the_bn_layers():
    """Round 1 from the same model: a client's shared entries are FedAvg's client's; the global update is the
    same on every shared entry (the BN entries are where they differ)."""
    bn_run = experiment(_cfg(rounds=1))
    bn_run.run()
    avg = experiment(_cfg(rounds=1, algorithm="fedavg"), fed=bn_run.fed)
    avg.run()
    bn = bn_run.client.own_keys()
    for k, v in bn_run.state["global"].items():
        if k not in bn:
            assert torch.equal(v, avg.state["global"][k]), k
    assert any(not torch.equal(bn_run.state["global"][k], avg.state["global"][k]) for k in bn)


def test_same_seed_same_run():
    check_same_seed_same_run(_cfg(), metric="personal_accuracy")
