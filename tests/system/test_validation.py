"""Bad input ends in one ``fedfuse: error:`` line naming the culprit (exit 2), never in a traceback or a silent run."""

from __future__ import annotations

import gzip
import json
import os
import struct

import numpy as np
import pytest
import torch
import yaml

from fedfuse.cli import main
from fedfuse.config import ConfigError, RunConfig, apply, validate
from fedfuse.data.datasets import load_dataset

FAST = ["--rounds", "2", "--clients", "4", "--clients-per-round", "2", "--set", "model_options.widths=[16]",
        "--model", "mlp", "--no-progress", "--set", "plots=false"]


def _err(argv, capsys, code=2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedfuse: error:"), err
    assert "Traceback" not in err
    return err


# ---- the command line: one line, the culprit named, exit code 2 -------------------------------------------

@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--lr", "nan"], ["lr", "finite"]),
        (["--lr", "inf"], ["lr", "finite"]),
        (["--lr", "1e6"], ["lr", "<= 100"]),
        (["--set", "grad_clip=-1"], ["grad_clip", ">= 0"]),
        (["--seed", str(2**70)], ["seed", "<="]),
        (["--seed", "-1"], ["seed", ">= 0"]),
        (["--set", "widths=[a]"], ["model_options.widths[0]", "'a'", "integer"]),
        (["--set", "algorithm_options.int_policy=avg"], ["int_policy", "max, sum, first", "'avg'"]),
        (["--algorithm", "fedprox", "--set", "mu=-1"], ["algorithm_options.mu", ">= 0", "fedprox"]),
        (["--algorithm", "msfusion", "--set", "mu=0"], ["algorithm_options.mu", "> 0"]),
        (["--algorithm", "msfusion", "--set", "mu=2"], ["algorithm_options.mu", "<= 1"]),
        (["--algorithm", "msfusion", "--set", "topology=star"], ["topology", "full, ring", "'star'"]),
        (["--algorithm", "fedmr", "--set", "warmup_rounds=-2"], ["warmup_rounds", ">= 0"]),
        (["--set", "max_attempts=0"], ["max_attempts", ">= 1", "0"]),
        (["--set", "alpha=-0.5"], ["alpha", "> 0"]),
        (["--set", "dropout=1.5"], ["dropout", "< 1"]),
        (["--set", "on_divergence=ignore"], ["on_divergence", "stop, rollback"]),
        (["--set", "corrupt=nan"], ["corrupt", "corrupt_clients"]),
        (["--set", "corrupt=nan", "--set", "corrupt_clients=[99]"], ["corrupt_clients", "99"]),
        (["--set", "quorum=50"], ["quorum", "exceeds clients"]),
        (["--set", "dataset_options.train_limit=0"], ["train_limit", ">= 1"]),
        (["--clients", "1000", "--clients-per-round", "5"], ["clients", "1000", "1437", "at most"]),
        (["--algorithm", "simple-fedma", "--model", "mlp"], ["simple-fedma", "mlp", "transformer"]),
    ],
)
def test_run_rejects_bad_settings(argv, needles, tmp_path, capsys):
    err = _err(["run", *argv, "--rounds", "1", "--out", str(tmp_path / "r"), "--no-progress"], capsys)
    for n in needles:
        assert n in err, (n, err)
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda(tmp_path, capsys):
    err = _err(["run", "--device", "cuda", "--out", str(tmp_path / "r")], capsys)
    assert "device" in err and "CUDA is not available" in err


def test_config_file_missing_and_invalid(tmp_path, capsys):
    err = _err(["run", "--config", str(tmp_path / "none.yaml")], capsys)
    assert "none.yaml" in err and "no such file" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\nlr: 0.1\n")
    err = _err(["run", "--config", str(bad)], capsys)
    assert "bad.yaml" in err and "invalid YAML" in err and "line" in err
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    assert "mapping" in _err(["run", "--config", str(lst)], capsys)


def test_compare_rejects_duplicate_algorithms(tmp_path, capsys):
    err = _err(["compare", "--algorithms", "fedavg,fedprox,fedavg", "--out", str(tmp_path / "c")], capsys)
    assert "fedavg" in err and "more than once" in err


