"""FedMerge: the merge, the simplex, FedAvg as d = 1, the logit update against autograd (Eq. 5–6 / App. D),
the fixed-magnitude step, the Fixed(k/d) ablation, BN/int/missing-key handling, diagnostics and outputs."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.func import functional_call

from fedfuse.algorithms.base import RoundInfo
from fedfuse.config import RunConfig, apply
from fedfuse.engine.client import task_loss, train_flops_per_sample
from fedfuse.engine.loop import strip_timing
from fedfuse.fusion.merge import (
    cluster_ari,
    column_normalised,
    fixed_magnitude_step,
    merge_states,
    row_softmax,
    select_keys,
    update_globals,
)
from fedfuse.rng import torch_generator
from fedfuse.runner import experiment

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"



def cfg_for(tmp_path, **kw) -> RunConfig:
    base = dict(
        dataset="digits", partition="label-cluster", model="mlp", clients=6, clients_per_round=3, rounds=2,
        batch_size=32, lr=0.1, local_epochs=1, seed=5, out=None, plots=False, algorithm="fedmerge",
        model_options={"widths": [16]}, partition_options={"clusters": 3},
    )
    base.update(kw)
    if base["model"] != "mlp" and "model_options" not in kw:
        base["model_options"] = {}
    return apply(RunConfig(), base)


def _bn_state(seed: int, batches: int) -> dict:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Flatten(),
                              torch.nn.Linear(8, 3))
    net.train()
    for _ in range(batches):
        net(torch.randn(4, 1, 4, 4) * (seed + 1))
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


# ---- pure operators --------------------------------------------------------------------------------------


def test_merge_states_every_entry_including_bn_buffers():
    gs = [_bn_state(s, s + 1) for s in range(3)]
    w = [0.2, 0.5, 0.3]
    m = merge_states(gs, w)
    assert set(m) == set(gs[0])
    for k, v in m.items():
        if k.endswith("num_batches_tracked"):
            assert v.dtype == torch.long and int(v) == 3  # max over models with weight > 0
        else:
            torch.testing.assert_close(v, sum(wj * g[k] for wj, g in zip(w, gs)), rtol=0, atol=1e-6)
    assert int(merge_states(gs, [0.5, 0.5, 0.0])["1.num_batches_tracked"]) == 2  # zero weight: ignored


def test_update_globals_hand_case_bn_int_and_missing_keys():
    g = [{"w": torch.tensor([1.0]), "rm": torch.tensor([0.0]), "n": torch.tensor(5)},
         {"w": torch.tensor([3.0]), "rm": torch.tensor([1.0]), "n": torch.tensor(7)}]
    d1 = {"w": torch.tensor([2.0]), "rm": torch.tensor([4.0]), "n": torch.tensor(2)}
    d2 = {"w": torch.tensor([-1.0]), "n": torch.tensor(3)}  # client 2 did not send "rm"
    coef = torch.tensor([[0.25, 0.0], [0.5, 0.5]], dtype=torch.float64)
    out = update_globals(g, [d1, d2], coef, lr=1.0)
    assert float(out[0]["w"]) == 1.0 + 0.25 * 2 - 0.5 and float(out[1]["w"]) == 3.0 - 0.5
    assert float(out[0]["rm"]) == 1.0 and float(out[1]["rm"]) == 1.0  # missing = zero delta; d1 has c=0 for Θ_2
    assert int(out[0]["n"]) == 5 + 3 and int(out[1]["n"]) == 7 + 3  # max over touching clients
    assert out[0]["n"].dtype == torch.long
    # normalised (column) form: a missing key is averaged over the senders only
    outn = update_globals(g, [d1, d2], coef, normalised=True)
    assert float(outn[0]["rm"]) == 0.0 + 4.0  # only client 1 sent rm for Θ_1: its delta in full
    torch.testing.assert_close(outn[0]["w"], torch.tensor([1.0 + (0.25 * 2 - 0.5) / 0.75]))
    with pytest.raises(ValueError):
        update_globals(g, [{"zzz": torch.tensor([1.0])}], coef[:1])


def test_column_normalised_and_fixed_step_hand_cases():
    w = torch.tensor([[0.5, 0.5], [0.25, 0.75]], dtype=torch.float64)
    c = column_normalised(w, torch.tensor([10.0, 20.0]))
    torch.testing.assert_close(c, torch.tensor([[5 / 10, 5 / 20], [5 / 10, 15 / 20]], dtype=torch.float64))
    a = torch.zeros(2, 3, dtype=torch.float64)
    G = torch.tensor([[1.0, -4.0, 2.0], [0.5, 0.0, 3.0]], dtype=torch.float64)
    a2 = fixed_magnitude_step(a, G, 0.01)
    assert float((a2 - a).abs().max()) == pytest.approx(0.01, abs=1e-15)
    torch.testing.assert_close(a2, 0.01 * G / 4.0)
    assert torch.equal(fixed_magnitude_step(a, torch.zeros_like(G), 0.01), a)


def test_select_keys():
    from fedfuse.models import build_model

    m = build_model("mlp", (64,), 10, widths=[8, 8])
    assert select_keys(m, "head") == ["fc.weight", "fc.bias"]
    assert select_keys(m, "all") == [k for k, _ in m.named_parameters()]
    assert select_keys(m, "last-2")[-2:] == ["fc.weight", "fc.bias"] and len(select_keys(m, "last-2")) == 4
    with pytest.raises(ValueError):
        select_keys(m, "middle")


def test_cluster_ari():
    rows = np.array([[0.9, 0.1], [0.8, 0.2], [0.1, 0.9], [0.2, 0.8]])
    assert cluster_ari(rows, [0, 0, 1, 1]) == 1.0
    assert cluster_ari(np.full((4, 2), 0.5), [0, 0, 1, 1]) == 0.0


# ---- the algorithm ---------------------------------------------------------------------------------------


def test_dispatched_model_is_the_merge_on_every_state_entry(tmp_path):
    exp = experiment(cfg_for(tmp_path, model="resnet9", clients=4, algorithm_options={"d": 3}))
    algo = exp.algo
    state = algo.init_state()
    state["logits"] = torch.randn(4, 3, dtype=torch.float64)
    # give the global models distinct BN statistics and counters
    for j, g in enumerate(state["globals"]):
        for k in g:
            if "running" in k:
                g[k] = torch.rand_like(g[k]) + j
            elif k.endswith("num_batches_tracked"):
                g[k] = torch.tensor(10 * (j + 1))
    assert any("running_var" in k for k in state["globals"][0])
    w = row_softmax(state["logits"])
    assert torch.allclose(w.sum(1), torch.ones(4, dtype=torch.float64)) and bool((w >= 0).all())
    msgs = algo.configure_fit(state, RoundInfo(0, 1), [0, 2, 3])
    for c, msg in msgs.items():
        assert set(msg.tensors) == set(state["globals"][0])
        for k, v in msg.tensors.items():
            if v.is_floating_point():
                expected = sum(float(w[c, j]) * state["globals"][j][k].double() for j in range(3)).float()
                torch.testing.assert_close(v, expected, rtol=1e-6, atol=1e-6)
            else:
                assert int(v) == 30
    # the message is one model: bytes = one full state
    one = sum(t.numel() * t.element_size() for t in state["globals"][0].values())
    assert msgs[0].nbytes == one


def test_weight_rows_stay_on_simplex_and_fixed_step_is_exact(tmp_path):
    exp = experiment(cfg_for(tmp_path, rounds=3, algorithm_options={"d": 4, "merge_step": 0.05, "init": "independent"}))
    exp.state = exp.algo.init_state()
    exp.client_states = {c: None for c in range(6)}
    for r in range(3):
        before = exp.state["logits"].clone()
        exp._round(r)
        after = exp.state["logits"]
        assert float((after - before).abs().max()) == pytest.approx(0.05, abs=1e-12)
        w = row_softmax(after)
        torch.testing.assert_close(w.sum(1), torch.ones(6, dtype=torch.float64))
        assert bool((w >= 0).all())
    rec = exp.history[-1] if exp.history else exp.evaluate(2)
    assert "ari" in rec and "merge_entropy" in rec


def test_d1_all_clients_reproduces_fedavg(tmp_path):
    kw = dict(model="resnet9", clients=4, clients_per_round=4, rounds=2, partition="dirichlet",
              partition_options={"alpha": 1.0, "min_size": 20})
    fa = experiment(cfg_for(tmp_path, algorithm="fedavg", **kw))
    fm = experiment(cfg_for(tmp_path, algorithm="fedmerge", algorithm_options={"d": 1}, **kw), fed=fa.fed)
    # the FLOP counter runs one train-mode forward on its first (uncached) call, which moves BN buffers:
    # warm its cache so neither run's first client is affected (engine issue reported to the lead)
    x0 = fa.fed.clients[0].train
    train_flops_per_sample(fa.ctx.build(), x0.x, x0.y, key=(fa.ctx.model_name,))
    fa.state = fa.algo.init_state()
    fm.state = fm.algo.init_state()
    fm.state["globals"] = [{k: v.clone() for k, v in fa.state["global"].items()}]
    for e in (fa, fm):
        e.client_states = {c: None for c in range(4)}
    for r in range(2):
        fa._round(r)
        fm._round(r)
        for k, v in fa.state["global"].items():
            got = fm.state["globals"][0][k]
            if v.is_floating_point():
                torch.testing.assert_close(got, v, rtol=1e-5, atol=1e-5)  # float32 vs float64 rounding
            else:
                assert torch.equal(got, v), k  # num_batches_tracked: FedAvg's max policy
    assert any(k.endswith("num_batches_tracked") for k in fa.state["global"])


@pytest.mark.parametrize("merge_params", ["head", "last-2", "all"])
def test_logit_and_theta_update_equal_autograd_for_one_sgd_step(tmp_path, merge_params):
    lr = 0.1
    exp = experiment(cfg_for(tmp_path, clients=3, clients_per_round=3, batch_size=100000, lr=lr,
                             model_options={"widths": [8, 8]},
                             algorithm_options={"d": 3, "merge_params": merge_params, "merge_update": "gradient",
                                                "merge_step": 1.0, "theta_lr": 1.0, "theta_update": "paper",
                                                "init": "independent"}))
    algo, fed = exp.algo, exp.fed
    state = algo.init_state()
    state["logits"] = torch.randn(3, 3, dtype=torch.float64)
    clients = [0, 1, 2]
    payloads = algo.configure_fit(state, RoundInfo(0, 1), clients)
    results = {c: algo.fit(payloads[c], None, fed.clients[c], torch_generator(0, c))[0] for c in clients}
    new = algo.aggregate_fit(state, RoundInfo(0, 1), results)
    G = new["logits"] - state["logits"]  # = merge_step · g

    # autograd through the merge: L = Σ_i (n_i/n) ℓ_i(θ_i(a, Θ)), only `keys` depend on (a, Θ)
    model = exp.ctx.model()
    keys = set(select_keys(model, merge_params))
    a = state["logits"].clone().float().requires_grad_(True)
    Th = [{k: v.clone().requires_grad_(k in keys) for k, v in g.items()} for g in state["globals"]]
    n = torch.tensor([float(len(fed.clients[c].train)) for c in clients])
    loss = 0.0
    for i, c in enumerate(clients):
        w = torch.softmax(a[i], 0)
        params = {k: (sum(w[j] * Th[j][k] for j in range(3)) if k in keys else payloads[c].tensors[k])
                  for k in payloads[c].tensors}
        out = functional_call(model, params, (fed.clients[c].train.x,))
        loss = loss + n[i] / n.sum() * task_loss(out, fed.clients[c].train.y)
    ga, *gth = torch.autograd.grad(loss, [a] + [Th[j][k] for j in range(3) for k in sorted(keys)])
    torch.testing.assert_close(G.float(), -lr * ga, rtol=2e-3, atol=1e-7)
    assert float(G.abs().max()) > 0
    # Θ update (Eq. 5/8 with η_Θ = 1): ΔΘ_j = −lr ∂L/∂Θ_j on the merged keys
    it = iter(gth)
    for j in range(3):
        for k in sorted(keys):
            torch.testing.assert_close(new["globals"][j][k] - state["globals"][j][k], -lr * next(it),
                                       rtol=2e-3, atol=1e-7)


def test_fixed_k_ablation_is_frozen_uniform(tmp_path):
    exp = experiment(cfg_for(tmp_path, rounds=2, algorithm_options={"d": 5, "fixed_k": 2}))
    exp.state = exp.algo.init_state()
    exp.client_states = {c: None for c in range(6)}
    w0 = row_softmax(exp.state["logits"])
    assert ((w0 > 0).sum(1) == 2).all() and torch.allclose(w0[w0 > 0], torch.tensor(0.5, dtype=torch.float64))
    exp._round(0)
    exp._round(1)
    assert torch.equal(row_softmax(exp.state["logits"]), w0)


def test_code_options_run_and_change_the_update(tmp_path):
    base = experiment(cfg_for(tmp_path, algorithm_options={"d": 3}))
    outs = []
    for opts in ({"d": 3}, {"d": 3, "theta_update": "column_normalised", "weights_first": True, "prox_mu": 0.01}):
        e = experiment(cfg_for(tmp_path, algorithm_options=opts), fed=base.fed)
        e.run()
        outs.append(e.state["globals"][0]["fc.weight"])
    assert not torch.allclose(outs[0], outs[1])


def test_same_seed_identical_metrics_and_outputs(tmp_path):
    a = experiment(cfg_for(tmp_path, rounds=2, out=str(tmp_path / "a"), algorithm_options={"heatmap_every": 1}))
    a.run()
    b = experiment(cfg_for(tmp_path, rounds=2, out=str(tmp_path / "b"), algorithm_options={"heatmap_every": 1}))
    b.run()
    assert [strip_timing(h) for h in a.history] == [strip_timing(h) for h in b.history]
    out = tmp_path / "a"
    for name in ("merge_weights_r0001.png", "merge_weights_r0002.png", "merge_weights_final.png",
                 "merge_weights.json"):
        assert (out / name).exists(), name
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("ari" in r for r in recs)
    s = json.loads((out / "summary.json").read_text())
    assert "ari" in s["final"] and "ari" in s["best"]
    assert s["final"]["server_parameters"] == 5 * sum(p.numel() for p in a.ctx.model().parameters())


@pytest.mark.skipif(not (DATA / "mnist").exists(), reason="shared MNIST data not available")
def test_cli_fedmerge_mnist_label_cluster(tmp_path):
    from fedfuse.cli import main

    out = tmp_path / "run"
    rc = main(["run", "--algorithm", "fedmerge", "--dataset", "mnist", "--data-dir", str(DATA),
               "--partition", "label-cluster", "--clients", "6", "--clients-per-round", "3", "--rounds", "2",
               "--model", "mlp", "--set", "model_options.widths=[16]", "--set", "clusters=3",
               "--set", "train_limit=1200", "--set", "test_limit=600", "--set", "d=3", "--set", "heatmap_every=1",
               "--set", "plots=false", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert (out / "merge_weights_final.png").exists() and (out / "merge_weights_r0002.png").exists()
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["ari"] is not None
    assert "ari" in json.loads((out / "summary.json").read_text())["final"]


# ---- defaults that reproduce (regressions of the 1/d step and the independent-init collapse) -----------------


def test_paper_update_is_one_dth_of_fedavg_step_and_column_form_is_fedavg_sized():
    """Cause 1: at uniform weights Eq. 8 moves every Θ_j by Σ_i (n_i/n)(1/d)Δθ_i, 1/d of FedAvg's step; the
    code's column-normalised form moves it by the n-weighted average Δθ (FedAvg's step)."""
    from fedfuse.fusion.merge import paper_coefficients

    d, sizes = 4, torch.tensor([10.0, 30.0], dtype=torch.float64)
    g = [{"w": torch.zeros(2)} for _ in range(d)]
    deltas = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 2.0])}]
    w = torch.full((2, d), 1.0 / d, dtype=torch.float64)
    fedavg = torch.tensor([0.25, 1.5])  # (10·Δ1 + 30·Δ2) / 40
    paper = update_globals(g, deltas, paper_coefficients(w, sizes / sizes.sum()))
    col = update_globals(g, deltas, column_normalised(w, sizes), normalised=True)
    for j in range(d):
        torch.testing.assert_close(paper[j]["w"], fedavg / d)
        torch.testing.assert_close(col[j]["w"], fedavg)


def test_shared_init_copies_one_model_and_breaks_symmetry_with_logits(tmp_path):
    exp = experiment(cfg_for(tmp_path, algorithm_options={"d": 3, "init": "shared"}))
    st = exp.algo.init_state()
    for g in st["globals"][1:]:
        for k, v in g.items():
            assert torch.equal(v, st["globals"][0][k])
    assert float(st["logits"].std()) > 0  # symmetry broken by random initial logits (auto std 0.1)
    assert abs(float(st["logits"].std()) - 0.1) < 0.06
    ind = experiment(cfg_for(tmp_path, algorithm_options={"d": 3})).algo.init_state()  # default: independent
    assert not torch.equal(ind["globals"][0]["fc.weight"], ind["globals"][1]["fc.weight"])
    assert float(ind["logits"].abs().max()) == 0.0  # papers: uniform initial weights
    with pytest.raises(ValueError, match="symmetry"):
        experiment(cfg_for(tmp_path, algorithm_options={"d": 3, "init": "shared", "logit_init_std": 0.0}))


def test_independent_init_merge_is_nearly_input_independent_shared_is_not(tmp_path):
    """Cause 2: the average of d independently initialised MLPs has ~1/√d smaller weights per layer, so its
    output hardly depends on the input; a shared initialisation's merge is a normal network."""
    exp = experiment(cfg_for(tmp_path, model_options={"widths": [64, 64]}, algorithm_options={"d": 10}))
    x = exp.fed.clients[0].train.x[:200]
    spread = {}
    for init in ("shared", "independent"):
        algo = experiment(cfg_for(tmp_path, model_options={"widths": [64, 64]},
                                  algorithm_options={"d": 10, "init": init}), fed=exp.fed).algo
        st = algo.init_state()
        model = algo.ctx.load(merge_states(st["globals"], [0.1] * 10))
        with torch.no_grad():
            out = model(x)
        spread[init] = float(out.std(0).mean() / out.abs().mean())
    assert spread["independent"] < 0.5 * spread["shared"]


