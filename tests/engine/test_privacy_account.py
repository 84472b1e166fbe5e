"""The privacy account on its own: the rounds it spends, ε from the stored events, what a record and the summary
withhold from a reader of the outputs, and a checkpoint's account restored (also one written before events were
stored)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest

from fedfuse.config import ConfigError
from fedfuse.engine.local_dp import local_epsilon, sample_rate
from fedfuse.engine.privacy_account import DP_WITHHELD, NO_GUARANTEE, PrivacyAccount
from fedfuse.privacy.dp import DPSettings, events_epsilon, round_event
from fedfuse.types import FitStats, Message


def ctx(**dp) -> SimpleNamespace:
    return SimpleNamespace(dp=DPSettings(**dp), num_clients=20, clients_per_round=5,
                           train=SimpleNamespace(batch_size=10), client_sizes=np.array([40] * 10 + [25] * 10))


def test_central_rounds_compose_from_the_stored_events():
    acc = PrivacyAccount(ctx(mode="central", noise=1.0), "poisson", "fedavg")
    assert acc.record(None) == {"dp_epsilon": 0.0, "dp_delta": 1e-5}
    for _ in range(3):
        acc.spend_round()
    assert acc.events == [round_event(1.0, 20, 5, "poisson", "rdp")] * 3
    rec = acc.record({"clip": 0.5, "noise_std": 0.1})
    assert rec["dp_epsilon"] == pytest.approx(events_epsilon(acc.events, 1e-5)) and rec["dp_epsilon"] > 0
    assert rec["dp_clip"] == 0.5 and rec["dp_noise_std"] == 0.1


def test_no_noise_is_an_infinite_epsilon_reported_as_none(caplog):
    with caplog.at_level(logging.WARNING, logger="fedfuse"):
        acc = PrivacyAccount(ctx(mode="central", noise=0.0), "uniform", "fedavg")
    assert "dp_noise=0" in caplog.text and NO_GUARANTEE in caplog.text
    acc.spend_round()
    assert acc.record(None)["dp_epsilon"] is None
    assert acc.summary({"wall_seconds": 1.0})["dp_warning"].startswith(f"{NO_GUARANTEE}: dp_noise=0")


def test_without_dp_nothing_is_spent_or_withheld():
    acc = PrivacyAccount(ctx(), "uniform", "fedavg")
    acc.spend_round()
    acc.count_steps({0: (Message({}, {}, FitStats(steps=4)), None)})
    assert acc.events == [] and acc.local_steps == {}
    assert acc.record(None) == {} and acc.summary({"wall_seconds": 2.0}) == {}
    rec = {"clients": [1, 2], "train_loss": 0.3}
    assert acc.withhold(rec) is rec


def test_local_dp_counts_every_clients_steps():
    from support import needs_extra

    needs_extra("dp")  # local DP's ε is Opacus's RDP accountant
    acc = PrivacyAccount(ctx(mode="local", noise=1.1), "uniform", "fedavg")
    assert acc.record(None) == {"dp_epsilon": 0.0, "dp_delta": 1e-5}
    acc.count_steps({0: (Message({}, {}, FitStats(steps=4)), None), 15: (Message({}, {}, None), None)})
    acc.count_steps({0: (Message({}, {}, FitStats(steps=4)), None), 15: (Message({}, {}, FitStats(steps=3)), None)})
    assert acc.local_steps == {0: 8, 15: 3}  # a reply without stats (no local work) costs nothing
    rec = acc.record(None)
    e0 = local_epsilon(1.1, sample_rate(40, 10), 8, 1e-5)
    e15 = local_epsilon(1.1, sample_rate(25, 10), 3, 1e-5)
    assert rec["dp_epsilon"] == pytest.approx(max(e0, e15)) and rec["dp_clients"] == 2
    assert rec["dp_epsilon_median"] == pytest.approx((e0 + e15) / 2)


def test_the_reader_of_the_outputs_sees_no_client_entry():
    """A reader of metrics.jsonl/summary.json gets no id, count, loss or traffic of individual clients."""
    acc = PrivacyAccount(ctx(mode="central", noise=1.0), "poisson", "fedavg")
    rec = {k: 1 for k in DP_WITHHELD} | {"round": 3, "secagg_survivors": 4, "dp_epsilon": 0.2,
                                         "global_accuracy": 0.5}
    assert acc.withhold(rec) == {"round": 3, "dp_epsilon": 0.2, "global_accuracy": 0.5, "dp_guarantee": True}
    assert acc.summary({"wall_seconds": 7.5}) == {"dp_guarantee": True, "totals": {"wall_seconds": 7.5}}
    debug = PrivacyAccount(ctx(mode="central", noise=1.0, debug_metrics=True), "poisson", "fedavg")
    assert debug.withhold(dict(rec))["clients"] == 1 and debug.withhold(dict(rec))["dp_guarantee"] is False
    assert "totals" not in debug.summary({"wall_seconds": 7.5}) and \
        "dp_debug_metrics" in debug.summary({"wall_seconds": 7.5})["dp_warning"]
    research = PrivacyAccount(ctx(mode="central", noise=1.0, reproducible=True), "poisson", "fedavg")
    assert "dp_reproducible" in research.summary({"wall_seconds": 1.0})["dp_warning"]


def test_central_dp_refuses_a_sampling_it_cannot_account():
    with pytest.raises(ConfigError, match=r"^sampling: central DP .* 'fedmr' samples 'cyclic'"):
        PrivacyAccount(ctx(mode="central", noise=1.0), "cyclic", "fedmr")


def test_a_checkpoint_restores_the_account():
    acc = PrivacyAccount(ctx(mode="central", noise=1.0), "uniform", "fedavg")
    acc.spend_round()
    acc.local_steps = {3: 2}
    back = PrivacyAccount(ctx(mode="central", noise=1.0), "uniform", "fedavg")
    back.load_checkpoint(acc.state_dict())
    assert back.events == acc.events and back.local_steps == {3: 2}
    # a checkpoint written before the events were stored: one event per completed round, from its own config
    legacy = {"round": 2, "config": {"dp": "central", "dp_noise": 0.8, "clients_per_round": 4,
                                     "dp_accountant": "pld"}}
    back.load_checkpoint(legacy)
    assert back.events == [round_event(0.8, 20, 4, "uniform", "pld")] * 2
    back.load_checkpoint({"round": 2, "config": {"dp": "none"}})
    assert back.events == [] and math.isfinite(events_epsilon(back.events, 1e-5))
