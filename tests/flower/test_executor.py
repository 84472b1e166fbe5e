"""fedfuse on Flower: the wire format, every algorithm through the Flower executor, node failures, and one run
in Flower's real simulation runtime.

The parametrised test sends every job of every algorithm as a Flower ``Message`` through Flower's protobuf
serialisation to the ``ClientApp`` and back (:class:`~fedfuse.flower.executor.LocalGrid`): the run must equal the
in-process sequential run exactly (same seeds, same kernels, tensors bit for bit on the wire).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")

from fedfuse.algorithms import ALGORITHMS
from fedfuse.config import make_config, validate
from fedfuse.engine.loop import TIMING_KEYS, Experiment, strip_timing
from fedfuse.flower import wire
from fedfuse.flower.app import client_app, prepare_node
from fedfuse.flower.executor import FlowerExecutor, LocalGrid
from fedfuse.runner import experiment
from fedfuse.types import FitStats, Message
from golden.make_golden import token_federation
from support import LORA
from support import conformance_cfg as _cfg


# ---- wire -------------------------------------------------------------------------------------------------
def test_wire_round_trip_is_exact():
    g = torch.Generator().manual_seed(0)
    value = (
        Message({"w": torch.randn(3, 4, generator=g), "b": torch.randn(2, generator=g).to(torch.bfloat16),
                 "n": torch.tensor(7), "mask": torch.tensor([True, False])},
                {"sel": {"0": [1, 2]}, "slot": 3, "inf": float("inf"), "t": (1, "a")},
                FitStats(num_examples=12, samples=60, steps=3, train_loss=0.25, flops=1.5e6, trained_params=None)),
        {0: None, 5: [1.5, float("nan")], "__odd": "x"},
        torch.arange(6).reshape(2, 3)[:, 1],  # a non-contiguous view
    )
    msg, d, view = wire.unpack(wire.pack(value))
    for k, t in value[0].tensors.items():
        assert msg.tensors[k].dtype == t.dtype and torch.equal(msg.tensors[k], t)
    assert msg.meta["sel"] == {"0": [1, 2]} and msg.meta["t"] == (1, "a") and msg.meta["inf"] == math.inf
    assert msg.stats == value[0].stats and wire.unpack(wire.pack(Message({}))).stats is None
    assert d[0] is None and d[5][0] == 1.5 and math.isnan(d[5][1]) and d["__odd"] == "x"
    assert list(d) == [0, 5, "__odd"]
    assert torch.equal(view, torch.tensor([1, 4]))


def test_wire_refuses_arbitrary_objects():
    class Secret:
        pass

    with pytest.raises(wire.WireError, match=r"Secret at \.state\.x"):
        wire.split({"state": {"x": Secret()}})


# ---- every algorithm through Flower messages ----------------------------------------------------------------
def _flower_run(cfg, fed=None, *, nodes: int = 2, fail=None) -> tuple[Experiment, LocalGrid]:
    """``cfg`` run with every client job sent as a Flower message to ``nodes`` in-process ClientApp nodes."""
    cfg = validate(cfg)
    if fed is not None:  # a federation assembled in code: the node is handed the same one
        prepare_node(cfg, fed=fed)
    grid = LocalGrid(client_app, nodes, fail=fail)
    exp = experiment(cfg, fed=fed, executor=FlowerExecutor(grid, cfg, cfg.seed))
    exp.run()
    return exp, grid


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_on_flower_equals_in_process(algorithm):
    if algorithm in LORA:
        pytest.importorskip("peft", reason="needs the lora extra: pip install -e '.[lora]'")
    lm = algorithm == "simple-fedma" or algorithm in LORA
    fed = token_federation() if lm else None
    cfg = _cfg(algorithm, "sequential")
    ref = experiment(cfg, fed=fed)
    ref.run()
    flw, grid = _flower_run(cfg, fed=token_federation() if lm else None)
    assert [strip_timing(h) for h in flw.history] == [strip_timing(h) for h in ref.history]
    totals = {k: v for k, v in flw.summary()["totals"].items() if k not in TIMING_KEYS}
    assert totals == {k: v for k, v in ref.summary()["totals"].items() if k not in TIMING_KEYS}
    assert grid.calls >= 2 * cfg.rounds - 1  # fit and evaluate travelled as messages


# ---- failures -----------------------------------------------------------------------------------------------
def test_a_node_that_dies_is_a_dropout_and_the_run_completes(tmp_path):
    cfg = make_config(algorithm="fedavg", dataset="digits", clients=6, clients_per_round=6, rounds=3,
                      model_options={"widths": [16]}, plots=False, out=str(tmp_path / "run"), checkpoint_every=1)
    # node 2 (clients 1, 3, 5) stops answering from its third call on: round 2's fit
    exp, _ = _flower_run(cfg, fail={2: lambda call: call >= 3})
    hist = exp.history
    # round 2: its clients are dropouts; afterwards the silent node is skipped and node 1 serves everyone
    assert [h["replied"] for h in hist] == [6, 3, 6]
    assert hist[1]["dropped"] == [1, 3, 5] and exp.totals.dropped == 3
    assert all(h["personal_accuracy"] is not None for h in hist)
    assert exp.summary()["rounds_completed"] == 3
    ref = experiment(cfg.__class__(**{**cfg.to_dict(), "out": None}))
    ref.run()
    assert hist[0]["personal_accuracy"] == ref.history[0]["personal_accuracy"]


def test_a_silent_node_is_retried_after_a_few_calls():
    cfg = validate(make_config(algorithm="fedavg", dataset="digits", clients=4, clients_per_round=4, rounds=4,
                               model_options={"widths": [8]}, plots=False))
    # node 2 misses only call 1 (round 1's fit); it is skipped for 3 calls and serves again from call 5 on
    grid = LocalGrid(client_app, 2, fail={2: lambda call: call == 1})
    served: list[set[int]] = []
    real = grid.send_and_receive

    def spy(messages, *, timeout=None):
        messages = list(messages)
        served.append({m.metadata.dst_node_id for m in messages})
        return real(messages, timeout=timeout)

    grid.send_and_receive = spy
    exp = experiment(cfg, executor=FlowerExecutor(grid, cfg, cfg.seed))
    exp.run()
    assert served == [{1, 2}, {1}, {1}, {1}, {1, 2}, {1, 2}, {1, 2}, {1, 2}]
    assert [h["replied"] for h in exp.history] == [2, 4, 4, 4]


def test_resume_on_flower_is_bit_identical(tmp_path):
    base = dict(algorithm="fedmr", dataset="digits", clients=4, clients_per_round=4, rounds=3, plots=False,
                model_options={"widths": [16]}, checkpoint_every=1)
    full, _ = _flower_run(make_config(**base, out=str(tmp_path / "a")))
    part, _ = _flower_run(make_config(**{**base, "rounds": 2}, out=str(tmp_path / "b")))
    cfg = make_config(**base, out=str(tmp_path / "b"))
    grid = LocalGrid(client_app, 2)
    resumed = experiment(cfg, executor=FlowerExecutor(grid, cfg, cfg.seed))
    resumed.run(resume=True)
    assert [strip_timing(h) for h in resumed.history] == [strip_timing(h) for h in full.history]
    assert part.history[:2] == resumed.history[:2]


# ---- Flower's own simulation runtime --------------------------------------------------------------------------
def test_executor_flower_runs_in_flowers_simulation_runtime():
    """``--executor flower``: Ray actors, Flower's in-memory SuperLink; metrics equal the in-process run."""
    pytest.importorskip("ray", reason="needs the flower extra: pip install -e '.[flower]'")
    from fedfuse.api import run

    opts = dict(algorithm="fedavg", dataset="digits", clients=4, clients_per_round=2, rounds=2, threads=1,
                model_options={"widths": [16]}, plots=False)
    ref = run(**opts)
    flw = run(**opts, executor="flower")
    assert flw.summary["executor"]["used"] == "flower"
    assert [strip_timing(h) for h in flw.history] == [strip_timing(h) for h in ref.history]


def test_a_node_reads_data_from_its_own_data_dir(tmp_path, monkeypatch):
    """``--node-config "data-dir=..."`` replaces the server's data path on that node only."""
    import fedfuse.flower.app as app

    seen = []
    real = app.prepare_node
    monkeypatch.setattr(app, "prepare_node", lambda cfg, fed=None, key=None: seen.append(cfg.data_dir) or real(
        cfg, fed, key=key))
    cfg = make_config(algorithm="fedavg", dataset="digits", clients=2, clients_per_round=2, rounds=1, plots=False,
                      model_options={"widths": [8]})
    grid = LocalGrid(client_app, 1)
    grid.contexts[1].node_config["data-dir"] = str(tmp_path)
    app._RUNS.clear()
    experiment(cfg, executor=FlowerExecutor(grid, cfg, cfg.seed)).run()
    assert seen == [str(tmp_path)]
