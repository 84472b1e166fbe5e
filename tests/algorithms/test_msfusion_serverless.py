"""MSfusion with ``global_model="none"``: no central aggregation.  Only peer envelopes leave a participant, the
relay (the server of the simulation, the ServerApp on Flower) forwards them untouched and averages nothing, and the
participants' sub-models and memories never reach it — in process and over Flower messages."""

from __future__ import annotations

import pytest
import torch

from fedfuse.config import make_config, validate
from fedfuse.engine.loop import Experiment, strip_timing
from fedfuse.runner import experiment

OPTS = dict(algorithm="msfusion", dataset="digits", clients=4, clients_per_round=4, rounds=3, model="mlp",
            plots=False, lr=0.05, model_options={"widths": [32, 32]},
            algorithm_options={"mu": 0.5, "global_model": "none"})


class Recorder:
    """Wraps the algorithm's server hooks and records everything they are handed."""

    def __init__(self, exp: Experiment) -> None:
        self.replies, self.routed, self.states = [], [], []
        algo = exp.algo
        exchange, aggregate = algo.exchange, algo.aggregate_fit

        def rec_exchange(info, results):
            self.replies.append({c: dict(m.tensors) for c, m in results.items()})
            out, moved = exchange(info, results)
            self.routed.append({c: dict(m.tensors) for c, m in out.items()})
            return out, moved

        def rec_aggregate(state, info, results):
            new = aggregate(state, info, results)
            self.states.append(new)
            return new

        algo.exchange, algo.aggregate_fit = rec_exchange, rec_aggregate


def test_the_relay_only_forwards_envelopes_and_holds_no_model():
    exp = experiment(make_config(**OPTS))
    rec = Recorder(exp)
    exp.run()
    for replies, routed in zip(rec.replies, rec.routed, strict=True):
        for tensors in replies.values():
            assert all(k.startswith("sim/peer/") for k in tensors), sorted(tensors)[:3]  # envelopes only
        for c, tensors in routed.items():  # delivered exactly as sent: nothing averaged on the way
            for key, v in tensors.items():
                _, _, sender, name = key.split("/", 3)
                assert torch.equal(v, replies[int(sender)][f"sim/peer/{c}/{name}"])
    for state in rec.states:
        assert set(state) == {"mailbox", "diag"}
    assert exp.algo.global_model(exp.state) is None and exp.history[-1]["global_accuracy"] is None
    assert exp.totals.bytes_up == 0 and exp.totals.bytes_peer > 0  # the last round sends nothing
    assert exp.history[-1]["personal_accuracy"] > 0.3  # each participant's own full-size memory has learned


def test_serverless_mode_trains_like_the_assembled_mode():
    """The participants' training does not depend on the evaluation model: same peer traffic and losses."""
    a = experiment(make_config(**OPTS))
    a.run()
    b = experiment(make_config(**{**OPTS, "algorithm_options": {"mu": 0.5}}))
    b.run()
    for ha, hb in zip(a.history, b.history, strict=True):
        assert ha["train_loss"] == hb["train_loss"] and ha["bytes_peer"] == hb["bytes_peer"]
        assert ha["coverage"] == hb["coverage"]


def test_serverless_on_flower_keeps_memories_on_the_nodes():
    pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")
    from fedfuse.flower.app import KEPT, client_app
    from fedfuse.flower.executor import FlowerExecutor, LocalGrid

    cfg = validate(make_config(**OPTS))
    ref = experiment(cfg)
    ref.run()
    grid = LocalGrid(client_app, 2)
    flw = experiment(cfg, executor=FlowerExecutor(grid, cfg, cfg.seed))
    flw.run()
    assert [strip_timing(h) for h in flw.history] == [strip_timing(h) for h in ref.history]
    for c, st in flw.client_states.items():  # the server holds markers, the nodes hold the models
        assert st["known"] == KEPT and st["sub"] == KEPT, c
    assert any(k.startswith("fedfuse.private.") for ctx in grid.contexts.values() for k in ctx.state)
