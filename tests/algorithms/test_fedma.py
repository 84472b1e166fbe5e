"""FedMA through the round loop (bundled digits, tiny models): one client, layer growth, Hungarian matching,
frozen lower layers, the retraining schedule."""

import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.engine.client import TrainConfig
from fedfuse.engine.loop import strip_timing
from fedfuse.runner import experiment
from support import matching_cfg as cfg
from support import run_experiment as run


def test_fedma_on_one_client_returns_that_clients_model():
    opts = {"estimator": "mean", "retrain_epochs": 0}
    fedma = run(cfg("fedma", clients=1, algorithm_options=opts))
    local = run(cfg("oneshot-avg", clients=1))  # the same locally trained model (same seeds), unfused
    g_fedma, meta = fedma.algo.global_model(fedma.state)
    g_local, _ = local.algo.global_model(local.state)
    assert meta["model_options"]["widths"] == [16, 12]
    for k in g_local:
        torch.testing.assert_close(g_fedma[k], g_local[k], rtol=0, atol=1e-6)
    assert fedma.history[-1]["global_accuracy"] == pytest.approx(local.history[-1]["global_accuracy"])


def test_fedma_rounds_grow_layers_and_are_deterministic(tmp_path):
    c = cfg("fedma", clients=3, rounds=2, out=str(tmp_path / "a"))
    a = run(c)
    b = run(cfg("fedma", clients=3, rounds=2, out=str(tmp_path / "b")))
    assert [strip_timing(r) for r in a.history] == [strip_timing(r) for r in b.history]
    widths = a.history[-1]["global_widths"]
    assert len(widths) == 2 and all(w >= base for w, base in zip(widths, [16, 12]))
    g, meta = a.algo.global_model(a.state)
    model = a.ctx.load(g, meta)  # the wider global model is buildable from its meta
    assert model.fc.weight.shape[1] == widths[-1]
    rec0, rec1 = a.history
    assert rec0["bytes_down"] < rec1["bytes_down"]  # round 0 starts from local initialisations (nothing sent)
    assert rec1["global_accuracy"] > 0.3
    # the clients rebuilt original-size models: their stored assignments index the global layers
    for cs in a.client_states.values():
        assert [len(x) for x in cs["assign"]] == [16, 12]
        assert all(max(x) < w for x, w in zip(cs["assign"], widths))


def test_fedma_hungarian_and_cnn_with_conv_to_linear_growth():
    h = run(cfg("fedma", clients=2, algorithm_options={"matching": "hungarian"}))
    assert h.history[-1]["global_widths"] == [16, 12]  # permutations only: no growth
    c = run(cfg("fedma", clients=2, model="cnn", model_options={"channels": [4, 6], "hidden": 16}))
    widths = c.history[-1]["global_widths"]
    g, meta = c.algo.global_model(c.state)
    model = c.ctx.load(g, meta)
    assert model.conv2.weight.shape[:2] == (widths[1], widths[0])
    assert model.fc1.weight.shape == (widths[2], widths[1] * 4)  # 8x8 digits -> 2x2 per channel


def test_fedma_freezes_lower_layers_during_retraining():
    exp = experiment(cfg("fedma", clients=2))
    exp.state = exp.algo.init_state()
    exp.client_states = {c: None for c in range(2)}
    info0 = RoundInfo(0, 1, 0)
    res = {}
    for c in range(2):
        res[c], exp.client_states[c] = exp.algo.fit(exp.algo.configure_fit(exp.state, info0, [0, 1])[c], None,
                                                    exp.fed.clients[c], torch.Generator().manual_seed(c))
    exp.state = exp.algo.aggregate_fit(exp.state, info0, res)
    info1 = RoundInfo(0, 1, 1)
    payload = exp.algo.configure_fit(exp.state, info1, [0, 1])[0]
    out, cs = exp.algo.fit(payload, exp.client_states[0], exp.fed.clients[0], torch.Generator().manual_seed(9))
    for k in ("hidden.0.weight", "hidden.0.bias"):  # layer 1 is the global one, unchanged by retraining
        assert torch.equal(cs["model"][k], exp.state["partial"][k])
    assert set(out.tensors) == {"hidden.1.weight", "hidden.1.bias"}
    assert out.tensors["hidden.1.weight"].shape[1] == exp.state["partial_sizes"][0]
    assert out.stats.trained_params < sum(v.numel() for v in cs["model"].values())


def test_retrain_config_follows_the_code_schedule():
    from fedfuse.algorithms.fedma import retrain_config

    base = TrainConfig(local_epochs=10, lr=0.02, optimizer="adam", momentum=0.0)
    cfg, ep = retrain_config(base, "code", 7)
    assert (cfg.optimizer, cfg.momentum, cfg.lr, cfg.weight_decay, ep) == ("sgd", 0.9, 0.02, 0.0, 7)
    cfg, ep = retrain_config(base, "code", 7, lr=0.05, last=True)
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay, ep) == ("sgd", pytest.approx(0.005), 1e-4, 21)
    cfg, ep = retrain_config(base, "run", 7, last=True, last_layer_schedule=False)
    assert cfg == base and ep == 7
    cfg, ep = retrain_config(base, "run", 2, last=True)
    assert (cfg.optimizer, cfg.lr, ep) == ("adam", pytest.approx(0.002), 6)
    with pytest.raises(ValueError):
        retrain_config(base, "nope", 1)


def test_fedma_later_rounds_use_the_retraining_schedule():
    """Round >= 1 stage 0 retrains the rebuilt model for retrain_epochs ('code') or local_epochs ('run')."""
    flops = {}
    for sched in ("code", "run"):
        e = run(cfg("fedma", clients=2, rounds=2, local_epochs=3, optimizer="adam", momentum=0.0,
                    algorithm_options={"retrain_schedule": sched, "retrain_epochs": 1}))
        flops[sched] = [r["client_flops"] for r in e.history]
        assert e.history[-1]["global_accuracy"] > 0.3
    # round 0 is identical; round 1's full retraining is 1 epoch ('code') instead of local_epochs=3 ('run')
    assert flops["code"][0] == pytest.approx(flops["run"][0])
    assert flops["code"][1] < flops["run"][1]
