"""MSfusion: contrastive loss by hand, dynamic overlap, peer overlap aggregation on hand-built rings,
byte accounting, equivalence with FedAvg at mu = 1, determinism."""

import math

import pytest
import torch

from fedfuse.algorithms.msfusion import contrastive_loss, cyclic_lr, expected_overlap, neighbours
from fedfuse.config import RunConfig, apply
from fedfuse.engine.loop import strip_timing
from fedfuse.fusion.slicing import state_bytes
from fedfuse.runner import experiment


def cfg(**kw):
    base = dict(
        dataset="digits", partition="iid", model="mlp", clients=3, clients_per_round=3, rounds=2, eval_every=1,
        batch_size=64, local_epochs=1, lr=0.05, seed=1, plots=False, out=None, model_options={"widths": [8]},
        algorithm="msfusion", dataset_options={"train_limit": 300, "test_limit": 100},
    )
    opts = {"mu": 0.5, "lr_schedule": "constant"}
    opts.update(kw.pop("algorithm_options", {}))
    base.update(kw)
    base["algorithm_options"] = opts
    return apply(RunConfig(), base)


def test_contrastive_loss_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.5, -1.0]])
    za = torch.tensor([[0.5, 0.5], [1.0, 1.0]])
    zp = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    tau = 0.5
    hand = []
    for i in range(2):
        a = float(z[i] @ za[i]) / tau
        b = float(z[i] @ zp[i]) / tau
        hand.append(-math.log(math.exp(a) / (math.exp(a) + math.exp(b))))
    assert contrastive_loss(z, za, zp, tau, "dot").item() == pytest.approx(sum(hand) / 2, rel=1e-6)
    cos = torch.nn.functional.cosine_similarity
    a, b = cos(z, za, dim=-1) / tau, cos(z, zp, dim=-1) / tau
    hand_cos = (-torch.log(a.exp() / (a.exp() + b.exp()))).mean()
    assert contrastive_loss(z, za, zp, tau, "cosine").item() == pytest.approx(hand_cos.item(), rel=1e-6)
    # per-token representations (B, L, D) are flattened to tokens
    z3 = z.reshape(1, 2, 2)
    assert contrastive_loss(z3, za.reshape(1, 2, 2), zp.reshape(1, 2, 2), tau, "dot").item() == pytest.approx(
        sum(hand) / 2)


def test_cyclic_lr_and_dynamic_overlap():
    assert cyclic_lr(0, 100, 0.001, 0.0012) == pytest.approx(0.001)
    assert cyclic_lr(50, 100, 0.001, 0.0012) == pytest.approx(0.0012)
    assert cyclic_lr(75, 100, 0.001, 0.0012) == pytest.approx(0.0011)
    exp = experiment(cfg(algorithm_options={"schedule_rounds": 0}))  # Eq. 6's R = the run's rounds
    algo = exp.algo
    total = 100
    assert algo.overlap_control(0, total) == 1.0
    assert algo.overlap_control(9, total) == 1.0  # updated only when r mod 10 = 0
    assert algo.overlap_control(10, total) == pytest.approx(1 - 0.1 * 0.75)
    assert algo.overlap_control(99, total) == pytest.approx(1 - 0.9 * 0.75)
    # default: R = the paper's 500 rounds whatever the run's length; past R, c stays at c0·(1 − p)
    paper = experiment(cfg()).algo
    assert paper.overlap_control(10, 20) == pytest.approx(1 - (10 / 500) * 0.75)
    assert paper.overlap_control(19, 20) == pytest.approx(1 - (10 / 500) * 0.75)
    assert paper.overlap_control(250, 1000) == pytest.approx(1 - 0.5 * 0.75)
    assert paper.overlap_control(900, 1000) == pytest.approx(0.25)
    assert expected_overlap(0.5, 10, 1.0) == pytest.approx(0.8)
    assert neighbours(0, 4, "ring") == [1, 3] and neighbours(1, 3, "full") == [0, 2]


