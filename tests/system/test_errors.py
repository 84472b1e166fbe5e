"""Errors tell the truth: a user's mistake is one ``fedfuse: error:`` line and exit 2; a bug in fedfuse says so,
exits 1 and keeps its traceback (on screen with ``--debug``, always in the run's ``fedfuse.log``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.cli import main
from fedfuse.config import ConfigError, RunConfig, apply
from fedfuse.errors import BUG, DivergenceError, UnsupportedModel, UserError, run_guarded
from support import ROOT

SMALL = ["--rounds", "1", "--clients", "3", "--clients-per-round", "2", "--local-epochs", "1", "--no-progress",
         "--model", "mlp", "--set", "widths=[8]", "--set", "plots=false", "--set", "dataset_options.train_limit=200"]


def _raise(exc: BaseException):
    def fn() -> int:
        raise exc

    return fn


@pytest.mark.parametrize("exc", [ConfigError("lr must be > 0"), UserError("partition: alpha must be > 0"),
                                 UnsupportedModel("VGG declares no unit groups")])
def test_a_user_error_is_one_line_and_exit_2(exc, capsys):
    assert run_guarded(_raise(exc)) == 2
    err = capsys.readouterr().err
    assert err == f"fedfuse: error: {exc}\n"


def test_a_divergence_is_a_failed_run_not_a_bug(capsys):
    assert run_guarded(_raise(DivergenceError("the run diverged in round 3"))) == 1
    err = capsys.readouterr().err
    assert err == "fedfuse: error: the run diverged in round 3\n" and "bug" not in err


@pytest.mark.parametrize("exc", [ValueError("shapes (3,) and (4,) differ"), KeyError("fc.weight"),
                                 TypeError("unsupported operand"), IndexError("list index out of range"),
                                 AttributeError("'NoneType' object has no attribute 'x'")])
def test_anything_else_is_a_bug_in_fedfuse_exit_1(exc, capsys, monkeypatch):
    monkeypatch.delenv("FEDFUSE_DEBUG", raising=False)
    assert run_guarded(_raise(exc)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"fedfuse: error: {BUG}: {type(exc).__name__}") and len(err.splitlines()) == 1
    assert "--debug" in err and "Traceback" not in err


def test_with_debug_the_traceback_is_on_screen(capsys, monkeypatch):
    monkeypatch.setenv("FEDFUSE_DEBUG", "1")
    assert run_guarded(_raise(KeyError("fc.weight"))) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "KeyError: 'fc.weight'" in err
    assert err.splitlines()[-1].startswith(f"fedfuse: error: {BUG}")


def test_an_unknown_option_value_from_the_command_line_is_a_user_error(tmp_path, capsys):
    code = main(["run", *SMALL, "--partition", "dirichlet", "--set", "min_size=100000", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("fedfuse: error:") and len(err.splitlines()) == 1 and "bug" not in err


def test_a_model_the_algorithm_cannot_slice_is_a_user_error_naming_both(tmp_path, capsys):
    code = main(["run", "--algorithm", "msfusion", "--model", "vgg16", "--rounds", "1", "--no-progress",
                 "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1
    assert "algorithm 'msfusion' (model 'vgg16')" in err and "unit_groups" in err


def _broken(self, state, info, results):  # a bug in an algorithm's server step
    raise KeyError("global")


def test_a_bug_during_a_run_exits_1_and_its_traceback_is_in_the_runs_log(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FEDFUSE_DEBUG", raising=False)
    monkeypatch.setattr(FedAvg, "aggregate_fit", _broken)
    out = tmp_path / "r"
    code = main(["run", *SMALL, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1
    assert BUG in err and "KeyError" in err and f"traceback in {out / 'fedfuse.log'}" in err
    log = (out / "fedfuse.log").read_text()
    assert "Traceback (most recent call last):" in log and "_broken" in log and "KeyError: 'global'" in log


def test_a_bug_while_building_an_algorithm_is_not_blamed_on_the_config(monkeypatch):
    """An AttributeError raised in init_state is a bug: it propagates as it is, not as a ConfigError."""
    from fedfuse.engine.loop import build_algorithm, build_context, build_federation

    def init_state(self):
        raise AttributeError("'NoneType' object has no attribute 'shape'")

    monkeypatch.setattr(FedAvg, "init_state", init_state)
    cfg = apply(RunConfig(), {"clients": 3, "model": "mlp", "model_options": {"widths": [8]}})
    fed = build_federation(cfg)
    with pytest.raises(AttributeError) as info:
        build_algorithm(cfg, build_context(cfg, fed, "cpu"), FedAvg)
    assert not isinstance(info.value, ConfigError)


def test_debug_flag_prints_the_traceback_from_the_command_line(tmp_path):
    """``fedfuse run --debug`` in a subprocess: the traceback on screen, the bug line last, exit 1."""
    script = ("import sys\n"
              "from fedfuse.algorithms.fedavg import FedAvg\n"
              "def broken(self, state, info, results):\n    raise KeyError('global')\n"
              "FedAvg.aggregate_fit = broken\n"
              "from fedfuse.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("FEDFUSE_DEBUG", None)
    for flags in (["--debug"], []):
        argv = ["run", *SMALL, "--out", str(tmp_path / f"r{len(flags)}"), *flags]
        proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert lines[-1].startswith(f"fedfuse: error: {BUG}: KeyError")
        assert ("Traceback (most recent call last):" in proc.stderr) == bool(flags)
