"""The command line: defaults, compare, list, partition and its error messages."""

import json
from pathlib import Path

import pytest
import yaml

from fedfuse.cli import main
from support import ROOT

FAST = ["--rounds", "2", "--clients", "4", "--clients-per-round", "2", "--set", "model_options.widths=[16]",
        "--model", "mlp", "--no-progress"]


def test_run_prints_table_and_writes_outputs(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", *FAST, "--out", str(out), "--set", "plots=false"]) == 0
    text = capsys.readouterr().out
    assert "personalised accuracy" in text and "final" in text
    s = json.loads((out / "summary.json").read_text())
    assert s["rounds_completed"] == 2 and s["algorithm"] == "fedavg" and s["dataset"] == "digits"


def test_resume_cli_continues_a_run(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", *FAST, "--out", str(out), "--set", "plots=false"]) == 0
    # pretend it was killed after round 1: resume recomputes round 2 from the round-2 checkpoint → nothing to do
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "--algorithm", "nope"], "algorithm: unknown algorithm 'nope' (all: fedfuse list algorithms)"),
        (["run", "--algorithm", "fedmergee"], "algorithm: unknown algorithm 'fedmergee'; did you mean fedmerge,"),
        (["run", "--dataset", "imagenet"], "dataset: unknown dataset 'imagenet'"),
        (["run", "--set", "bogus=1"], "unknown key 'bogus' (keys: fedfuse show config"),
        (["run", "--set", "clients_per_rnd=3"], "unknown key 'clients_per_rnd'; did you mean clients_per_round"),
        (["run", "--set", "muu=0.1"], "did you mean mu? It is an option of fedprox"),
        (["run", "--set", "mu=0.1"], "mu is an option of fedprox, fedrolex, heterofl, moon, msfusion, not of fedavg: "
                                     "e.g. --algorithm fedprox --set mu=..."),
        (["run", "--set", "fedprox.mu=0.1"], "fedprox.mu: an option of fedprox, but this run's algorithm is fedavg; "
                                             "run it with --algorithm fedprox --set fedprox.mu=..."),
        (["run", "--set", "fedprx.mu=0.1"], "nor an algorithm; did you mean fedprox"),
        (["run", "--algorithm", "fedprox", "--set", "muu=0.1"], "unknown key 'muu'; did you mean mu?"),
        (["run", "--set", "rounds=abc"], "rounds: expected an integer"),
        (["run", "--set", "algorithm_options.mu=1"], "unknown option 'mu' for algorithm 'fedavg'; choose one of: "
                                                     "clip_norm, fusion"),
        (["run", "--set", "model_options.widthz=[3]", "--model", "mlp"],
         "unknown option 'widthz' for model 'mlp'; did you mean widths?"),
        (["run", "--clients", "3", "--clients-per-round", "5"], "clients_per_round: 5 exceeds clients (3)"),
        (["run", "--rounds", "0"], "rounds: must be >= 1"),
        (["run", "--set", "novalue"], "--set expects KEY=VALUE"),
        (["run", "--partition", "weird"], "partition: unknown partition 'weird'"),
        (["run", "--partition", "dirichlett"], "did you mean dirichlet"),
        (["run", "--model", "alexnet"], "model: unknown model 'alexnet'"),
        (["run", "--dataset", "MNST"], "did you mean mnist"),
        (["run", "--optimizer", "lbfgs"], "optimizer: unknown value 'lbfgs'; choose one of: sgd, adam"),
        (["run", "--resume", "/nonexistent/dir"], "no checkpoint.pt there"),
    ],
)
def test_errors_name_the_key_and_choices(argv, needle, capsys):
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1 and len(err) < 400  # one line, never a dump of every name
    assert not Path("runs").exists()  # nothing written for a run that never started


def test_yaml_key_typo_suggests_the_key(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("clients_per_rnd: 3\n")
    assert main(["run", "--config", str(cfg), "--no-progress"]) == 2
    assert "unknown key 'clients_per_rnd'; did you mean clients_per_round" in capsys.readouterr().err


def test_names_are_case_insensitive(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", "--algorithm", "FedProx", "--set", "FedProx.mu=0.5", *FAST, "--out", str(out),
                 "--set", "plots=false"]) == 0
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["algorithm"] == "fedprox" and cfg["algorithm_options"]["mu"] == 0.5
    assert main(["show", "FEDPROX"]) == 0 and "fedprox (algorithm)" in capsys.readouterr().out
    assert main(["show", "fedmergee"]) == 2
    assert "did you mean fedmerge" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--dataset", "mnist", "--data-dir", "/nonexistent"],
                                  ["--clients", "1000", "--clients-per-round", "5"]])
