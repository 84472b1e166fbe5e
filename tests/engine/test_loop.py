"""The round loop: outputs, resume bit-identity, client-order independence, best round, BatchNorm models."""

import json

import pytest
import torch

from fedfuse.config import RunConfig, apply
from fedfuse.engine.executor import SequentialExecutor
from fedfuse.engine.loop import strip_timing
from fedfuse.runner import experiment
from support import small_cfg


def read_metrics(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_run_writes_all_outputs(tmp_path):
    cfg = small_cfg(tmp_path, plots=True)
    summary = experiment(cfg).run()
    out = tmp_path / "run"
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "checkpoint.pt", "curves.png",
                 "partition.png", "partition.json", "model_final.pt"):
        assert (out / name).exists(), name
    recs = read_metrics(out)
    assert [r["round"] for r in recs] == [1, 2, 3]
    for key in ("round", "global_accuracy", "personal_accuracy", "loss", "bytes_down", "bytes_up", "seconds"):
        assert key in recs[-1]
    s = json.loads((out / "summary.json").read_text())
    assert s == json.loads(json.dumps(summary))
    for key in ("algorithm", "dataset", "rounds_completed", "final", "last", "best", "best_val_loss"):
        assert key in s
    for key in ("global_accuracy", "personal_accuracy", "loss", "bytes_down", "bytes_up", "client_flops",
                "server_parameters", "wall_seconds", "cpu_seconds"):
        assert all(key in s[block] for block in ("final", "last", "best", "best_val_loss")), key
    assert (out / "model_best_val_loss.pt").exists() and not (out / "model_best.pt").exists()
    # accounting: FedAvg sends the full model down and up to every sampled client
    nparams = 64 * 32 + 32 + 32 * 10 + 10
    assert recs[0]["bytes_down"] == 3 * nparams * 4 == recs[0]["bytes_up"]
    assert s["final"]["server_parameters"] == nparams
    assert recs[0]["client_flops"] > 0
    assert s["final"]["bytes_down"] == 3 * 3 * nparams * 4


class ReversedExecutor(SequentialExecutor):
    def map(self, fn, jobs):
        return {job.cid: self.run_one(fn, job) for job in reversed(list(jobs))}


@pytest.mark.parametrize("algorithm", ["fedavg", "local", "fedavg-ft"])
def test_results_do_not_depend_on_client_order(tmp_path, algorithm):
    a = experiment(small_cfg(tmp_path, algorithm=algorithm, out=None))
    ra = a.run()
    b = experiment(small_cfg(tmp_path, algorithm=algorithm, out=None), fed=a.fed)
    b.executor = ReversedExecutor(b.fed.clients, b.cfg.seed)
    rb = b.run()
    assert [strip_timing(h) for h in a.history] == [strip_timing(h) for h in b.history]
    assert ra["final"]["personal_accuracy"] == rb["final"]["personal_accuracy"]


class Killed(Exception):
    pass


@pytest.mark.parametrize("algorithm", ["fedavg", "local", "fedprox"])
def test_resume_is_bit_identical(tmp_path, algorithm):
    full = experiment(small_cfg(tmp_path / "a", algorithm=algorithm, rounds=4))
    full.run()

    def kill(rec):
        if rec["round"] == 2:
            raise Killed

    cfg_b = small_cfg(tmp_path / "b", algorithm=algorithm, rounds=4)
    with pytest.raises(Killed):
        experiment(cfg_b, on_round=kill).run()
    # a line written after the last checkpoint must not survive the resume
    with open(tmp_path / "b" / "run" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"round": 99}) + "\n")
    from fedfuse.config import load_yaml

    cfg_resumed = apply(RunConfig(), load_yaml(tmp_path / "b" / "run" / "config.yaml"))
    experiment(cfg_resumed).run(resume=True)
    ma = [strip_timing(r) for r in read_metrics(tmp_path / "a" / "run")]
    mb = [strip_timing(r) for r in read_metrics(tmp_path / "b" / "run")]
    assert ma == mb
    sa = json.loads((tmp_path / "a" / "run" / "summary.json").read_text())
    sb = json.loads((tmp_path / "b" / "run" / "summary.json").read_text())
    for block in ("final", "last", "best", "best_val_loss"):
        assert strip_timing(sa[block]) == strip_timing(sb[block])