def hand_aggregate(algo, n, r, total, states, w0, nbrs):
    """Eq. 5 by explicit loops for an MLP with one hidden layer (K units): each element of n's round-r sub-model
    is the mean of the round-(r-1) trained values of {n} and its connected peers that held it."""
    sel = algo.selection(n, r, total)["hidden.0"].tolist()
    k = algo.spec.groups["hidden.0"]
    holders = [n, *nbrs]

    def val(s, key, unit):  # participant s's trained value of unit (row / column), or None
        ssel = states[s]["sel"]["hidden.0"].tolist()
        if unit not in ssel:
            return None
        t = states[s]["sub"][key]
        j = ssel.index(unit)
        return t[j] if key.startswith("hidden") else t[:, j]

    out = {}
    for key in ("hidden.0.weight", "hidden.0.bias", "fc.weight"):
        rows = []
        for unit in sel:
            vals = [v for s in holders if (v := val(s, key, unit)) is not None]
            if vals:
                rows.append(torch.stack(vals).mean(0))
            else:
                w = w0[key]
                rows.append(w[unit] if key.startswith("hidden") else w[:, unit])
        out[key] = torch.stack(rows, dim=0 if key.startswith("hidden") else 1)
    out["fc.bias"] = torch.stack([states[s]["sub"]["fc.bias"] for s in holders]).mean(0)
    assert k >= len(sel)
    return out


@pytest.mark.parametrize("num,topology,mu", [(3, "ring", 0.5), (4, "ring", 0.25), (4, "full", 0.25)])
def test_overlap_aggregation_matches_hand_average(num, topology, mu):
    exp = experiment(cfg(clients=num, clients_per_round=num, rounds=3,
                         algorithm_options={"mu": mu, "topology": topology, "contrastive": False}))
    exp._fresh()
    exp._round(0)
    algo = exp.algo
    states = {c: exp.client_states[c] for c in range(num)}
    payloads = algo.configure_fit(exp.state, type("I", (), {"index": 1, "total": 3})(), list(range(num)))
    for n in range(num):
        w_star, _, _, _ = algo.aggregate_local(n, 1, 3, states[n], payloads[n])
        hand = hand_aggregate(algo, n, 1, 3, states, algo.initial_state(), neighbours(n, num, topology))
        for key, v in hand.items():
            torch.testing.assert_close(w_star[key], v, rtol=1e-6, atol=1e-7)
        # a participant receives only from connected peers, and only elements inside its round-1 sub-model
        assert set(payloads[n].meta["senders"]) <= set(neighbours(n, num, topology))
        for k, t in payloads[n].tensors.items():
            assert t.numel() <= w_star[k.split("/", 2)[2]].numel()


def test_peer_bytes_counted_and_smaller_than_submodels():
    exp = experiment(cfg(clients=4, clients_per_round=4, rounds=3, model_options={"widths": [32, 32]},
                         algorithm_options={"mu": 0.5, "topology": "ring"}))
    exp.run()
    h = exp.history
    # round 1 sends for round 2; the last round sends nothing
    assert h[0]["bytes_peer"] > 0 and h[-1]["bytes_peer"] == 0
    # no server: the simulation's relay (sim/ tensors) is not communication, the peer exchange is all of it
    assert all(r["bytes_down"] == 0 and r["bytes_up"] == 0 for r in h)
    d = h[0]
    assert d["peer_bytes_per_participant"] == pytest.approx(d["bytes_peer"] / 4)
    # ring, mu = 0.5, N = 4: two neighbours share half of the hidden units each, plus the unsplit fc bias
    assert d["peer_bytes_per_participant"] < 2 * d["full_submodel_bytes_per_participant"]
    assert d["coverage"] == 1.0 and d["adjacent_overlap"] == pytest.approx(1 - 1 / (0.5 * 4))
    subs = exp.client_states[0]["sub"]
    assert d["full_submodel_bytes_per_participant"] == state_bytes(subs)


