"""MSfusion's split and peer aggregation stay valid for every (participants, μ, c schedule, rounds, topology):
a hypothesis sweep of the participant-side protocol with synthetic training, checked against an explicit
element-by-element reference; plus the regression cases found in use (empty contrastive overlap after a
jump of c, untrained elements reverting to W⁰, the learning-rate owner)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedfuse.algorithms import ALGORITHMS
from fedfuse.algorithms.base import RoundInfo, RunContext
from fedfuse.algorithms.msfusion import MSfusion, contrastive_loss, neighbours
from fedfuse.config import RunConfig, apply
from fedfuse.engine.client import TrainConfig, cyclic_lr, scheduled_lr
from fedfuse.fusion.slicing import split_size, write_back
from fedfuse.runner import experiment
from fedfuse.types import Message

GROUP = "hidden.0"


def make_algo(num: int, k: int, **opts) -> MSfusion:
    ctx = RunContext(
        model_name="mlp", model_options={"widths": [k]}, input_shape=(3,), num_classes=2, task="classification",
        train=TrainConfig(), num_clients=num, clients_per_round=num, client_sizes=np.ones(num), seed=3,
        device=torch.device("cpu"),
    )
    return MSfusion(ctx, MSfusion.Options(**opts))


def full_view(algo: MSfusion, sub: dict, sel: dict) -> tuple[dict, dict]:
    """A sub-model's values written into full-size tensors, and masks of the elements it holds."""
    zeros = {k: torch.zeros_like(v) for k, v in algo.initial_state().items()}
    ones = {k: torch.ones_like(v) for k, v in sub.items()}
    vals = write_back(zeros, sub, algo.spec, sel)
    mask = write_back({k: torch.zeros_like(v, dtype=torch.bool) for k, v in zeros.items()},
                      {k: v.bool() for k, v in ones.items()}, algo.spec, sel)
    return vals, mask


def simulate(algo: MSfusion, total: int, seed: int = 0) -> dict:
    """Run the participant-side protocol for ``total`` rounds with synthetic 'training' (w* + noise) and check
    every aggregated element against an explicit reference.  Returns what was observed."""
    num = algo.ctx.num_clients
    gen = torch.Generator().manual_seed(seed)
    w0 = algo.initial_state()
    states: dict[int, dict | None] = {n: None for n in range(num)}
    ref_known = {n: {k: v.clone() for k, v in w0.items()} for n in range(num)}  # last value n trained
    prev_trained: dict[int, tuple[dict, dict]] = {}  # n -> (full values, held mask) of round r-1
    held_ever = {GROUP: torch.zeros(algo.spec.groups[GROUP], dtype=torch.bool)}
    skipped = 0
    mail_state: dict = {"mailbox": {}}
    for r in range(total):
        results = {}
        sels = {}
        for n in range(num):
            mailbox = algo.configure_fit(mail_state, RoundInfo(r, total), [n])[n]
            w_star, sel, _, _ = algo.aggregate_local(n, r, total, states[n], mailbox)
            sels[n] = sel
            k = algo.spec.groups[GROUP]
            idx = sel[GROUP]
            # the split: ⌊μK⌋ distinct units inside [0, K)
            assert idx.numel() == split_size(k, algo.mu_of(n)) == len(set(idx.tolist()))
            assert int(idx.min()) >= 0 and int(idx.max()) < k
            held_ever[GROUP][idx] = True
            # Eq. 5 element by element: mean over {n} ∪ connected peers that held it in r-1, else n's last value
            got, mask = full_view(algo, w_star, sel)
            holders = [n, *neighbours(n, num, algo.opt.topology)] if r else []
            for key in w0:
                if not w0[key].is_floating_point():
                    continue
                tot = torch.zeros_like(w0[key], dtype=torch.float64)
                cnt = torch.zeros_like(w0[key], dtype=torch.float64)
                for h in holders:
                    vals, hm = prev_trained[h]
                    tot += torch.where(hm[key], vals[key].double(), 0.0)
                    cnt += hm[key].double()
                want = torch.where(cnt > 0, tot / cnt.clamp_min(1), ref_known[n][key].double())
                torch.testing.assert_close(got[key][mask[key]].double(), want[mask[key]], rtol=1e-5, atol=1e-6)
            # the contrastive term is defined for every pair of windows (empty overlap: skipped, no crash)
            if states[n] is not None:
                pc, pp = algo.common_positions(sel, states[n]["sel"])
                z = torch.randn(2, idx.numel())
                zp = torch.randn(2, states[n]["sel"][GROUP].numel())
                loss = contrastive_loss(z[..., pc], z[..., pc], zp[..., pp])
                assert math.isfinite(float(loss))
                skipped += int(pc.numel() == 0)
            # synthetic local training: move every element
            new = {key: (v + torch.randn(v.shape, generator=gen) if v.is_floating_point() else v + 1)
                   for key, v in w_star.items()}
            tensors, _, states[n] = algo.publish(n, r, total, new, sel, states[n])
            results[n] = Message(tensors, {"sel": {g: v.tolist() for g, v in sel.items()}})
            vals, hm = full_view(algo, new, sel)
            for key in w0:
                ref_known[n][key] = torch.where(hm[key], vals[key], ref_known[n][key])
            # the participant's memory is exactly its latest trained value of every element (W⁰ if never)
            for key in w0:
                torch.testing.assert_close(states[n]["known"][key], ref_known[n][key])
        prev_trained = {n: full_view(algo, states[n]["sub"], states[n]["sel"]) for n in range(num)}
        routed, _ = algo.exchange(RoundInfo(r, total), results)
        mail_state = {"mailbox": {c: {k[9:]: v for k, v in m.tensors.items() if k.startswith("sim/mail/")}
                                  for c, m in routed.items()}}
    return {"held_ever": held_ever, "skipped": skipped}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num=st.integers(1, 5),
    k=st.integers(2, 9),
    mu=st.sampled_from([0.1, 0.125, 0.25, 0.4, 0.5, 0.75, 1.0]),
    c0=st.floats(0.2, 2.0),
    p=st.floats(0.0, 0.95),
    update_every=st.integers(1, 4),
    total=st.integers(1, 7),
    topology=st.sampled_from(["full", "ring"]),
    zeta=st.integers(0, 2),
    hetero=st.booleans(),
    horizon=st.sampled_from([0, 3, 500]),
)
def test_protocol_valid_for_every_setting(num, k, mu, c0, p, update_every, total, topology, zeta, hetero, horizon):
    opts = dict(mu=mu, c0=c0, p=p, update_every=update_every, topology=topology, zeta=zeta, schedule_rounds=horizon)
    if hetero:
        opts["mu_list"] = [mu, min(1.0, 2 * mu), 0.5]
    algo = make_algo(num, k, **opts)
    seen = simulate(algo, total)
    # coverage over time: participant 0's window starts at r·ζ, so with ζ = 1 every unit is trained within K rounds
    if zeta == 1 and total >= k:
        assert bool(seen["held_ever"][GROUP].all())


