"""Fed-ET: weighted consensus and diversity targets by hand, the public hold-out, the shared representation
layer, heterogeneous small models and the server FLOP accounting."""

import math

import pytest
import torch

from fedfuse.algorithms.fedet import consensus_targets
from fedfuse.config import RunConfig, apply
from fedfuse.runner import experiment


def _cfg(**kw) -> RunConfig:
    base = dict(
        dataset="digits", partition="iid", model="mlp", clients=4, clients_per_round=4, rounds=2,
        batch_size=32, lr=0.05, seed=3, plots=False, local_epochs=1, model_options={"widths": [32, 16]},
        algorithm="fedet",
        algorithm_options={"small_models": [{"model": "mlp", "widths": [8, 16]}, {"model": "mlp", "widths": [12, 16]}],
                           "server_iters": 4, "public_fraction": 0.2},
    )
    base.update(kw)
    return apply(RunConfig(), base)


def test_consensus_weights_confident_models_and_collects_dissent():
    # model 0 is confident in class 0, models 1 and 2 are unsure and lean to class 1
    p = torch.tensor([
        [[0.97, 0.02, 0.01]],
        [[0.30, 0.40, 0.30]],
        [[0.30, 0.40, 0.30]],
    ])
    labels, div, has = consensus_targets(p.log())
    assert labels.tolist() == [0]  # majority says 1, the variance-weighted consensus says 0
    assert has.tolist() == [True]
    torch.testing.assert_close(div, p[1].log())  # the dissenting models' (equal) prediction
    # unanimous models: no diversity term
    q = torch.tensor([[[0.8, 0.2]], [[0.6, 0.4]]]).log()
    labels, _, has = consensus_targets(q)
    assert labels.tolist() == [0] and has.tolist() == [False]
    # the weights are variances: a hand check of the weighted log-probability
    v = q.var(dim=2)
    w = v / v.sum(0)
    assert math.isclose(float((w[:, 0] * q[:, 0, 0]).sum()), float((w.unsqueeze(2) * q).sum(0)[0, 0]))


def test_public_set_is_held_out_of_client_training():
    exp = experiment(_cfg())
    full = experiment(_cfg(algorithm="fedavg", algorithm_options={}))
    for a, b in zip(exp.fed.clients, full.fed.clients):
        assert len(a.train) == len(b.train) - round(0.2 * len(b.train))
    assert exp.fed.info["public_size"] == len(exp.algo.public)
    # the held-out images and the remaining training images together are exactly the original training pool
    def rows(t):
        return sorted(tuple(x.flatten().tolist()) for x in t)

    kept = torch.cat([c.train.x for c in exp.fed.clients])
    orig = torch.cat([c.train.x for c in full.fed.clients])
    assert rows(torch.cat([kept, exp.algo.public.to(kept.device)])) == rows(orig)
    assert sum(exp.ctx.client_sizes) == sum(len(c.train) for c in exp.fed.clients)


def test_a_new_run_handed_a_prepared_federation_starts_from_its_source():
    """``exp.fed`` is the federation after Fed-ET held its public set aside; a run handed it (the Python API's
    reuse of a loaded federation) must not hold a second public set out of the reduced data."""
    a = experiment(_cfg())
    assert a.fed.source is not None and a.fed.source.source is None
    b = experiment(_cfg(), fed=a.fed)
    assert [len(c.train) for c in b.fed.clients] == [len(c.train) for c in a.fed.clients]
    assert b.fed.info["public_size"] == a.fed.info["public_size"]
    c = experiment(_cfg(algorithm="fedavg", algorithm_options={}), fed=a.fed)  # another algorithm: all the data
    assert [len(x.train) for x in c.fed.clients] == [len(x.train) for x in a.fed.source.clients]


def test_shared_representation_layer_and_heterogeneous_small_models():
    exp = experiment(_cfg())
    assert exp.algo.mode == "head"
    summary = exp.run()
    st = exp.state
    for e in st["edge"]:
        torch.testing.assert_close(e["fc.weight"], st["global"]["fc.weight"])
        torch.testing.assert_close(e["fc.bias"], st["global"]["fc.bias"])
    assert st["edge"][0]["hidden.0.weight"].shape == (8, 64) and st["edge"][1]["hidden.0.weight"].shape == (12, 64)
    # clients 0 and 2 train group 0, clients 1 and 3 group 1: uploads are the small models only
    small = [sum(v.numel() * v.element_size() for v in e.values()) for e in st["edge"]]
    assert exp.history[0]["bytes_up"] == 2 * small[0] + 2 * small[1]
    d = summary["final"]
    assert d["server_flops"] > 0
    assert d["flops_per_participant"] == pytest.approx(d["client_flops_per_participant"] + d["server_flops"] / 4)
    assert summary["final"]["server_parameters"] > d["small_model_parameters"]


def test_without_server_steps_each_group_is_fedavg_with_an_averaged_head():
    cfg = _cfg(algorithm_options={"small_models": [{"model": "mlp", "widths": [8, 16]}], "server_iters": 0,
                                  "public_fraction": 0.2}, rounds=1)
    exp = experiment(cfg)
    seen = {}
    orig = exp.algo.aggregate_fit

    def spy(state, info, results):
        seen.update(results)
        return orig(state, info, results)

    exp.algo.aggregate_fit = spy
    exp.run()
    n = {c: float(m.stats.num_examples) for c, m in seen.items()}
    tot = sum(n.values())
    body = sum(seen[c].tensors["hidden.0.weight"] * n[c] / tot for c in seen)
    torch.testing.assert_close(exp.state["edge"][0]["hidden.0.weight"], body, rtol=1e-5, atol=1e-6)
    head = sum(seen[c].tensors["fc.weight"] for c in seen) / len(seen)
    torch.testing.assert_close(exp.state["global"]["fc.weight"], head, rtol=1e-5, atol=1e-6)


def test_mismatched_heads_need_distillation_and_run_deterministically():
    opts = {"small_models": [{"model": "mlp", "widths": [8]}], "server_iters": 3, "back_iters": 2,
            "public_fraction": 0.2}
    with pytest.raises(ValueError, match="transfer=distill"):
        experiment(_cfg(algorithm_options={**opts, "transfer": "head"}))
    a = experiment(_cfg(algorithm_options=opts))
    assert a.algo.mode == "distill"
    sa = a.run()
    sb = experiment(_cfg(algorithm_options=opts)).run()
    assert sa["final"]["global_accuracy"] == sb["final"]["global_accuracy"]
