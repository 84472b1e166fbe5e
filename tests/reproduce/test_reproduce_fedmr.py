"""`fedfuse reproduce fedmr`: presets in one place, the authors' training recipe, configs that validate, the
authors' FEMNIST CNN, and a tiny end-to-end grid (tables, reuse of finished runs, config.yaml contents, --jobs)."""

import argparse
import json

import pytest
import torch
import yaml

from fedfuse.algorithms.fedmr import model_units
from fedfuse.config import RunConfig, apply, validate
from fedfuse.engine.loop import strip_timing
from fedfuse.models import build_model
from fedfuse.reproduce import fedmr as R


def ns(**kw) -> argparse.Namespace:
    base = dict(quick=False, scale="cpu", settings="", methods="", rounds=0, warmup=-1, momentum=None,
                local_epochs=0, seeds="", threads=1, data_dir=None, out=None, no_progress=True, jobs=1)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("name", list(R.PRESETS))
def test_every_preset_uses_the_authors_training_recipe(name):
    tr = R.PRESETS[name]["training"]
    recipe = (tr["optimizer"], tr["lr"], tr["momentum"], tr["batch_size"], tr["local_epochs"])
    assert recipe == ("sgd", 0.01, 0.5, 50, 5)
    assert tr["val_fraction"] == 0.0 and tr["weight_decay"] == 0.0
    assert 0 < R.PRESETS[name]["warmup"] < R.PRESETS[name]["rounds"]  # a fixed switch round inside the run


def test_paper_scale_is_the_papers_federation():
    s = R.PRESETS["paper"]["settings"]
    assert set(s) == {"cifar10-dir0.1", "cifar10-dir0.5", "cifar10-iid", "femnist"}
    for name in ("cifar10-dir0.1", "cifar10-dir0.5", "cifar10-iid"):
        assert s[name]["clients"] == 100 and s[name]["clients_per_round"] == 10 and not s[name]["dataset_options"]
        assert s[name]["model"] == "cnn-cifar"
    assert s["femnist"]["model"] == "cnn-femnist" and s["femnist"]["dataset_options"]["normalize"] == "authors"
    assert R.PRESETS["paper"]["rounds"] >= 500 and R.PRESETS["paper"]["warmup"] == 100
    # the CPU scale only shrinks data/rounds: same datasets, models and participation (plus the MNIST check)
    cpu = R.PRESETS["cpu"]["settings"]
    assert set(cpu) == set(s) | {"mnist-dir0.1", "mnist-dir0.5"} and all(cpu[k]["model"] == s[k]["model"] for k in s)


def test_full_scale_has_the_papers_data_per_client_and_defaults_to_the_headline_pair():
    full = R.PRESETS["full"]
    s = full["settings"]["cifar10-dir0.1"]
    assert s["dataset_options"]["train_limit"] / s["clients"] == 500  # the paper's 50,000 / 100
    assert s["clients_per_round"] == 10 and "test_limit" not in s["dataset_options"]
    assert full["rounds"] >= 300 and full["training"] == R.AUTHORS_TRAINING
    p = R.resolve_preset(ns(scale="full"))
    assert list(p["settings"]) == ["cifar10-dir0.1"] and p["methods"] == ["FedAvg", "FedMR"]
    assert R.resolve_preset(ns(scale="full", methods="FedMR two-stage"))["methods"] == ["FedMR two-stage"]
    assert set(R.resolve_preset(ns(scale="full", settings="mnist-dir0.1"))["settings"]) == {"mnist-dir0.1"}


def test_mnist_settings_are_the_cifar_settings_with_another_dataset():
    """``--settings mnist-dir0.1`` = the cpu CIFAR-10 Dir(0.1) run with only dataset and model changed."""
    assert list(R.resolve_preset(ns())["settings"]) == ["cifar10-dir0.1", "cifar10-dir0.5", "cifar10-iid", "femnist"]
    p = R.resolve_preset(ns(settings="mnist-dir0.1,mnist-dir0.5"))
    assert p["rounds"] == 120 and p["warmup"] == 24 and p["training"] == R.AUTHORS_TRAINING
    for alpha in ("0.1", "0.5"):
        mnist = R.run_config("FedMR two-stage", f"mnist-dir{alpha}", 1, p, "data")
        cifar = R.run_config("FedMR two-stage", f"cifar10-dir{alpha}", 1, R.resolve_preset(ns()), "data")
        assert (mnist["dataset"], mnist["model"]) == ("mnist", "mlp")
        assert {k: v for k, v in mnist.items() if k not in ("dataset", "model")} == \
            {k: v for k, v in cifar.items() if k not in ("dataset", "model")}
        assert mnist["partition_options"] == {"alpha": float(alpha)} and mnist["clients"] == 50
        assert mnist["dataset_options"] == {"train_limit": 10000, "test_limit": 2000}
        cfg = validate(apply(RunConfig(), mnist))
        assert cfg.momentum == 0.5 and cfg.local_epochs == 5 and cfg.algorithm_options["warmup_rounds"] == 24
    assert R.method_options("FedProx", p, "mnist") == ("fedprox", {"mu": 0.01})


@pytest.mark.parametrize("name", list(R.PRESETS))
def test_every_run_config_of_every_preset_validates(name):
    preset = R.resolve_preset(ns(quick=name == "quick", scale=name if name != "quick" else "cpu"))
    assert preset["name"] == name
    for setting in preset["settings"]:
        for label in R.METHODS:
            cfg = validate(apply(RunConfig(), R.run_config(label, setting, 0, preset, "data")))
            assert cfg.momentum == 0.5 and cfg.val_fraction == 0.0 and cfg.rounds == preset["rounds"]
            if label == "FedProx":
                assert cfg.algorithm_options["mu"] == (0.1 if setting == "femnist" else 0.01)
            if label == "FedMR two-stage":
                assert cfg.algorithm_options["warmup_rounds"] == preset["warmup"]