def test_coverage_over_rounds_and_every_unit_trained():
    algo = make_algo(4, 8, mu=0.25, c0=1.0, p=0.75, update_every=2, schedule_rounds=0)
    seen = simulate(algo, 8)
    assert bool(seen["held_ever"][GROUP].all())


def test_c_jump_empties_contrastive_overlap_without_crash():
    """Regression: when Eq. 6 lowers c the window of a high-index participant jumps past its previous one; the
    representation overlap is then empty (it used to raise 'cannot reshape tensor of 0 elements')."""
    algo = make_algo(4, 16, mu=0.25, update_every=2, schedule_rounds=0)  # Eq. 6 compressed into the 4 rounds
    prev, cur = algo.selection(3, 1, 4), algo.selection(3, 2, 4)
    assert not set(prev[GROUP].tolist()) & set(cur[GROUP].tolist())  # the crash case
    pc, pp = algo.common_positions(cur, prev)
    assert pc.numel() == 0 and pp.numel() == 0
    z = torch.randn(5, 4, requires_grad=True)
    loss = contrastive_loss(z[..., pc], z[..., pc].detach(), z[..., pp].detach())
    loss.backward()  # a zero term that keeps the graph
    assert float(loss.detach()) == 0.0 and z.grad is not None and float(z.grad.abs().sum()) == 0.0
    # the whole run with the contrastive term on (digits, the same split and c schedule)
    cfg = apply(RunConfig(), dict(
        dataset="digits", partition="iid", model="mlp", clients=4, clients_per_round=4, rounds=4, batch_size=64,
        local_epochs=1, lr=0.05, seed=1, plots=False, out=None, model_options={"widths": [16]}, algorithm="msfusion",
        dataset_options={"train_limit": 200, "test_limit": 50},
        algorithm_options={"mu": 0.25, "update_every": 2, "schedule_rounds": 0, "lr_schedule": "constant"}))
    exp = experiment(cfg, progress=False)
    exp.run()
    assert sum(h.get("contrastive_skipped", 0) for h in exp.history) > 0
    assert all(math.isfinite(h["train_loss"]) for h in exp.history if h.get("train_loss") is not None)


