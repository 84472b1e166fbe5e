"""A deployed run's progress reaches Flower's logger (what ``flwr log`` shows): one line per round with the numbers
of ``metrics.jsonl``, and fedfuse's other INFO lines; the ``fedfuse`` logger is left as it was afterwards.  The
deployed path (``flwr log --show`` of a real run) is checked in ``test_federation_guide.py``."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")

from flwr.common.logger import FLOWER_LOGGER

from fedfuse.config import make_config
from fedfuse.flower.app import client_app
from fedfuse.flower.executor import FlowerExecutor, LocalGrid
from fedfuse.flower.logs import RoundLog, flower_logging, forward_to_flower, round_line
from fedfuse.runner import experiment


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def flower_lines():
    cap = Capture()
    FLOWER_LOGGER.addHandler(cap)
    try:
        yield cap.lines
    finally:
        FLOWER_LOGGER.removeHandler(cap)


def test_round_line_by_hand() -> None:
    rec = {"round": 3, "clients": [0, 1, 2, 5], "replied": 3, "dropped": [5], "train_loss": 0.123456,
           "global_loss": 0.5, "loss": 0.5, "global_accuracy": 0.875, "val_accuracy": float("nan"), "seconds": 2.0}
    assert round_line(rec, 10) == ("fedfuse round 3/10: 3/4 replied, 1 dropped [5], train_loss 0.1235, "
                                   "global_loss 0.5000, global_accuracy 0.8750")
    assert round_line({"round": 1}) == "fedfuse round 1"
    assert "no update (round skipped)" in round_line({"round": 2, "round_skipped": True, "clients": []}, 2)


def test_flower_logging_forwards_fedfuse_info_and_restores_the_logger(flower_lines: list[str]) -> None:
    log = logging.getLogger("fedfuse")
    level, handlers = log.level, list(log.handlers)
    with flower_logging():
        log.info("shown %d", 1)
        log.debug("not shown")
    log.info("after")  # no longer forwarded
    assert flower_lines == ["shown 1"]
    assert log.level == level and log.handlers == handlers


def test_forward_to_flower_installs_one_handler(flower_lines: list[str]) -> None:
    log = logging.getLogger("fedfuse")
    level, handlers = log.level, list(log.handlers)
    try:
        first = forward_to_flower()
        assert forward_to_flower() is first and log.handlers == [*handlers, first]
        log.info("once")
        assert flower_lines == ["once"]
    finally:
        log.handlers[:] = handlers
        log.setLevel(level)


def test_every_round_of_a_flower_run_reaches_flowers_logger(flower_lines: list[str]) -> None:
    cfg = make_config({"algorithm": "fedavg", "dataset": "digits", "clients": 2, "clients_per_round": 2,
                       "rounds": 3, "eval_every": 3, "threads": 1, "plots": False, "seed": 1,
                       "model_options": {"widths": [8]}, "executor": "sequential"})
    exp = experiment(cfg, executor=FlowerExecutor(LocalGrid(client_app, 2), cfg, cfg.seed))
    exp.attach(RoundLog())
    with flower_logging():
        exp.run()
    assert flower_lines[0] == "fedfuse run: fedavg, 3 rounds, 2 clients (2 per round), seed 1"
    rounds = [line for line in flower_lines if line.startswith("fedfuse round ")]
    assert rounds == [round_line(rec, 3) for rec in exp.history]
    assert f"train_loss {exp.history[0]['train_loss']:.4f}" in rounds[0] and "2/2 replied" in rounds[0]
    assert f"global_accuracy {exp.history[2]['global_accuracy']:.4f}" in rounds[2]
    assert any(line.startswith("flower: node 1 serves") for line in flower_lines)  # the executor's INFO lines too