def test_mu_one_without_contrastive_is_uniform_fedavg():
    a = experiment(cfg(rounds=2, algorithm_options={"mu": 1.0, "contrastive": False}))
    a.run()
    fedavg = {**cfg(rounds=2).to_dict(), "algorithm": "fedavg", "algorithm_options": {"weighting": "uniform"}}
    b = experiment(apply(RunConfig(), fedavg))
    b.run()
    ga, gb = a.algo.global_model(a.state)[0], b.algo.global_model(b.state)[0]
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=1e-5, atol=1e-6)


def test_same_seed_identical_metrics():
    runs = []
    for _ in range(2):
        e = experiment(cfg(rounds=2, algorithm_options={"mu": 0.5, "mu_list": [0.5, 0.25, 0.5]}))
        e.run()
        runs.append([strip_timing(r) for r in e.history])
    assert runs[0] == runs[1]
    assert runs[0][-1]["global_accuracy"] is not None


def test_peer_messages_of_different_sizes_are_not_quarantined():
    """Each peer gets the overlap of two windows, so different senders send the same-named tensor
    ``sim/peer/{m}/…`` with different shapes (here ζ = 2: 2, 2 and 6 rows).  The engine's reply check
    used to outvote the minority and quarantine valid updates (MNIST, ζ = 10: 91 of 200 replies)."""
    exp = experiment(cfg(clients=4, clients_per_round=4, rounds=3, model_options={"widths": [16]},
                         algorithm_options={"mu": 0.5, "zeta": 2}))
    exp.run()
    sizes = {tuple(v.shape) for c in range(4) for k, v in exp.algo.publish(
        c, 0, 3, exp.client_states[c]["sub"], exp.client_states[c]["sel"], exp.client_states[c])[0].items()
        if k.startswith("sim/peer/") and k.endswith("hidden.0.weight")}
    assert len(sizes) > 1  # the setting really sends different shapes under one name
    assert all(r["total_quarantined"] == 0 for r in exp.history)
    assert all(not r["quarantined"] for r in exp.history)


def test_heterogeneous_mu_sub_models_are_not_quarantined():
    """With μ_n = 0.5, 0.25, 0.5 two participants' sub-models share a shape and the third's is smaller; the
    engine's majority vote used to quarantine the μ = 0.25 participant every round.  Its shapes are now checked
    against its own selection, and a really wrong shape is still caught."""
    opts = {"mu": 0.5, "mu_list": [0.5, 0.25, 0.5]}
    exp = experiment(cfg(rounds=2, model_options={"widths": [8]}, algorithm_options=opts))
    exp.run()
    assert all(not r["quarantined"] for r in exp.history)
    bad = experiment(cfg(rounds=2, model_options={"widths": [8]}, algorithm_options=opts, corrupt="shape",
                         corrupt_clients=[1]))
    bad.run()
    assert all("1" in r["quarantined"] and "selection gives" in r["quarantined"]["1"] for r in bad.history)


@pytest.mark.parametrize("similarity", ["cosine", "dot"])
def test_masked_padded_contrastive_equals_the_common_units_form(similarity):
    """The declared term gathers the common units at padded positions and zeroes the padding: per sample it
    equals Eq. 7 on the common units alone."""
    from fedfuse.algorithms.msfusion import _padded

    g = torch.Generator().manual_seed(0)
    z, za, zp = (torch.randn(5, 6, generator=g) for _ in range(3))
    pc, pp = torch.tensor([4, 1, 5]), torch.tensor([0, 3, 2])
    ref = contrastive_loss(z[:, pc], za[:, pc], zp[:, pp], 0.5, similarity, reduction="none")
    cur, old, m = _padded(pc, 6), _padded(pp, 6), _padded(torch.ones(3), 6)
    got = contrastive_loss(z[:, cur] * m, za[:, cur] * m, zp[:, old] * m, 0.5, similarity, reduction="none")
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert contrastive_loss(z[:, pc], za[:, pc], zp[:, pp], 0.5, similarity).item() == pytest.approx(
        ref.mean().item(), rel=1e-6)