def test_untouched_elements_keep_last_trained_value_not_w0():
    """Regression: an element that no connected peer held last round takes the participant's own latest trained
    value (it used to revert to the initial model W⁰)."""
    algo = make_algo(2, 8, mu=0.25, dynamic=False, topology="ring", zeta=3)
    w0 = algo.initial_state()
    total = 6
    # participant 0 holds units r·3 mod 8 .. +1; round 0: {0,1}, round 3: {1,2} (9 mod 8 = 1)
    sel0 = algo.selection(0, 0, total)
    trained = {k: (v + 5.0 if v.is_floating_point() else v) for k, v in algo.initial_state().items()}
    from fedfuse.fusion.slicing import slice_state

    sub = slice_state(trained, algo.spec, sel0)
    _, _, state = algo.publish(0, 0, total, sub, sel0, None)
    sel3 = algo.selection(0, 3, total)
    assert 1 in sel0[GROUP].tolist() and 1 in sel3[GROUP].tolist()
    # round 3 with an empty mailbox and the round-0 state as its memory (no peer held unit 1 in round 2)
    state = {**state, "sel": algo.selection(0, 2, total),
             "sub": slice_state(state["known"], algo.spec, algo.selection(0, 2, total))}
    w_star, sel, fallback, _ = algo.aggregate_local(0, 3, total, state, Message({}, {"senders": []}))
    pos = sel[GROUP].tolist().index(1)
    torch.testing.assert_close(w_star["hidden.0.weight"][pos], trained["hidden.0.weight"][1])
    assert not torch.allclose(w_star["hidden.0.weight"][pos], w0["hidden.0.weight"][1])
    assert fallback > 0


def test_learning_rate_has_one_owner():
    """A schedule never replaces the run's --lr: the cyclic schedule peaks at it; constant returns it."""
    assert scheduled_lr(0.07, 0, 10) == 0.07
    assert scheduled_lr(0.07, 5, 10, "cyclic") == pytest.approx(0.07)  # peak mid-training = --lr
    assert scheduled_lr(0.07, 0, 10, "cyclic", 0.5) == pytest.approx(0.035)
    assert max(scheduled_lr(0.3, r, 7, "cyclic", 1 / 1.2) for r in range(7)) <= 0.3
    assert cyclic_lr(50, 100, 0.001, 0.0012) == pytest.approx(0.0012)
    with pytest.raises(ValueError, match="schedule"):
        scheduled_lr(0.1, 0, 10, "cosine")
    with pytest.raises(ValueError, match="lr_min_ratio"):
        scheduled_lr(0.1, 0, 10, "cyclic", 1.5)
    # the rule holds for every registered algorithm: no option sets an absolute *local* learning rate
    forbidden = {"lr", "lr_min", "lr_max", "local_lr", "client_lr"}
    for name, cls in ALGORITHMS.items():
        assert not forbidden & set(cls.option_defaults()), f"{name} has an option that overrides --lr"
    # a user's --lr reaches the clients through the schedule
    for algo in ("msfusion", "heterofl", "fedrolex"):
        cfg = apply(RunConfig(), dict(
            dataset="digits", partition="iid", model="mlp", clients=2, clients_per_round=2, rounds=2, lr=0.0421,
            seed=0, plots=False, out=None, model_options={"widths": [8]}, algorithm=algo, local_epochs=1,
            dataset_options={"train_limit": 100, "test_limit": 40}, algorithm_options={"mu": 0.5}))
        exp = experiment(cfg, progress=False)
        seen: list[float] = []
        fit = exp.algo.fit

        def spy(payload, cs, data, gen, fit=fit, seen=seen):
            out = fit(payload, cs, data, gen)
            if "lr" in out[0].meta:
                seen.append(out[0].meta["lr"])
            return out

        exp.algo.fit = spy
        exp.run()
        assert seen and max(seen) == pytest.approx(0.0421) and min(seen) >= 0.0421 / 1.2 - 1e-12


def test_default_similarity_is_cosine():
    assert MSfusion.Options().similarity == "cosine"
    z = torch.randn(4, 3)
    assert contrastive_loss(z, z, -z).item() == pytest.approx(contrastive_loss(z, z, -z, similarity="cosine").item())
