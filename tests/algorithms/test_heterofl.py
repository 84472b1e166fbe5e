"""HeteroFL: index sets per round (static and rolling), holder averaging with label-split rows, masked CE,
Scaler, static-BN statistics recomputation, determinism."""

import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.algorithms.heterofl import bn_statistics
from fedfuse.fusion.slicing import _SKELETONS, slice_state
from fedfuse.models import build_model
from fedfuse.runner import experiment
from fedfuse.types import Message
from support import (
    check_batched_sub_models_equal_sequential,
    check_same_seed_identical_metrics,
    check_scaler_auto_only_with_normalisation_layers,
)
from support import sliced_cfg as cfg


def test_selections_static_and_rolling():
    h = experiment(cfg()).algo
    r = experiment(cfg("fedrolex")).algo
    assert h.selection(0, 0)["hidden.0"].tolist() == [0, 1, 2, 3] == h.selection(2, 7)["hidden.0"].tolist()
    assert r.selection(0, 0)["hidden.0"].tolist() == [0, 1, 2, 3]
    assert r.selection(1, 1)["hidden.0"].tolist() == [7, 0, 1, 2]  # roll(arange(8), 1)[:4]
    assert r.selection(0, 9)["hidden.0"].tolist() == torch.roll(torch.arange(8), 1)[:4].tolist()


def test_aggregation_holders_and_label_split_by_hand():
    exp = experiment(cfg(algorithm_options={"mu_list": [0.5, 0.25, 1.0]}))
    algo = exp.algo
    state = algo.init_state()
    g = state["global"]
    sels = {c: algo.selection(c, 0) for c in range(3)}
    classes = {0: [0, 1], 1: [1, 2], 2: [2, 3, 4, 5, 6, 7, 8, 9]}
    results = {}
    for c in range(3):
        sub = {k: torch.full_like(v, float(c + 1)) for k, v in slice_state(g, algo.spec, sels[c]).items()}
        results[c] = Message(sub, {"sel": {k: v.tolist() for k, v in sels[c].items()}, "classes": classes[c]})
    out = algo.aggregate_fit(state, RoundInfo(0, 2), results)["global"]
    b = out["hidden.0.bias"]
    # unit 0-1: clients 0 (1), 1 (2), 2 (3); unit 2-3: clients 0 and 2; units 4-7: client 2 only
    assert b[:2].tolist() == [2.0, 2.0] and b[2:4].tolist() == [2.0, 2.0] and b[4:].tolist() == [3.0] * 4
    fb = out["fc.bias"]
    assert fb[0].item() == 1.0  # class 0: only client 0
    assert fb[1].item() == 1.5  # class 1: clients 0 and 1
    assert fb[2].item() == 2.5 and fb[9].item() == 3.0
    w = out["fc.weight"]
    assert w[1, 0].item() == 1.5 and w[1, 5].item() == g["fc.weight"][1, 5].item()  # unit 5 of class 1: nobody
    assert w[9, 5].item() == 3.0


def test_masked_ce_and_scaler_hooks_in_training_only():
    exp = experiment(cfg())
    algo = exp.algo
    data = exp.fed.clients[0]
    sel = algo.selection(0, 0)
    payload = Message(slice_state(algo.init_state()["global"], algo.spec, sel),
                      {"round": 0, "total": 2, "sel": {k: v.tolist() for k, v in sel.items()}})
    res, _ = algo.fit(payload, None, data, torch.Generator().manual_seed(0))
    assert sorted(res.meta["classes"]) == sorted(torch.unique(data.train.y).tolist())
    assert len(res.meta["classes"]) == 3
    # hooks are removed after training: the cached sub-module's eval output is the plain forward
    sub = next(m for k, m in _SKELETONS.items() if k.startswith('["heterofl-train"'))
    assert not any(m._forward_hooks for m in sub.modules())
    h = algo.scaler_hooks(sub, 0.5)
    x = data.train.x[:4].reshape(4, -1)
    sub.train()
    y_train = sub.hidden[0](x)
    sub.eval()
    y_eval = sub.hidden[0](x)
    torch.testing.assert_close(y_train, 2 * y_eval)
    for hook in h:
        hook.remove()


def test_bn_statistics_combine_to_the_pooled_cumulative_average():
    torch.manual_seed(0)
    m = build_model("resnet18", (3, 8, 8), 4, width_mult=0.0625, norm="bn")
    x = torch.randn(40, 3, 8, 8)
    pooled, nb = bn_statistics(m, x, 10)
    a, na = bn_statistics(m, x[:20], 10)
    b, nb2 = bn_statistics(m, x[20:], 10)
    assert nb == na + nb2 == 4
    for k, v in pooled.items():
        if v.is_floating_point():
            torch.testing.assert_close((na * a[k] + nb2 * b[k]) / (na + nb2), v, rtol=1e-4, atol=1e-5)


def test_heterofl_sbn_stage_runs_and_fedrolex_has_none():
    kw = dict(dataset="digits", model="resnet18", model_options={"width_mult": 0.0625, "norm": "bn-static"},
              rounds=2, clients=2, clients_per_round=2)
    h = experiment(cfg(**kw, algorithm_options={"stats_every": 2}))
    h.run()
    g, meta = h.algo.global_model(h.state)
    assert meta == {"model_options": {"norm": "bn"}} and "bn1.running_mean" in g
    assert h.algo.num_stages(h.state, RoundInfo(1, 2)) == 2 and h.algo.num_stages(h.state, RoundInfo(0, 2)) == 1
    assert g["bn1.num_batches_tracked"].item() > 0
    r = experiment(cfg("fedrolex", **kw))
    assert r.algo.num_stages(r.algo.init_state(), RoundInfo(1, 2)) == 1


def test_same_seed_identical_metrics():
    check_same_seed_identical_metrics("heterofl")


def test_scaler_auto_only_with_normalisation_layers():
    check_scaler_auto_only_with_normalisation_layers("heterofl")


def test_batched_sub_models_with_scaler_and_masked_logits_equal_sequential():
    check_batched_sub_models_equal_sequential("heterofl")
