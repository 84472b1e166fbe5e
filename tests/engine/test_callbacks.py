"""Metrics callbacks (engine/callbacks.py): every round reaches a callback; the CSV, TensorBoard and MLflow loggers."""

import pytest

import fedfuse
from fedfuse.engine.callbacks import Callback, CSVLogger, make_loggers, scalars

SMALL = dict(dataset="digits", rounds=2, clients=4, clients_per_round=2, model="mlp",
             model_options={"widths": [8]}, threads=1)


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_run_start(self, config):
        self.events.append(("start", config.algorithm))

    def on_round(self, record):
        self.events.append(("round", record["round"], record.get("global_accuracy")))

    def on_run_end(self, summary):
        self.events.append(("end", summary["rounds_completed"]))


def test_callbacks_see_every_round_and_csv_logger_writes(tmp_path):
    rec = Recorder()
    res = fedfuse.run(algorithm="fedavg", out=str(tmp_path / "r"), callbacks=[rec], log=["csv"], **SMALL)
    assert rec.events[0] == ("start", "fedavg") and rec.events[-1] == ("end", 2)
    rounds = [e for e in rec.events if e[0] == "round"]
    assert [(r, a) for _, r, a in rounds] == [(h["round"], h["global_accuracy"]) for h in res.history]
    import pandas as pd

    csv = pd.read_csv(tmp_path / "r" / "metrics.csv")
    assert list(csv["round"]) == [1, 2]
    assert csv["global_accuracy"].tolist() == pytest.approx(res.metrics["global_accuracy"].tolist())
    assert scalars({"a": 1, "b": None, "c": float("nan"), "d": [1], "e": True, "f": 2.5}) == {"a": 1.0, "f": 2.5}
    with pytest.raises(fedfuse.ConfigError, match="unknown logger 'nope'"):
        make_loggers("csv,nope")
    assert isinstance(make_loggers("csv")[0], CSVLogger)


def test_tensorboard_logger_writes_events(tmp_path):
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install -e '.[tensorboard]'")
    fedfuse.run(algorithm="fedavg", out=str(tmp_path / "r"), log=["tensorboard"], **SMALL)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    ev.Reload()
    acc = ev.Scalars("global_accuracy")
    assert [e.step for e in acc] == [1, 2] and all(0 <= e.value <= 1 for e in acc)


def test_mlflow_logger_calls(monkeypatch, tmp_path):
    """MLflow's API as the logger uses it (a recording stand-in when mlflow is not installed)."""
    import sys
    import types

    calls = []
    fake = types.SimpleNamespace(
        set_experiment=lambda name: calls.append(("experiment", name)),
        start_run=lambda run_name: calls.append(("start", run_name)),
        log_params=lambda p: calls.append(("params", p)),
        log_metrics=lambda m, step=None: calls.append(("metrics", step, m)),
        end_run=lambda: calls.append(("end",)),
    )
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    from fedfuse.engine.callbacks import MLflowLogger

    res = fedfuse.run(algorithm="fedprox", callbacks=[MLflowLogger("exp")], mu=0.1, **SMALL)
    assert calls[0] == ("experiment", "exp") and calls[1] == ("start", "fedprox-digits-seed0")
    params = calls[2][1]
    assert params["algorithm"] == "fedprox" and params["algorithm_options.mu"] == "0.1"
    steps = [c for c in calls if c[0] == "metrics" and c[1] is not None]
    assert [c[1] for c in steps] == [1, 2]
    assert steps[-1][2]["global_accuracy"] == pytest.approx(res.history[-1]["global_accuracy"])
    assert calls[-1] == ("end",) and calls[-2][0] == "metrics" and "final_global_accuracy" in calls[-2][2]
