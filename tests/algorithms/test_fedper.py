"""FedPer: the base layers are federated (FedAvg), the last ``personal_layers`` stay on each client."""

from __future__ import annotations

import pytest
import torch

from fedfuse.config import RunConfig, apply
from fedfuse.engine.personal import OWN
from fedfuse.errors import ConfigError
from fedfuse.runner import experiment
from support import check_same_seed_same_run


def _cfg(**kw) -> RunConfig:
    base = dict(algorithm="fedper", dataset="digits", model="mlp", model_options={"widths": [16, 12]}, clients=4,
                clients_per_round=4, rounds=2, batch_size=32, lr=0.05, seed=2, plots=False, local_epochs=1,
                partition="shards", partition_options={"classes_per_client": 2})
    base.update(kw)
    return apply(RunConfig(), base)


def test_the_personalisation_layers_are_the_last_ones():
    one = experiment(_cfg()).client.own_keys()
    two = experiment(_cfg(algorithm_options={"personal_layers": 2})).client.own_keys()
    assert one == {"fc.weight", "fc.bias"}
    assert two == {"fc.weight", "fc.bias", "hidden.1.weight", "hidden.1.bias"}
    with pytest.raises(ConfigError, match="leaves no base layer"):
        experiment(_cfg(algorithm_options={"personal_layers": 3}))


def test_the_base_is_fedavgs_and_the_heads_are_each_clients_own():
    """From the same start, one round of FedPer with every client taking part gives FedAvg's base (the base is
    trained with the whole model, as FedAvg trains it) and each client keeps exactly the head its training left."""
    per = experiment(_cfg(rounds=1))
    per.run()
    avg = experiment(_cfg(rounds=1, algorithm="fedavg"), fed=per.fed)
    avg.run()
    for k in ("hidden.0.weight", "hidden.0.bias", "hidden.1.weight", "hidden.1.bias"):
        assert torch.equal(per.state["global"][k], avg.state["global"][k]), k
    heads = [per.client_states[c][OWN]["fc.weight"] for c in range(4)]
    assert all(not torch.equal(heads[0], h) for h in heads[1:])
    # FedAvg averaged these heads (by samples); FedPer's server never saw them
    sizes = torch.tensor([len(per.fed.clients[c].train) for c in range(4)], dtype=torch.float64)
    mean = sum(h.double() * n for h, n in zip(heads, sizes, strict=True)) / sizes.sum()
    torch.testing.assert_close(avg.state["global"]["fc.weight"].double(), mean, rtol=0, atol=1e-6)
    assert torch.equal(per.state["global"]["fc.weight"], per.algo.init_state()["global"]["fc.weight"])


def test_personal_heads_beat_the_shared_base_on_label_skew():
    """Two classes per client: after a few rounds the clients' own heads score well above chance on their own test
    splits."""
    exp = experiment(_cfg(rounds=4))
    exp.run()
    assert exp.history[-1]["personal_accuracy"] > 0.5


def test_same_seed_same_run():
    check_same_seed_same_run(_cfg(), metric="personal_accuracy")