def test_auto_merge_step_spreads_the_code_travel_over_a_clients_samplings(tmp_path):
    exp = experiment(cfg_for(tmp_path, clients=6, clients_per_round=3, algorithm_options={"d": 2}))
    # 6 clients, 3 per round: a client is sampled R/2 times; travel 5 → step 10/R
    assert exp.algo.merge_step(20) == pytest.approx(5.0 / 10)
    assert exp.algo.merge_step(2) == pytest.approx(5.0)  # at most the whole travel in one step
    fixed = experiment(cfg_for(tmp_path, algorithm_options={"d": 2, "merge_step": 0.01})).algo
    assert fixed.merge_step(500) == 0.01  # the code's value when given


def _digits_cluster(algo: str, opts: dict, seed: int) -> float:
    cfg = apply(RunConfig(), dict(
        dataset="digits", partition="label-cluster", model="mlp", clients=10, clients_per_round=5, rounds=12,
        batch_size=32, lr=0.1, local_epochs=1, seed=seed, out=None, plots=False, algorithm=algo, eval_every=12,
        model_options={"widths": [32]}, partition_options={"clusters": 5}, algorithm_options=opts))
    return experiment(cfg, progress=False).run()["final"]["personal_accuracy"]


def test_defaults_beat_fedavg_on_a_cluster_split_and_old_defaults_did_not():
    """Regression (digits, 5 clusters × 2 classes, 10 clients, 12 rounds): the shipped defaults personalise; the
    previous defaults (paper Θ step, independent init, the code's 0.01 logit step) stayed below FedAvg."""
    old = {"d": 5, "merge_step": 0.01, "init": "independent", "theta_update": "paper"}
    for seed in (0, 1):
        fedavg = _digits_cluster("fedavg", {}, seed)
        assert _digits_cluster("fedmerge", {"d": 5}, seed) > fedavg + 0.15
        assert _digits_cluster("fedmerge", old, seed) < fedavg
