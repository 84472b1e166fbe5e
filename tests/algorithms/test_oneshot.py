"""One-shot baselines of FedMA (ensemble, oneshot-avg, oneshot-match) and the FedAvg continuation from the
one-shot average."""

import pytest

from support import matching_cfg as cfg
from support import run_experiment as run


def test_baselines_share_the_local_models_and_ensemble_is_reported():
    ens = run(cfg("ensemble", clients=3))
    rec = ens.history[-1]
    assert rec["global_accuracy"] is None and 0.0 <= rec["ensemble_accuracy"] <= 1.0
    one = run(cfg("ensemble", clients=1))
    avg = run(cfg("oneshot-avg", clients=1))
    assert one.history[-1]["ensemble_accuracy"] == pytest.approx(avg.history[-1]["global_accuracy"])
    match = run(cfg("oneshot-match", clients=3))
    assert match.history[-1]["global_widths"][0] >= 16
    assert match.history[-1]["global_accuracy"] is not None


def test_oneshot_avg_fedavg_continuation_starts_from_the_one_shot_average():
    one = run(cfg("oneshot-avg", clients=3, rounds=1))
    cont = run(cfg("oneshot-avg", clients=3, rounds=3, algorithm_options={"continuation": "fedavg",
                                                                         "retrain_epochs": 1}))
    loc = run(cfg("oneshot-avg", clients=3, rounds=3))
    # round 0 is the same one-shot average of the same local models
    assert cont.history[0]["global_accuracy"] == pytest.approx(one.history[0]["global_accuracy"])
    assert loc.history[0]["global_accuracy"] == pytest.approx(one.history[0]["global_accuracy"])
    # later rounds train from the average: clients hold (nearly) the same model, unlike 'local'
    g, _ = cont.algo.global_model(cont.state)
    for cs in cont.client_states.values():
        diff = max(float((cs["model"][k] - g[k]).abs().max()) for k in g if g[k].is_floating_point())
        assert diff < 5.0
    assert cont.history[-1]["global_accuracy"] > cont.history[0]["global_accuracy"]