def test_out_that_is_a_file_or_unwritable(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert "is a file" in _err(["run", *FAST, "--out", str(f)], capsys)
    assert "cannot write" in _err(["run", *FAST, "--out", str(f / "sub")], capsys)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            assert "cannot write" in _err(["run", *FAST, "--out", str(ro / "r")], capsys)
        finally:
            ro.chmod(0o700)


def test_run_directory_is_never_overwritten_without_flag(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", *FAST, "--out", str(out)]) == 0
    before = (out / "metrics.jsonl").read_text()
    err = _err(["run", *FAST, "--out", str(out)], capsys)
    assert "already holds a run" in err and "--overwrite" in err
    # the run's own config file re-runs into a new directory, not over the run it came from
    assert main(["run", "--config", str(out / "config.yaml"), "--no-progress", "--out", str(tmp_path / "b")]) == 0
    assert (out / "metrics.jsonl").read_text() == before
    assert main(["run", *FAST, "--rounds", "1", "--out", str(out), "--overwrite"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_resume_checks_and_extends(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", *FAST, "--out", str(out)]) == 0
    # a larger --rounds continues the run
    assert main(["run", "--resume", str(out), "--rounds", "3", "--no-progress"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2, 3]
    assert yaml.safe_load((out / "config.yaml").read_text())["rounds"] == 3
    # fewer rounds than done, or another algorithm/model: refused, named
    assert "give --rounds >= 3" in _err(["run", "--resume", str(out), "--rounds", "2", "--no-progress"], capsys)
    assert "algorithm" in _err(["run", "--resume", str(out), "--algorithm", "fedprox", "--no-progress"], capsys)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    cfg["model_options"] = {"widths": [32]}
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    err = _err(["run", "--resume", str(out), "--no-progress"], capsys)
    assert "model_options" in err and "checkpoint.pt" in err


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", b"PK\x03\x04truncated"])
def test_resume_from_empty_or_corrupt_checkpoint(tmp_path, capsys, content):
    out = tmp_path / "r"
    assert main(["run", *FAST, "--out", str(out)]) == 0
    (out / "checkpoint.pt").write_bytes(content)
    err = _err(["run", "--resume", str(out), "--no-progress"], capsys)
    assert "checkpoint.pt" in err and ("empty" in err or "not a readable checkpoint" in err)


def test_clients_without_test_data_are_counted(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", *FAST, "--clients", "60", "--clients-per-round", "5", "--rounds", "1",
                 "--set", "val_fraction=0", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert "clients_without_test" in s["final"]
    assert s["final"]["clients_without_test"] >= 0


# ---- the Python API: the same checks -----------------------------------------------------------------------

def test_validate_checks_types_and_bounds_of_every_field():
    with pytest.raises(ConfigError, match="rounds: expected an integer"):
        validate(RunConfig(rounds="x"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="lr: must be a finite number"):
        validate(RunConfig(lr=float("nan")))
    with pytest.raises(ConfigError, match=r"momentum: must be < 1\.0"):
        validate(RunConfig(momentum=1.0))
    with pytest.raises(ConfigError, match=r"corrupt_clients\[0\]: expected an integer"):
        validate(apply(RunConfig(), {"corrupt_clients": ["a"]}))
    cfg = validate(apply(RunConfig(), {"deadline": float("inf")}))  # no deadline is allowed
    assert cfg.deadline == float("inf")


# ---- data files: the file and the problem named --------------------------------------------------------------

def _idx(path, arr: np.ndarray, code: int) -> None:
    header = struct.pack(">BBBB", 0, 0, code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    path.write_bytes(gzip.compress(header + arr.astype(">u1").tobytes()))


def _mnist_dir(root, labels: np.ndarray | None = None):
    d = root / "mnist"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 60), ("t10k", 20)):
        _idx(d / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28)), 0x08)
        y = labels if labels is not None and split == "train" else rng.integers(0, 10, n)
        _idx(d / f"{split}-labels-idx1-ubyte.gz", y, 0x08)
    return d


def test_good_synthetic_mnist_loads(tmp_path):
    _mnist_dir(tmp_path)
    ds = load_dataset("mnist", tmp_path)
    assert len(ds.train_y) == 60


def test_truncated_and_corrupt_gzip_idx(tmp_path, capsys):
    d = _mnist_dir(tmp_path)
    f = d / "train-images-idx3-ubyte.gz"
    f.write_bytes(f.read_bytes()[:40])
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte\.gz: corrupt or truncated gzip"):
        load_dataset("mnist", tmp_path)
    f.write_bytes(b"\x1f\x8b" + os.urandom(200))
    err = _err(["run", "--dataset", "mnist", "--data-dir", str(tmp_path), "--out", str(tmp_path / "r")], capsys)
    assert "train-images-idx3-ubyte.gz" in err


def test_label_outside_class_range(tmp_path):
    _mnist_dir(tmp_path, labels=np.array([200] + [1] * 59))
    with pytest.raises(ValueError, match=r"train label 200 is outside 0\.\.9"):
        load_dataset("mnist", tmp_path)


def test_corrupt_cifar_archive(tmp_path, capsys):
    (tmp_path / "cifar10").mkdir()
    tar = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    tar.write_bytes(b"\x1f\x8b\x08\x00" + os.urandom(500))
    err = _err(["run", "--dataset", "cifar10", "--data-dir", str(tmp_path), "--out", str(tmp_path / "r")], capsys)
    assert "cifar-10-python.tar.gz" in err and "corrupt" in err


def test_corrupt_femnist_json_names_the_file(tmp_path):
    base = tmp_path / "femnist-leaf" / "data"
    for split in ("train", "test"):
        (base / split).mkdir(parents=True)
        (base / split / f"all_data_0_{split}.json").write_text('{"users": ["a"], "user_data": {"a": {"x": [[0.0')
    with pytest.raises(ValueError, match=r"all_data_0_(train|test)\.json: invalid JSON at line 1"):
        load_dataset("femnist", tmp_path)