def test_overrides_and_seeds():
    p = R.resolve_preset(ns(momentum=0.9, rounds=7, warmup=3, settings="femnist", methods="FedMR,FedAvg", seeds="2"))
    assert p["training"]["momentum"] == 0.9 and R.PRESETS["cpu"]["training"]["momentum"] == 0.5  # no aliasing
    assert p["rounds"] == 7 and p["warmup"] == 3 and list(p["settings"]) == ["femnist"]
    assert p["methods"] == ["FedMR", "FedAvg"]
    assert [t.id for t in R.tables(ns(settings="femnist", methods="FedMR,FedAvg"))] == ["femnist"]
    (t,) = R.tables(ns(settings="femnist", methods="FedMR,FedAvg"))
    assert list(t.rows) == ["FedAvg", "FedMR"] and t.last == 5  # FedAvg first: the paired tests' baseline
    with pytest.raises(ValueError, match="setting"):
        R.resolve_preset(ns(settings="mnist"))
    with pytest.raises(ValueError, match="method"):
        R.resolve_preset(ns(methods="FedFoo"))


def test_femnist_cnn_is_the_authors_architecture():
    m = build_model("cnn-femnist", (1, 28, 28), 62)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes == {"conv1.weight": (16, 1, 5, 5), "conv1.bias": (16,), "conv2.weight": (32, 16, 5, 5),
                      "conv2.bias": (32,), "fc1.weight": (256, 512), "fc1.bias": (256,),
                      "fc.weight": (62, 256), "fc.bias": (62,)}
    assert sum(p.numel() for p in m.parameters()) == 160510
    assert m(torch.zeros(3, 1, 28, 28)).shape == (3, 62)
    assert model_units(m) == [("conv1.weight", "conv1.bias"), ("conv2.weight", "conv2.bias"),
                              ("fc1.weight", "fc1.bias"), ("fc.weight", "fc.bias")]
    assert build_model("cnn-femnist", (1, 8, 8), 10).conv1.padding == (2, 2)  # small inputs: 'same' padding
    with pytest.raises(ValueError, match="too small"):
        build_model("cnn-femnist", (1, 8, 8), 10, padding=0)


def test_tiny_grid_end_to_end(tmp_path, monkeypatch):
    """A 2-method, 2-seed grid on digits: tables, config.yaml with the preset's recipe, --reuse keeps finished
    runs, without it every run is run again; --jobs 2 gives the serial run's metrics."""
    from fedfuse.reproduce import preset
    from fedfuse.result import load

    tiny = {
        "training": {**R.AUTHORS_TRAINING, "local_epochs": 1, "eval_every": 1, "lr": 0.05}, "rounds": 3,
        "warmup": 1, "seeds": 2,
        "settings": {"digits-dir0.5": {"dataset": "digits", "model": "mlp", "clients": 6, "clients_per_round": 3,
                                       "partition": "dirichlet", "partition_options": {"alpha": 0.5},
                                       "dataset_options": {}}},
    }
    monkeypatch.setitem(R.PRESETS, "quick", tiny)
    out = tmp_path / "grid"
    args = ns(quick=True, methods="FedMR two-stage,FedAvg", out=str(out), seeds="2", plots=False)
    assert preset.run(R.FAMILY, args, reuse=False, default_out="") == 0
    table = (out / "tables.md").read_text()
    assert "digits-dir0.5" in table and "±" in table and "momentum 0.5" in table and "vs FedAvg" in table
    runs = sorted((out / "runs").iterdir())
    assert len(runs) == 4
    two = [load(d) for d in runs if d.name.startswith("fedmr")]
    cfg = next(r.config for r in two if r.seed == 1)
    assert cfg.momentum == 0.5 and cfg.val_fraction == 0.0 and cfg.seed == 1
    assert cfg.algorithm_options["warmup_rounds"] == 1 and cfg.algorithm_options["warmup_weighting"] == "uniform"
    p = yaml.safe_load((out / "preset.yaml").read_text())
    assert p["seeds"] == [0, 1] and p["training"]["batch_size"] == 50
    res = json.loads((out / "results.json").read_text())["digits-dir0.5"]
    assert res["last"] == 5 and {k: len(v) for k, v in res["runs"].items()} == {"FedAvg": 2, "FedMR two-stage": 2}
    mtimes = {d.name: (d / "summary.json").stat().st_mtime_ns for d in runs}
    assert preset.run(R.FAMILY, args, reuse=True, default_out="") == 0
    assert {d.name: (d / "summary.json").stat().st_mtime_ns for d in runs} == mtimes  # kept
    par = tmp_path / "par"
    args.out = str(par)
    args.jobs = 2
    assert preset.run(R.FAMILY, args, reuse=False, default_out="") == 0
    for d in runs:  # the same run directory names (config hashes) and metrics
        a = [strip_timing(h) for h in load(d).history]
        assert a == [strip_timing(h) for h in load(par / "runs" / d.name).history], d.name
    args.out, args.jobs = str(out), 1
    assert preset.run(R.FAMILY, args, reuse=False, default_out="") == 0
    assert all((d / "summary.json").stat().st_mtime_ns != mtimes[d.name] for d in runs)  # run again
