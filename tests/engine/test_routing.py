"""Honest routing: the summary says which executor trained the clients and why a request was re-routed
(``stacked`` → ``batched`` for a model without a stacked forward pass, ``batched`` → ``sequential`` for an
algorithm without a declared client program), and a resumed run counts the rounds before the interruption."""

from __future__ import annotations

import json

import pytest

from fedfuse.config import RunConfig, apply
from fedfuse.engine.routing import RouteLog, executor_line, executor_summary
from fedfuse.run_table import results_table
from fedfuse.runner import experiment


def _cfg(tmp_path, **kw) -> RunConfig:
    base = dict(dataset="digits", partition="iid", model="mlp", clients=4, clients_per_round=3, rounds=2,
                batch_size=32, lr=0.05, seed=2, out=str(tmp_path / "run"), plots=False, local_epochs=1,
                model_options={"widths": [8]}, dataset_options={"train_limit": 300})
    base.update(kw)
    return apply(RunConfig(), base)


def test_route_log_counts_paths_and_reasons():
    log = RouteLog()
    log.ran("stacked", 5)
    log.ran("batched", 3, "CNN: no stacked forward pass")
    log.ran("batched", 4, "CNN: no stacked forward pass")
    log.ran("sequential", 1, "no declared client program")
    log.ran("stacked", 0)  # nothing ran: not a path
    assert log.paths() == {"batched": 7, "stacked": 5, "sequential": 1}
    block = executor_summary("stacked", log, "stacked")
    assert block == {"requested": "stacked", "used": "batched+stacked+sequential",
                     "reason": "CNN: no stacked forward pass (7 of 13 client trainings ran batched); "
                               "no declared client program (1 of 13 client trainings ran sequential)",
                     "clients": {"batched": 7, "stacked": 5, "sequential": 1}, "detail": "stacked"}
    again = RouteLog()
    again.load_state_dict(json.loads(json.dumps(log.state_dict())))  # through a checkpoint
    assert again.counts == log.counts


def test_a_run_on_its_own_path_has_no_reason():
    log = RouteLog()
    log.ran("batched", 6)
    block = executor_summary("batched", log, "batched")
    assert block["used"] == "batched" and block["reason"] is None
    assert executor_line(block) == "executor: batched"
    assert executor_summary("auto", RouteLog(), "auto")["used"] == "auto"  # before any training
    assert executor_line("batched") == "executor: batched" and executor_line(None) is None  # older summaries


def test_stacked_hands_a_convolutional_model_to_batched_and_says_so(tmp_path, capsys):
    exp = experiment(_cfg(tmp_path, executor="stacked", model="cnn", model_options={}))
    summary = exp.run()
    block = summary["executor"]
    assert block["requested"] == "stacked" and block["used"] == "batched" and block["detail"] == "stacked"
    assert block["clients"] == {"batched": 2 * 3}  # rounds × clients per round
    assert block["reason"] == "CNN: no stacked forward pass (6 of 6 client trainings ran batched)"
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["executor"] == block
    table = results_table(summary, exp.history)
    assert ("executor: batched instead of the requested stacked: CNN: no stacked forward pass (6 of 6 client "
            "trainings ran batched)") in table.splitlines()


def test_stacked_on_a_linear_model_runs_stacked(tmp_path):
    block = experiment(_cfg(tmp_path, executor="stacked", out=None)).run()["executor"]
    assert block == {"requested": "stacked", "used": "stacked", "reason": None, "clients": {"stacked": 6},
                     "detail": "stacked"}


def test_batched_falls_back_to_sequential_and_says_why(tmp_path):
    """FedEM with gradient clipping declares no client program: the batched executor calls its ``fit`` one
    client at a time."""
    exp = experiment(_cfg(tmp_path, executor="batched", algorithm="fedem", grad_clip=1.0, out=None))
    block = exp.run()["executor"]
    assert block["requested"] == "batched" and block["used"] == "sequential"
    assert block["reason"] == "no declared client program (6 of 6 client trainings ran sequential)"
    assert exp.executor.fallbacks == {"no declared client program": 6}


@pytest.mark.parametrize("executor", ["sequential", "processes"])
def test_executors_without_a_choice_report_their_own_path(tmp_path, executor):
    block = experiment(_cfg(tmp_path, executor=executor, out=None, threads=1)).run()["executor"]
    assert block["used"] == executor and block["reason"] is None and block["clients"] == {executor: 6}


class Killed(Exception):
    pass


def test_a_resumed_run_counts_the_rounds_before_the_interruption(tmp_path):
    def kill(rec):
        if rec["round"] == 1:
            raise Killed

    cfg = _cfg(tmp_path, executor="stacked", model="cnn", model_options={}, rounds=3)
    killed = experiment(cfg, on_round=kill)
    with pytest.raises(Killed):
        killed.run()
    block = experiment(cfg, fed=killed.fed).run(resume=True)["executor"]
    assert block["clients"] == {"batched": 3 * 3}
    assert block["reason"] == "CNN: no stacked forward pass (9 of 9 client trainings ran batched)"
