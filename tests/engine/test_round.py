"""A round in named steps (engine/round.py, Experiment._collect/_screen/_account/_fuse): each step on its own,
with hand-computed ledgers."""

from __future__ import annotations

import pytest
import torch

from fedfuse.config import RunConfig, apply, validate
from fedfuse.engine.context import RoundInfo
from fedfuse.engine.loop import build_federation
from fedfuse.engine.round import Collected, RoundLedger, Totals
from fedfuse.runner import experiment
from fedfuse.types import FitStats, Message


def _msg(n: int, sim: int = 0, stats: FitStats | None = None) -> Message:
    tensors = {"w": torch.zeros(n)}
    if sim:
        tensors["sim/peer"] = torch.zeros(sim)
    return Message(tensors, stats=stats)


def test_traffic_counts_bytes_both_ways_and_parameters_sent_without_simulation_bookkeeping():
    ledger = RoundLedger([0, 1], dropped=[], active=[0, 1])
    got = Collected(payloads={0: _msg(3, sim=5), 1: _msg(4)}, results={1: _msg(2)}, sent={})
    ledger.add_traffic(got)
    ledger.add_traffic(Collected(payloads={0: _msg(1)}, results={}, sent={}))  # a second stage
    assert ledger.down == (3 + 4 + 1) * 4 and ledger.up == 2 * 4  # float32, sim/ tensors are not traffic
    assert ledger.comm_params == {0: 3 + 1, 1: 4}


def test_work_is_summed_from_the_accepted_replies_typed_stats():
    ledger = RoundLedger([0, 1, 2], dropped=[], active=[0, 1, 2])
    ledger.add_work({0: _msg(1, stats=FitStats(samples=10, train_loss=2.0, flops=100.0, trained_params=7)),
                     1: _msg(1, stats=FitStats(samples=30, train_loss=1.0, flops=50.0, trained_params=None)),
                     2: _msg(1)})  # a relayed envelope reports no work
    assert ledger.flops == 150.0 and ledger.trained_params == [7]
    assert ledger.train_loss == pytest.approx((10 * 2.0 + 30 * 1.0) / 40)
    assert RoundLedger([], dropped=[], active=[]).train_loss is None


def test_the_record_carries_the_round_and_the_running_totals():
    totals = Totals(bytes_down=100, dropped=1)
    ledger = RoundLedger([3, 1], dropped=[1], active=[3], late=[3, 3], down=40, up=8, peer=4, flops=2.0,
                         comm_params={3: 10, 1: 20}, trained_params=[4, 6], quarantined={"5": "non-finite"})
    ledger.add_to(totals)
    rec = ledger.record(6, totals, server_parameters=99)
    assert rec["round"] == 7 and rec["replied"] == 1 and rec["late"] == [3] and rec["dropped"] == [1]
    assert rec["bytes_down"] == 40 and rec["total_bytes_down"] == 140 and rec["total_dropped"] == 2
    assert rec["total_late"] == 2 and rec["total_quarantined"] == 1 and rec["total_bytes_peer"] == 4
    assert rec["communicated_parameters_per_client"] == 15.0 and rec["optimised_parameters_per_client"] == 5.0
    assert rec["server_parameters"] == 99 and rec["train_loss"] is None


@pytest.fixture(scope="module")
def exp():
    cfg = validate(apply(RunConfig(), dict(dataset="digits", model="mlp", model_options={"widths": [8]}, clients=4,
                                            clients_per_round=4, rounds=1, local_epochs=1, plots=False,
                                            quorum=3)))
    e = experiment(cfg, fed=build_federation(cfg))
    e.state = e.algo.init_state()
    e.client_states = {c: e.algo.init_client_state(c) for c in range(4)}
    return e


def test_collect_runs_the_active_clients_and_screen_quarantines_a_non_finite_reply(exp):
    info = RoundInfo(index=0, total=1)
    ledger = RoundLedger([0, 1, 2, 3], dropped=[], active=[0, 1, 2, 3])
    got = exp._collect(info, {c: "ok" for c in range(4)}, {}, ledger, {})
    assert sorted(got.results) == [0, 1, 2, 3] and got.sent is got.payloads
    assert ledger.down == sum(p.nbytes for p in got.payloads.values()) > 0
    bad = got.results[2]
    got.results[2] = Message({k: torch.full_like(v, float("nan")) for k, v in bad.tensors.items()}, bad.meta,
                             bad.stats)
    results = exp._screen(info, got, ledger)
    assert sorted(results) == [0, 1, 3] and "non-finite" in ledger.quarantined["2"]
    assert ledger.honest_replies == 4 and ledger.honest_bad == 1
    exp._account(info, got.payloads, results, ledger)
    assert ledger.active == [0, 1, 3] and ledger.samples == sum(results[c].stats.samples for c in results)


def test_fuse_below_the_quorum_leaves_the_server_as_it_was_before_the_round(exp):
    info = RoundInfo(index=0, total=1)
    before = exp.state
    exp.state = {"moved": True}  # what an earlier stage of the round would have done
    ledger = RoundLedger([0, 1], dropped=[], active=[0, 1])
    assert exp._fuse(info, {0: _msg(1), 1: _msg(1)}, ledger, before) is False  # 2 replies < quorum 3
    assert exp.state is before and ledger.skipped
