"""The round loop: outputs, FedAvg composition, resume bit-identity, client-order independence."""

import json

import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.config import RunConfig, apply
from fedfuse.engine.client import train_local
from fedfuse.engine.executor import SequentialExecutor
from fedfuse.engine.loop import Experiment, strip_timing
from fedfuse.fusion.average import weighted_average
from fedfuse.rng import derive_seed, numpy_rng, torch_generator
from fedfuse.runner import experiment


def small_cfg(tmp_path, **kw) -> RunConfig:
    base = dict(
        dataset="digits", partition="dirichlet", model="mlp", clients=6, clients_per_round=3, rounds=3,
        batch_size=32, lr=0.05, seed=3, out=str(tmp_path / "run"), plots=False,
        model_options={"widths": [32]}, partition_options={"alpha": 0.5, "min_size": 20},
    )
    base.update(kw)
    return apply(RunConfig(), base)


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
    for key in ("algorithm", "dataset", "rounds_completed", "final", "best"):
        assert key in s
    for key in ("global_accuracy", "personal_accuracy", "loss", "bytes_down", "bytes_up", "client_flops",
                "server_parameters", "wall_seconds"):
        assert key in s["final"] and key in s["best"], key
    # accounting: FedAvg sends the full model down and up to every sampled client
    nparams = 64 * 32 + 32 + 32 * 10 + 10
    assert recs[0]["bytes_down"] == 3 * nparams * 4 == recs[0]["bytes_up"]
    assert s["final"]["server_parameters"] == nparams
    assert recs[0]["client_flops"] > 0
    assert s["final"]["bytes_down"] == 3 * 3 * nparams * 4


def _manual_fedavg_round(exp: Experiment, r: int, init: dict) -> dict:
    clients = exp.algo.select_clients(RoundInfo(r, exp.cfg.rounds), numpy_rng(exp.cfg.seed, "select", r))
    states, weights = [], []
    for c in clients:
        torch.manual_seed(derive_seed(exp.cfg.seed, "fit", r, 0, c, "torch"))
        gen = torch_generator(exp.cfg.seed, "fit", r, 0, c)
        model = exp.ctx.build()
        model.load_state_dict(init)
        data = exp.fed.clients[c]
        train_local(model, data.train, exp.ctx.train, gen)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        weights.append(float(len(data.train)))
    return weighted_average(states, weights)


def test_fedavg_round_equals_hand_composed_average(tmp_path):
    cfg = small_cfg(tmp_path, rounds=1, out=None)
    exp = experiment(cfg)
    exp.state = exp.algo.init_state()
    init = {k: v.clone() for k, v in exp.state["global"].items()}
    exp.client_states = {c: None for c in range(exp.fed.num_clients)}
    exp._round(0)
    expected = _manual_fedavg_round(exp, 0, init)
    for k in expected:
        torch.testing.assert_close(exp.state["global"][k], expected[k], rtol=0, atol=0)


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
    for block in ("final", "best"):
        assert strip_timing(sa[block]) == strip_timing(sb[block])


def test_same_seed_same_metrics_and_other_seed_differs(tmp_path):
    h1 = experiment(small_cfg(tmp_path, out=None)).run()
    h2 = experiment(small_cfg(tmp_path, out=None)).run()
    h3 = experiment(small_cfg(tmp_path, out=None, seed=4)).run()
    assert strip_timing(h1["final"]) == strip_timing(h2["final"])
    assert h1["final"]["val_loss"] != h3["final"]["val_loss"]


def test_fedprox_with_mu_zero_equals_fedavg(tmp_path):
    a = experiment(small_cfg(tmp_path, out=None))
    a.run()
    b = experiment(small_cfg(tmp_path, out=None, algorithm="fedprox", algorithm_options={"mu": 0.0}), fed=a.fed)
    b.run()
    for k, v in a.state["global"].items():
        torch.testing.assert_close(b.state["global"][k], v, rtol=0, atol=0)


def test_fedprox_pulls_towards_global(tmp_path):
    a = experiment(small_cfg(tmp_path, out=None, rounds=1, local_epochs=3))
    a.run()
    b = experiment(small_cfg(tmp_path, out=None, rounds=1, local_epochs=3, algorithm="fedprox",
                             algorithm_options={"mu": 10.0}), fed=a.fed)
    b.run()
    init = a.algo.init_state()["global"]
    dist = lambda s: sum(float((s[k] - init[k]).pow(2).sum()) for k in init)  # noqa: E731
    assert dist(b.state["global"]) < dist(a.state["global"])


def test_local_communicates_nothing_and_fedavg_ft_personalises(tmp_path):
    loc = experiment(small_cfg(tmp_path, out=None, algorithm="local"))
    s = loc.run()
    assert all(h["bytes_down"] == 0 and h["bytes_up"] == 0 for h in loc.history)
    assert s["final"]["global_accuracy"] is None and s["final"]["personal_accuracy"] > 0.3
    fa = experiment(small_cfg(tmp_path, out=None, algorithm="fedavg"), fed=loc.fed)
    fa.run()
    ft = experiment(small_cfg(tmp_path, out=None, algorithm="fedavg-ft"), fed=loc.fed)
    ft.run()
    # same training, so same global model; fine-tuning changes only personalised evaluation
    assert fa.history[-1]["global_accuracy"] == ft.history[-1]["global_accuracy"]
    assert fa.history[-1]["personal_accuracy"] != ft.history[-1]["personal_accuracy"]


def test_best_round_is_lowest_validation_loss(tmp_path):
    exp = experiment(small_cfg(tmp_path, out=None, rounds=5))
    s = exp.run()
    vals = [h["val_loss"] for h in exp.history]
    assert s["best"]["round"] == 1 + vals.index(min(vals))
    assert s["best"]["val_loss"] == min(vals)


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
