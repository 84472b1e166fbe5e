"""Config files: a run's ``config.yaml`` re-runs the same way wherever the file lives (its own directory or a copy
anywhere): a new run in a new directory, never "already holds a run"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from fedfuse.cli import main
from fedfuse.configfile import config_file, holds_run, stale_out

FAST = ["--rounds", "2", "--clients", "4", "--clients-per-round", "2", "--set", "model_options.widths=[16]",
        "--model", "mlp", "--no-progress", "--set", "plots=false"]


def _write(path: Path, **keys) -> Path:
    path.write_text(yaml.safe_dump(keys))
    return path


def test_out_naming_an_earlier_run_is_dropped_wherever_the_file_lives(tmp_path):
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    _write(run / "config.yaml", out=str(run), rounds=3)
    (run / "metrics.jsonl").write_text("")
    assert holds_run(run) and not holds_run(tmp_path)
    assert config_file(run / "config.yaml") == {"rounds": 3}  # the run's own file
    copy = shutil.copy(run / "config.yaml", tmp_path / "my.yaml")
    assert config_file(copy) == {"rounds": 3}  # a copy elsewhere: the same
    assert stale_out(yaml.safe_load(Path(copy).read_text()), copy) == str(run)


def test_out_naming_a_fresh_directory_is_kept(tmp_path):
    fresh = tmp_path / "fresh"
    assert config_file(_write(tmp_path / "a.yaml", out=str(fresh), rounds=3)) == {"out": str(fresh), "rounds": 3}
    fresh.mkdir()  # exists, but holds no run
    assert config_file(tmp_path / "a.yaml")["out"] == str(fresh)
    assert stale_out({"rounds": 3}, tmp_path / "a.yaml") is None


def test_rerunning_a_copy_of_a_runs_config_writes_a_new_run(tmp_path, capsys, monkeypatch):
    """The README's `fedfuse run --config my.yaml` with my.yaml copied from runs/X/config.yaml (issue #43)."""
    monkeypatch.chdir(tmp_path)
    first = Path("runs") / "first"
    assert main(["run", *FAST, "--out", str(first)]) == 0
    shutil.copy(first / "config.yaml", "my.yaml")
    capsys.readouterr()
    assert main(["run", "--config", "my.yaml", "--no-progress"]) == 0
    captured = capsys.readouterr()
    again = Path(captured.out.strip().splitlines()[-1].removeprefix("outputs in "))
    assert again.resolve() != first.resolve() and (again / "summary.json").is_file()
    assert f"my.yaml names out {first}, an earlier run's directory; this run writes to {again}" in captured.err
    a, b = (json.loads((d / "summary.json").read_text()) for d in (first, again))
    assert a["final"]["global_accuracy"] == b["final"]["global_accuracy"]  # the same run again
    # naming the earlier run's directory on the command line is explicit: refused without --overwrite
    assert main(["run", "--config", "my.yaml", "--out", str(first), "--no-progress"]) == 2
    assert "already holds a run" in capsys.readouterr().err