@pytest.mark.parametrize("model,extra", [
    ("mlp", {"model_options": {"widths": [8, 8]}}),
    ("resnet18", {"model_options": {"width_mult": 0.0625, "norm": "bn-static"}, "dataset_options": {
        "train_limit": 120, "test_limit": 40}}),
])
def test_batched_equals_sequential_with_the_contrastive_term(model, extra):
    """MSfusion's declared program (peer-assembled sub-models, the contrastive term on two frozen models'
    features) runs vmapped without fallback and gives the sequential run; the term is active (rounds 2-3)
    and matters (λ = 0 gives another run)."""
    runs = {}
    for executor, lam in (("sequential", 1.0), ("batched", 1.0), ("sequential", 0.0)):
        exp = experiment(cfg(model=model, rounds=3, executor=executor, **extra,
                             algorithm_options={"mu": 0.5, "lam": lam, "dynamic": False}))
        exp.run()
        runs[executor, lam] = exp
    assert runs["batched", 1.0].executor.fallbacks == {}
    seq, bat = runs["sequential", 1.0].history, runs["batched", 1.0].history
    for a, b in zip(seq, bat, strict=True):
        a, b = strip_timing(a), strip_timing(b)
        assert a["client_flops"] == b["client_flops"] and a["bytes_peer"] == b["bytes_peer"]
        assert a["contrastive_skipped"] == b["contrastive_skipped"] == 0
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    assert seq[0]["client_flops"] < seq[1]["client_flops"]  # frozen models' forward passes from round 2 on
    g_seq, g_bat = (runs[k].state["global"] for k in (("sequential", 1.0), ("batched", 1.0)))
    for k, v in g_seq.items():
        if v.is_floating_point():
            torch.testing.assert_close(g_bat[k], v, rtol=1e-3, atol=1e-4, msg=k)
    no_con = runs["sequential", 0.0].history
    assert no_con[0]["train_loss"] == seq[0]["train_loss"]  # round 1 has no term
    assert no_con[2]["train_loss"] != seq[2]["train_loss"]


def test_holder_churn_counts_units_changing_hands():
    """Equal μ, c = 1, N = 4, K = 40 (gap G = 10): each window gains ζ units and drops ζ.  Windows of 15 (not a
    multiple of G): no unit is both gained and dropped, 2·N·ζ units change holders; windows of 10 or 20
    (multiples of G): the unit one window drops is the one another gains, N·ζ.  Frozen windows: 0; Eq. 6
    moves windows although ζ = 0.  Round 1 has no previous round: 0."""
    def churn(mu, **opts):
        exp = experiment(cfg(clients=4, clients_per_round=4, rounds=3, model_options={"widths": [40]},
                             algorithm_options={"mu": mu, "contrastive": False, **opts}))
        exp.run()
        return [h["holder_churn"] for h in exp.history]

    assert churn(0.375, zeta=1, dynamic=False) == [0.0, pytest.approx(2 * 4 / 40), pytest.approx(2 * 4 / 40)]
    assert churn(0.375, zeta=3, dynamic=False)[1:] == [pytest.approx(2 * 4 * 3 / 40)] * 2
    assert churn(0.25, zeta=1, dynamic=False)[1:] == [pytest.approx(4 / 40)] * 2
    assert churn(0.5, zeta=1, dynamic=False)[1:] == [pytest.approx(4 / 40)] * 2
    assert churn(0.5, zeta=0, dynamic=False) == [0.0, 0.0, 0.0]
    moved = churn(0.5, zeta=0, dynamic=True, update_every=1, schedule_rounds=2)  # c: 1 → 0.625 → 0.25
    assert moved[0] == 0.0 and moved[1] > 0.0 and moved[2] > 0.0
