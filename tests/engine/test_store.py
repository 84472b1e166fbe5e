"""The run store: every file the round loop writes goes through it, a run without a directory writes nothing,
and a run's directory holds only the files :data:`fedfuse.runfiles.FILES` lists."""

import json

import pytest
import torch

from fedfuse.config import RunConfig, load_yaml
from fedfuse.engine.checkpoint import load_checkpoint
from fedfuse.engine.store import MODELS, RunStore
from fedfuse.runfiles import CHECKPOINT, CONFIG, FILES, METRICS, MODEL_BEST_VAL_LOSS, MODEL_FINAL, SUMMARY
from fedfuse.runner import experiment
from support import small_cfg


def test_start_writes_the_config_and_an_empty_metrics_file(tmp_path):
    store = RunStore(tmp_path / "a" / "b")
    cfg = RunConfig(dataset="digits", clients=3, rounds=2, lr=0.25)
    store.start(cfg)
    assert load_yaml(tmp_path / "a" / "b" / CONFIG) == cfg.to_dict()
    assert (tmp_path / "a" / "b" / METRICS).read_text() == ""


def test_metrics_append_and_rewrite(tmp_path):
    store = RunStore(tmp_path)
    store.rewrite_metrics([])
    store.append_metrics({"round": 1, "x": 0.5})
    store.append_metrics({"round": 2, "x": None})
    assert (tmp_path / METRICS).read_text() == '{"round": 1, "x": 0.5}\n{"round": 2, "x": null}\n'
    assert store.read_metrics() == [{"round": 1, "x": 0.5}, {"round": 2, "x": None}]
    store.rewrite_metrics([{"round": 1, "x": 0.5}])  # a resume drops what came after its checkpoint
    assert store.read_metrics() == [{"round": 1, "x": 0.5}]


def test_checkpoint_round_trip_and_its_round(tmp_path):
    store = RunStore(tmp_path)
    assert store.checkpoint_round() is None
    ck = {"round": 3, "state": {"w": torch.arange(4.0)}, "client_states": {}, "totals": {}, "best": None,
          "history": []}
    store.save_checkpoint(ck)
    assert store.checkpoint_round() == 3
    back = store.load_checkpoint()
    assert back["round"] == 3 and torch.equal(back["state"]["w"], torch.arange(4.0))
    assert load_checkpoint(tmp_path / CHECKPOINT)["round"] == 3
    assert not (tmp_path / (CHECKPOINT + ".tmp")).exists()


@pytest.mark.parametrize("which", sorted(MODELS))
def test_models_and_summary(tmp_path, which):
    store = RunStore(tmp_path)
    store.save_model(which, {"w": torch.ones(2)}, {"k": 1}, 7)
    saved = torch.load(tmp_path / MODELS[which], weights_only=True)
    assert saved["round"] == 7 and saved["meta"] == {"k": 1} and torch.equal(saved["state"]["w"], torch.ones(2))
    store.write_summary({"final": {"acc": 0.5}})
    assert json.loads((tmp_path / SUMMARY).read_text()) == {"final": {"acc": 0.5}}


def test_a_store_without_a_directory_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = RunStore(None)
    assert not store.enabled and store.dir is None
    store.start(RunConfig())
    store.append_metrics({"round": 1})
    store.rewrite_metrics([{"round": 1}])
    store.save_checkpoint({"round": 1})
    store.save_model("final", {}, {}, 1)
    store.write_summary({})
    store.write_json("x.json", {})
    assert store.read_metrics() == [] and store.checkpoint_round() is None
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="no output directory"):
        store.path(METRICS)


def test_every_file_a_run_writes_is_listed(tmp_path):
    """A run (with plots and a best-val-loss model) writes exactly files the table names, and the engine's own
    files among them."""
    exp = experiment(small_cfg(tmp_path, plots=True))
    exp.run()
    names = {p.name for p in exp.out.iterdir()}
    assert names <= set(FILES), names - set(FILES)
    assert {CONFIG, METRICS, SUMMARY, CHECKPOINT, MODEL_FINAL, MODEL_BEST_VAL_LOSS} <= names
    assert exp.out == exp.store.dir == tmp_path / "run"


def test_a_run_without_out_writes_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exp = experiment(small_cfg(tmp_path, out=None, plots=True))
    exp.run()
    assert exp.out is None and list(tmp_path.iterdir()) == []


def test_the_round_loop_writes_no_file_itself():
    """Every file the loop writes goes through the store: engine/loop.py calls no writer directly."""
    import ast
    from pathlib import Path

    import fedfuse.engine.loop as loop

    writers = {"write_text", "write_bytes", "save", "dump", "dump_yaml", "save_checkpoint", "mkdir", "open"}
    calls = []
    for node in ast.walk(ast.parse(Path(loop.__file__).read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = getattr(f.value, "attr", getattr(f.value, "id", "")) if isinstance(f, ast.Attribute) else ""
            if name in writers and owner != "store":
                calls.append(f"line {node.lineno}: {owner + '.' if owner else ''}{name}")
    assert not calls, calls
