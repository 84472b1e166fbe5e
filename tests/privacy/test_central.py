"""Central DP as a mechanism (:mod:`fedfuse.privacy.central`): every algorithm whose server update is a mean of
client deltas wears it without DP code of its own — FedAvg, FedProx, the server optimisers of FedAvgM and FedAdam,
and SCAFFOLD's model and control-variate means.

Two invariants per algorithm, on the same fabricated replies:

* with no noise (z = 0), a clip no update reaches and m = the number of replies, the mechanism's mean is the uniform
  mean, so the DP run's server update equals the algorithm's own non-private update with uniform weights (the
  mechanism feeds the algorithm's server step, it does not replace it);
* with noise, the released update differs from that by Gaussian noise of the std the mechanism reports.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedfuse.config import RunConfig, apply
from fedfuse.engine.context import RoundInfo
from fedfuse.privacy.central import CentralDP
from fedfuse.privacy.dp import DPSettings
from fedfuse.runner import experiment
from fedfuse.types import Message

M = 4
ALGORITHMS = {"fedavg": {}, "fedprox": {"mu": 0.1}, "fedavgm": {}, "fedadam": {"tau": 1e-3}, "scaffold": {}}


def _algo(name: str, **kw):
    opts = {**ALGORITHMS[name], "weighting": "uniform"}
    cfg = apply(RunConfig(), dict(dataset="digits", partition="iid", model="mlp", clients=8, clients_per_round=M,
                                  rounds=1, seed=5, out=None, plots=False, model_options={"widths": [8]},
                                  algorithm=name, algorithm_options=opts, **kw))
    return experiment(cfg).algo


def _replies(algo, state) -> dict[int, Message]:
    """M replies: the global model moved by a fixed random delta (and, for SCAFFOLD, a Δc of its own)."""
    out = {}
    for c in range(M):
        g = torch.Generator().manual_seed(100 + c)
        tensors = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state["global"].items()}
        if "c" in state:
            tensors.update({f"dc/{k}": 0.1 * torch.randn(v.shape, generator=g) for k, v in state["c"].items()})
        out[c] = Message(tensors, {}, None)
    return out


def _flat(state, keys) -> torch.Tensor:
    return torch.cat([state[k].double().reshape(-1) for k in keys])


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_without_noise_the_mechanism_feeds_the_algorithm_s_own_server_step(name: str) -> None:
    plain = _algo(name)
    private = _algo(name, dp="central", dp_noise=0.0, dp_clip=1e6)
    state = plain.init_state()
    info = RoundInfo(index=0, total=1)
    want = plain.aggregate_fit(state, info, _replies(plain, state))
    got = private.aggregate_fit(state, info, _replies(private, state))
    for k, v in want["global"].items():
        assert torch.allclose(got["global"][k].double(), v.double(), atol=1e-6), k
    if "c" in state:  # SCAFFOLD's control variate: c + Σ Δc_i / N either way
        for k, v in want["c"].items():
            assert torch.allclose(got["c"][k].double(), v.double(), atol=1e-6), k
    assert got["dp"]["noise_std"] == 0.0 and got["dp"]["clip_used"] == 1e6


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "scaffold"])
def test_with_noise_the_release_carries_the_mechanism_s_noise(name: str) -> None:
    z, clip = 2.0, 1e6  # nothing clipped: the difference to the plain update is the noise alone
    plain = _algo(name)
    private = _algo(name, dp="central", dp_noise=z, dp_clip=clip)
    state = plain.init_state()
    info = RoundInfo(index=0, total=1)
    want = plain.aggregate_fit(state, info, _replies(plain, state))
    got = private.aggregate_fit(state, info, _replies(private, state))
    keys = sorted(k for k, v in state["global"].items() if v.is_floating_point())
    noise = _flat(got["global"], keys) - _flat(want["global"], keys)
    std = got["dp"]["noise_std"]
    assert std == pytest.approx(z * clip / M)
    assert float(noise.std()) == pytest.approx(std, rel=5 / math.sqrt(2 * noise.numel()))
    if "c" in state:  # c's update carries the same noise sum, over N instead of m
        ckeys = sorted(state["c"])
        cnoise = _flat(got["c"], ckeys) - _flat(want["c"], ckeys)
        assert float(cnoise.std()) == pytest.approx(std * M / 8, rel=5 / math.sqrt(2 * cnoise.numel()))


def test_an_algorithm_s_extra_release_shares_the_clip() -> None:
    """SCAFFOLD's (y_i − x, Δc_i) is one vector to the mechanism: a reply whose Δc alone is huge is clipped whole."""
    mech = CentralDP(DPSettings(mode="central", noise=0.0, clip=1.0), per_round=1, seed=0)
    base = {"w": torch.zeros(3), "dc/w": torch.zeros(3)}
    reply = {"w": torch.tensor([0.1, 0.0, 0.0]), "dc/w": torch.tensor([0.0, 100.0, 0.0])}
    out, rec = mech.mean({}, base, [reply], 0)
    norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in out.values()))
    assert norm == pytest.approx(1.0) and rec["clipped"] == 1
    empty, _ = mech.mean({}, base, [], 0)  # nobody replied: the release is the base (plus noise, here none)
    assert all(torch.equal(empty[k], base[k]) for k in base)