def test_a_failed_run_leaves_no_folder(tmp_path, argv, capsys):
    out = tmp_path / "never"
    assert main(["run", *argv, "--out", str(out), "--no-progress"]) == 2
    assert not out.exists() and not Path("runs").exists()


def test_a_runs_config_yaml_reruns_into_a_new_directory(tmp_path, capsys):
    first = tmp_path / "first"
    assert main(["run", *FAST, "--out", str(first), "--set", "plots=false"]) == 0
    capsys.readouterr()
    assert main(["run", "--config", str(first / "config.yaml"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    again = Path(out.strip().splitlines()[-1].removeprefix("outputs in "))
    assert again.resolve() != first.resolve() and (again / "summary.json").exists()
    a, b = (json.loads((d / "summary.json").read_text()) for d in (first, again))
    assert a["final"]["global_accuracy"] == b["final"]["global_accuracy"]  # the same run again
    assert a["final"]["loss"] == b["final"]["loss"]


def test_set_means_the_same_in_run_and_compare(tmp_path, capsys):
    """A bare option applies to every algorithm that has it; ALGO.option to that one; typos get suggestions."""
    out = tmp_path / "cmp"
    assert main(["compare", "--algorithms", "fedavg,fedprox,heterofl", *FAST, "--out", str(out),
                 "--set", "mu=0.3", "--set", "heterofl.mu=0.5", "--set", "plots=false"]) == 0
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    opts = {r["label"]: yaml.safe_load((Path(r["dir"]) / "config.yaml").read_text())["algorithm_options"]
            for r in runs}
    assert "mu" not in opts["fedavg"] and opts["fedprox"]["mu"] == 0.3 and opts["heterofl"]["mu"] == 0.5
    assert main(["compare", "--algorithms", "fedavg,fedprox", *FAST, "--set", "muu=0.1"]) == 2
    assert "--set muu: no algorithm among fedavg, fedprox has this option; did you mean mu?" in \
        capsys.readouterr().err
    assert main(["compare", "--algorithms", "fedavg,fedprox", *FAST, "--set", "msfusion.mu=0.1"]) == 2
    assert "msfusion (in msfusion.mu), which is not among the algorithms fedavg, fedprox" in capsys.readouterr().err


def test_missing_data_dir_error_names_files(tmp_path, capsys):
    assert main(["run", "--dataset", "mnist", "--data-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "train-images-idx3-ubyte.gz" in err and str(tmp_path) in err


def test_config_file_and_set_override(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("algorithm: fedprox\nrounds: 5\nalgorithm_options: {mu: 0.5}\nplots: false\n")
    out = tmp_path / "r"
    assert main(["run", "--config", str(cfg), *FAST, "--set", "mu=0.25", "--out", str(out)]) == 0

    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["algorithm"] == "fedprox" and resolved["rounds"] == 2  # flag beats file
    assert resolved["algorithm_options"]["mu"] == 0.25  # --set beats file
    assert resolved["model"] == "mlp" and resolved["model_options"]["widths"] == [16]
    assert "alpha" in resolved["partition_options"]  # fully resolved: defaults written out


def test_compare_writes_table_and_plot(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", "--algorithms", "fedavg,fedprox,local", *FAST, "--out", str(out),
               "--set", "fedprox.mu=0.1", "--set", "plots=false"])
    assert rc == 0
    md = (out / "compare.md").read_text()
    for name in ("fedavg", "fedprox", "local"):
        assert f"| {name} | 1 |" in md
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert [r["label"] for r in runs] == ["fedavg", "fedprox", "local"]
    for r in runs:
        assert (Path(r["dir"]) / "summary.json").exists()
    assert (out / "compare.csv").exists() and (out / "compare.json").exists()
    # same partition for every algorithm
    parts = {(Path(r["dir"]) / "partition.json").read_text() for r in runs}
    assert len(parts) == 1
    cfg = yaml.safe_load((Path(runs[1]["dir"]) / "config.yaml").read_text())
    assert cfg["algorithm_options"]["mu"] == 0.1


def test_compare_seeds_table_and_extension_runs_only_new_seeds(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--algorithms", "fedavg,fedprox", *FAST, "--out", str(out), "--set", "fedprox.mu=0.1"]
    assert main([*argv, "--seeds", "2", "--set", "plots=false"]) == 0
    text = capsys.readouterr()
    assert "2 runs: 0 cached" not in text.err and "4 runs: 0 cached, 4 to run" in text.err
    row = next(line for line in text.out.splitlines() if line.startswith("| fedprox |"))
    assert " ± " in row and "(no test)" in row and "*" not in row  # two seeds: no significance claim
    assert main([*argv, "--seeds", "3"]) == 0  # with plots: the report is written too
    err = capsys.readouterr().err
    assert "6 runs: 4 cached, 2 to run" in err
    assert err.count("done: fedavg seed 2") == 1 and err.count("done: fedprox seed 2") == 1
    assert "| fedavg | 3 |" in (out / "compare.md").read_text()
    report = (out / "report.md").read_text()
    assert "![global_accuracy](report/global_accuracy.png)" in report and (out / "report.html").exists()
    assert (out / "report" / "global_accuracy.png").stat().st_size > 0


def test_run_with_grid_and_seeds_sweeps(tmp_path, capsys):
    out = tmp_path / "sw"
    rc = main(["run", "--algorithm", "fedprox", *FAST, "--grid", "mu=0.0,0.5", "--seeds", "1", "--out", str(out),
               "--set", "plots=false"])
    assert rc == 0
    md = (out / "compare.md").read_text()
    assert "| mu=0.0 | 1 |" in md and "| mu=0.5 | 1 |" in md


def test_every_flag_has_a_help_line():
    import argparse

    from fedfuse.cli import make_parser

    def walk(p):
        yield p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sp in a.choices.values():
                    yield from walk(sp)

    missing = [(p.prog, a.dest) for p in walk(make_parser()) for a in p._actions
               if a.help in (None, "") and not isinstance(a, argparse._SubParsersAction)]
    assert missing == []


def test_show_lists_every_option_config_accepts(capsys):
    from fedfuse.algorithms import get_algorithm

    assert main(["show", "msfusion"]) == 0
    text = capsys.readouterr().out
    for name, default in get_algorithm("msfusion").option_defaults().items():
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(name + " "))
        assert str(default).lower()[:4] in line.lower() or isinstance(default, list)
    assert main(["show", "dirichlet"]) == 0 and "alpha" in capsys.readouterr().out
    assert main(["show", "cnn"]) == 0 and "hidden" in capsys.readouterr().out
    assert main(["show", "config"]) == 0 and "clients_per_round" in capsys.readouterr().out
    assert main(["show", "nope"]) == 2 and "unknown name 'nope'" in capsys.readouterr().err


def test_list_into_a_closed_pipe_exits_quietly():
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = f"{sys.executable} -m fedfuse list | head -1"  # the package's __main__
    p = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and p.stdout == "algorithms:\n" and "Traceback" not in p.stderr
    # a reader that closes before anything is written
    q = subprocess.Popen([sys.executable, "-m", "fedfuse.cli", "list"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    q.stdout.close()
    _, err = q.communicate(timeout=120)
    assert q.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err


def test_list_shows_every_registry(capsys):
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    for word in ("algorithms:", "datasets:", "partitions:", "models:", "fedavg", "fedprox", "local",
                 "fedavg-ft", "digits", "mnist", "dirichlet", "label-cluster", "cnn", "transformer"):
        assert word in text


def test_partition_command_prints_histograms_and_writes_png(tmp_path, capsys):
    png = tmp_path / "p.png"
    assert main(["partition", "--clients", "5", "--png", str(png), "--partition", "shards",
                 "--set", "classes_per_client=2"]) == 0
    assert png.stat().st_size > 0
    assert "4" in capsys.readouterr().out


def test_reproduce_writes_a_report_and_reuses_runs(tmp_path, capsys, monkeypatch):
    import fedfuse.reproduce as rp
    from fedfuse.reproduce.preset import Family, Table

    base = {"rounds": 2, "clients": 4, "clients_per_round": 2, "model": "mlp", "model_options": {"widths": [8]},
            "threads": 1, "plots": False}
    rows = {"fedavg": {"algorithm": "fedavg"}, "fedprox": {"algorithm": "fedprox"}}
    fam = Family("a tiny reproduction", lambda args: [Table("tiny", "Tiny", base, rows)])
    monkeypatch.setattr(rp, "available", lambda: {"tiny": fam})
    out = tmp_path / "rep"
    assert main(["reproduce", "tiny", "--out", str(out), "--seeds", "1"]) == 0
    md = (out / "report.md").read_text()
    assert md.startswith("# reproduce tiny") and "| fedavg | 1 |" in md and "| fedprox | 1 |" in md
    assert "| fedprox | 1 |" in (out / "tiny" / "compare.md").read_text()
    assert "## Tiny" in (out / "tables.md").read_text()
    runs = sorted((out / "runs").iterdir())
    mtimes = [(d / "summary.json").stat().st_mtime_ns for d in runs]
    assert main(["reproduce", "tiny", "--out", str(out), "--seeds", "1", "--reuse", "--no-report"]) == 0
    assert [(d / "summary.json").stat().st_mtime_ns for d in runs] == mtimes  # kept
    assert main(["reproduce", "tiny", "--out", str(out), "--seeds", "1", "--no-report"]) == 0
    assert all((d / "summary.json").stat().st_mtime_ns != m for d, m in zip(runs, mtimes))  # run again


def test_show_is_complete_for_datasets_partitions_and_models():
    """Every option of every dataset, partition and model has a type and a help line; no help text cites an
    internal file number; defaults print as a person writes them."""
    import re

    from fedfuse.api import show
    from fedfuse.data.datasets import DATASETS
    from fedfuse.data.partition import PARTITIONS
    from fedfuse.models import MODELS

    for names, kind in ((DATASETS, "dataset"), (PARTITIONS, "partition"), (MODELS, "model")):
        for name in names:
            (comp,) = show(name, kind)
            for o in comp.options:
                assert o.help and o.type != "any", (kind, name, o.name)
    from fedfuse.algorithms import ALGORITHMS

    for name in ALGORITHMS:
        text = show(name, "algorithm")[0].format()
        assert not re.search(r"\b00\d (§|Table|Eq)", text), name
        assert not re.search(r"\d\.\d{9,}", text), name  # 0.8333, not 0.8333333333333334


def test_list_shows_options_of_datasets(capsys):
    assert main(["list", "datasets"]) == 0
    out = capsys.readouterr().out
    assert "options: train_limit, test_limit, rotate_domains, label_mode" in out


def test_run_table_says_what_final_is(tmp_path, capsys):
    assert main(["run", *FAST, "--rounds", "3", "--out", str(tmp_path / "r"), "--set", "plots=false"]) == 0
    out = capsys.readouterr().out
    assert "final = the mean of the last 5 evaluations; this run evaluated 3 times" in out
    assert "round 3" in out.splitlines()[0]


def test_ctrl_c_says_how_to_resume(tmp_path, capsys, monkeypatch):
    from fedfuse.engine import loop

    original = loop.Experiment._checkpoint

    def interrupted(self, next_round):
        original(self, next_round)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop.Experiment, "_checkpoint", interrupted)
    out = tmp_path / "r"
    with pytest.raises(SystemExit) as e:
        main(["run", *FAST, "--out", str(out), "--set", "plots=false"])
    assert e.value.code == 130
    assert f"continue with: fedfuse run --resume {out}" in capsys.readouterr().err
    monkeypatch.setattr(loop.Experiment, "_checkpoint", original)
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0


def test_partition_png_says_where(tmp_path, capsys):
    assert main(["partition", "--clients", "4", "--clients-per-round", "2", "--png", "p.png"]) == 0
    assert f"wrote the plot to {Path('p.png').resolve()}" in capsys.readouterr().out


def test_metrics_csv_keeps_integers(tmp_path, capsys):
    import csv

    out = tmp_path / "r"
    assert main(["run", *FAST, "--out", str(out), "--set", "plots=false", "--log", "csv"]) == 0
    rows = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
    assert rows[0]["round"] == "1" and "." not in rows[0]["total_bytes_down"]