def test_cpu_seconds_accumulate_and_are_unknown_after_a_checkpoint_without_them(tmp_path):
    """Every round record carries the run's CPU seconds so far (what the benchmark's s/round reads); a resume
    from a checkpoint written before they were counted reports None, not the part after the resume."""
    from fedfuse.engine.checkpoint import load_checkpoint, save_checkpoint

    def kill(rec):
        if rec["round"] == 2:
            raise Killed

    cfg = small_cfg(tmp_path, rounds=4)
    with pytest.raises(Killed):
        experiment(cfg, on_round=kill).run()
    recs = read_metrics(tmp_path / "run")
    cpu = [r["cpu_seconds"] for r in recs]
    assert 0 < cpu[0] < cpu[1]
    ck_path = tmp_path / "run" / "checkpoint.pt"
    ck = load_checkpoint(ck_path)
    assert ck["totals"]["cpu_seconds"] == cpu[1]
    del ck["totals"]["cpu_seconds"]
    save_checkpoint(ck_path, ck)
    experiment(cfg).run(resume=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds_completed"] == 4 and summary["totals"]["cpu_seconds"] is None
    assert [r.get("cpu_seconds") for r in read_metrics(tmp_path / "run")][2:] == [None, None]


def test_same_seed_same_metrics_and_other_seed_differs(tmp_path):
    h1 = experiment(small_cfg(tmp_path, out=None)).run()
    h2 = experiment(small_cfg(tmp_path, out=None)).run()
    h3 = experiment(small_cfg(tmp_path, out=None, seed=4)).run()
    assert strip_timing(h1["final"]) == strip_timing(h2["final"])
    assert h1["final"]["val_loss"] != h3["final"]["val_loss"]


def test_summary_best_final_last_and_best_val_loss_blocks(tmp_path):
    """best = the highest accuracy, best_val_loss = the lowest validation loss, last = the last evaluation, final =
    every evaluation metric's mean over the final window (here 5 evaluations: the last 3), the rest as at the end."""
    exp = experiment(small_cfg(tmp_path, out=None, rounds=5))
    s = exp.run()
    h = exp.history
    acc, vals = [r["global_accuracy"] for r in h], [r["val_loss"] for r in h]
    assert s["best"]["metric"] == "global_accuracy"
    assert s["best"]["round"] == 1 + acc.index(max(acc)) and s["best"]["global_accuracy"] == max(acc)
    assert s["best_val_loss"]["round"] == 1 + vals.index(min(vals)) and s["best_val_loss"]["val_loss"] == min(vals)
    assert s["last"]["round"] == 5 and s["last"]["global_accuracy"] == acc[-1]
    assert s["final"]["window"] == 3
    for key in ("global_accuracy", "personal_accuracy", "loss", "val_loss"):
        assert s["final"][key] == pytest.approx(sum(r[key] for r in h[2:]) / 3), key
    for key in ("round", "bytes_down", "server_parameters", "train_loss"):  # not evaluations: as at the end
        assert s["final"][key] == s["last"][key], key


def test_batchnorm_model_runs_and_averages_statistics(tmp_path):
    exp = experiment(small_cfg(tmp_path, out=None, model="resnet9", model_options={}, rounds=1,
                               clients_per_round=2))
    init = exp.algo.init_state()["global"]
    exp.run()
    g = exp.state["global"]
    rm = [k for k in g if k.endswith("running_mean")]
    nbt = [k for k in g if k.endswith("num_batches_tracked")]
    assert rm and nbt
    assert any(not torch.equal(g[k], init[k]) for k in rm)
    assert all(int(g[k]) > 0 for k in nbt)
