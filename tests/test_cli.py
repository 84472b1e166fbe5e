"""The command line: defaults, compare, list, partition and its error messages."""

import json

import pytest

from fedfuse.cli import main

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
        (["run", "--algorithm", "nope"], "algorithm: unknown value 'nope'; choose one of:"),
        (["run", "--dataset", "imagenet"], "dataset: unknown value 'imagenet'"),
        (["run", "--set", "bogus=1"], "unknown key 'bogus'; valid keys:"),
        (["run", "--set", "rounds=abc"], "rounds: expected an integer"),
        (["run", "--set", "algorithm_options.mu=1"], "unknown option 'mu' for algorithm 'fedavg'; valid options:"),
        (["run", "--clients", "3", "--clients-per-round", "5"], "clients_per_round: 5 exceeds clients (3)"),
        (["run", "--rounds", "0"], "rounds: must be >= 1"),
        (["run", "--set", "novalue"], "--set expects KEY=VALUE"),
        (["run", "--partition", "weird"], "partition: unknown value 'weird'"),
        (["run", "--model", "alexnet"], "model: unknown value 'alexnet'"),
        (["run", "--optimizer", "lbfgs"], "optimizer: unknown value 'lbfgs'; choose one of: sgd, adam"),
        (["run", "--resume", "/nonexistent/dir"], "no checkpoint.pt there"),
    ],
)
def test_errors_name_the_key_and_choices(argv, needle, capsys):
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert needle in err


def test_missing_data_dir_error_names_files(tmp_path, capsys):
    assert main(["run", "--dataset", "mnist", "--data-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "train-images-idx3-ubyte.gz" in err and str(tmp_path) in err


def test_config_file_and_set_override(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("algorithm: fedprox\nrounds: 5\nalgorithm_options: {mu: 0.5}\nplots: false\n")
    out = tmp_path / "r"
    assert main(["run", "--config", str(cfg), *FAST, "--set", "mu=0.25", "--out", str(out)]) == 0
    import yaml

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
        assert f"| {name} |" in md
        assert (out / name / "summary.json").exists()
    assert (out / "compare.csv").exists() and (out / "compare.png").stat().st_size > 0
    # same partition for every algorithm
    parts = {(out / n / "partition.json").read_text() for n in ("fedavg", "fedprox", "local")}
    assert len(parts) == 1


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
