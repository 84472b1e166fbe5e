"""LoRA adapters as federated state: adapter-only traffic, fusion math, determinism, data loaders."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("peft", reason="needs the lora extra: pip install -e '.[lora]'")

from fedfuse.adapters.evaluate import IGNORE, rouge_rows
from fedfuse.adapters.lora import LoraSpec, adapter_model, cross_term_gap, delta_weights, module_pairs
from fedfuse.adapters.text import CharTokenizer
from fedfuse.algorithms.base import RoundInfo
from fedfuse.config import RunConfig, apply, validate
from fedfuse.data.lm_clients import encode_pairs, make_federation, windows
from fedfuse.engine.loop import strip_timing
from fedfuse.models.transformer import TransformerModel
from fedfuse.runner import experiment
from fedfuse.types import FitStats, Message
from support import SHARED_DATA

TOK = CharTokenizer()
TEXTS = [
    "the king is dead, long live the king. " * 12,
    "what light through yonder window breaks? " * 12,
    "to be or not to be, that is the question. " * 12,
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    torch.manual_seed(0)
    kw = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "dropout": 0.0, "norm_first": True, "max_len": 64}
    m = TransformerModel(len(TOK), len(TOK), task="lm", **kw)
    path = tmp_path_factory.mktemp("base") / "tiny.pt"
    torch.save({"kind": "fedfuse-lm", "model": kw, "vocab": TOK.vocab, "state": m.state_dict(), "info": {}}, path)
    return f"fedfuse:{path}"


@pytest.fixture(scope="module")
def fed():
    rows = []
    for i, t in enumerate(TEXTS):
        ids = TOK.encode(t)
        n = len(ids)
        rows.append((f"role{i}", windows(ids[: n // 2], 16), windows(ids[n // 2 : 3 * n // 4], 16),
                     windows(ids[3 * n // 4 :], 16)))
    return make_federation(rows, len(TOK), dataset="toy", partition="role")


def run(fed, algo: str, base: str, rounds: int = 2, seed: int = 0, **opts):
    cfg = validate(apply(RunConfig(), {
        "algorithm": algo, "dataset": "shakespeare", "partition": "natural", "model": "transformer",
        "clients": fed.num_clients, "clients_per_round": fed.num_clients, "rounds": rounds, "local_epochs": 1,
        "batch_size": 4, "lr": 0.01, "optimizer": "adam", "seed": seed, "plots": False,
        "algorithm_options": {"base": base, "rank": 2, "rouge_samples": 2, "gen_tokens": 4, **opts}}))
    exp = experiment(cfg, fed=fed)
    summary = exp.run()
    return exp, summary


def test_adapter_is_only_lora_tensors_and_starts_as_identity(base, fed):
    am = adapter_model(base, LoraSpec(rank=2, targets=("q_proj", "v_proj")))
    assert am.keys and all(".lora_A." in k or ".lora_B." in k for k in am.keys)
    assert all(not p.requires_grad for n, p in am.module.named_parameters() if "lora_" not in n)
    assert len(module_pairs(am.keys)) == 2  # q_proj and v_proj of the one block
    x = fed.clients[0].test.x[:2]
    am.module.eval()
    am.load(am.init_adapter(1))
    out1 = am(x)
    adapter = am.init_adapter(2)
    assert all(torch.all(v == 0) for k, v in adapter.items() if ".lora_B." in k)  # B = 0 → ΔW = 0
    am.load(adapter)
    assert torch.allclose(am(x), out1)
    with pytest.raises(KeyError):
        am.load({k: v for k, v in list(adapter.items())[1:]})


@pytest.mark.parametrize("algo,opts,factor", [("fedit", {}, 1), ("fedmerge-lora", {"d": 3, "merge_step": 0.5}, 3),
                                              ("fedem-lora", {"m": 2}, 2)])
def test_bytes_per_round_equal_adapter_size(base, fed, algo, opts, factor):
    exp, summary = run(fed, algo, base, rounds=1, **opts)
    am = adapter_model(base, LoraSpec(rank=2))
    rec = exp.history[0]
    per_client = factor if algo == "fedem-lora" else 1  # FedEM sends all M adapters; FedMerge one merged one
    assert rec["bytes_down"] == fed.num_clients * per_client * am.nbytes
    assert rec["bytes_up"] == fed.num_clients * per_client * am.nbytes
    assert rec["server_parameters"] == factor * am.numel
    assert rec["optimised_parameters_per_client"] == per_client * am.numel
    assert rec["client_flops"] > 0
    assert math.isfinite(summary["final"]["personal_perplexity"])
    assert 0.0 <= summary["final"]["personal_rouge1"] <= 1.0


def test_local_lora_sends_nothing(base, fed):
    exp, _ = run(fed, "local-lora", base, rounds=1)
    assert exp.history[0]["bytes_down"] == 0 and exp.history[0]["bytes_up"] == 0


def _fake_results(am, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {c: Message({k: torch.randn(v.shape, generator=g) for k, v in am.adapter().items()},
                       stats=FitStats(num_examples=n)) for c, n in enumerate(sizes)}


def test_fedit_averages_a_and_b_by_size(base, fed):
    exp, _ = run(fed, "fedit", base, rounds=1)
    algo = exp.algo
    res = _fake_results(algo.am, [1, 3, 0])
    new = algo.aggregate_fit(exp.state, RoundInfo(0, 1), res)["adapter"]
    for k in algo.am.keys:
        assert torch.allclose(new[k], (res[0].tensors[k] + 3 * res[1].tensors[k]) / 4, atol=1e-6)


def test_fedmerge_lora_one_global_adapter_is_fedit(base, fed):
    """d = 1: θ_i = Θ and Θ ← Θ + Σ_i (n_i/n) Δθ_i, i.e. the size-weighted average of the clients' adapters."""
    exp, _ = run(fed, "fedmerge-lora", base, rounds=1, d=1, merge_step=0.3)
    algo = exp.algo
    theta = exp.state["globals"][0]
    after = _fake_results(algo.am, [2, 1, 1], seed=3)
    deltas = {c: Message({k: m.tensors[k] - theta[k] for k in theta}, m.meta, m.stats) for c, m in after.items()}
    new = algo.aggregate_fit(exp.state, RoundInfo(0, 1), deltas)
    for k in theta:
        want = (2 * after[0].tensors[k] + after[1].tensors[k] + after[2].tensors[k]) / 4
        assert torch.allclose(new["globals"][0][k], want, atol=1e-5)
    assert torch.allclose(algo.weights(new), torch.ones(3, 1, dtype=torch.float64))


def test_fedmerge_lora_sends_the_weighted_merge_and_moves_logits(base, fed):
    exp, summary = run(fed, "fedmerge-lora", base, rounds=2, d=3, merge_step=0.5)
    algo, state = exp.algo, exp.state
    w = algo.weights(state)
    assert torch.allclose(w.sum(1), torch.ones(3, dtype=torch.float64))
    assert float((w - 1 / 3).abs().max()) > 1e-3  # the merging weights learned something
    msg = algo.configure_fit(state, None, [1])[1]
    for k, v in msg.tensors.items():
        want = sum(float(w[1, j]) * g[k].double() for j, g in enumerate(state["globals"]))
        assert torch.allclose(v.double(), want, atol=1e-6)
    assert "merge_weights" in summary["final"] or "merge_entropy" in summary["final"]


def test_same_seed_same_metrics(base, fed):
    a, _ = run(fed, "fedmerge-lora", base, rounds=2, d=2, merge_step=0.5, seed=3)
    b, _ = run(fed, "fedmerge-lora", base, rounds=2, d=2, merge_step=0.5, seed=3)
    assert [strip_timing(r) for r in a.history] == [strip_timing(r) for r in b.history]


def test_the_first_run_in_a_process_equals_later_runs(base, fed):
    """The shared adapted model is built lazily, possibly inside a client's seeded step (local-lora builds it
    in ``fit``); building it must not move the global RNG that the step's LoRA dropout draws from."""
    from fedfuse.adapters.lora import clear_cache

    clear_cache()
    first, _ = run(fed, "local-lora", base, rounds=1, seed=4, lora_dropout=0.5)
    later, _ = run(fed, "local-lora", base, rounds=1, seed=4, lora_dropout=0.5)
    assert first.history[0]["train_loss"] == later.history[0]["train_loss"]


def test_fedlora_finetunes_only_for_evaluation(base, fed):
    it, s_it = run(fed, "fedit", base, rounds=1)
    lo, s_lo = run(fed, "fedlora", base, rounds=1, ft_epochs=2)
    for k, v in it.state["adapter"].items():
        assert torch.equal(v, lo.state["adapter"][k])  # same training, fine-tuning never reaches the server
    assert s_lo["final"]["personal_loss"] < s_it["final"]["personal_loss"]


def test_fedem_lora_router_is_a_distribution(base, fed):
    exp, _ = run(fed, "fedem-lora", base, rounds=1, m=2)
    for c in range(fed.num_clients):
        pi = exp.client_states[c]["pi"]
        assert pi.shape == (2,) and abs(float(pi.sum()) - 1) < 1e-9


def test_fedem_lora_stack_program_equals_training_each_adapter_alone(base, fed):
    """FedEM-LoRA's declared program (M adapters as one stack on Σ_m q_m ℓ_m) equals the separate loop, which
    trains adapter after adapter on the same batch order with its q-weighted loss (forced here by a gradient
    clip too large to act). Without dropout the two are the same computation up to float rounding."""
    def go(clip: float):
        cfg = validate(apply(RunConfig(), {
            "algorithm": "fedem-lora", "dataset": "shakespeare", "partition": "natural", "model": "transformer",
            "clients": fed.num_clients, "clients_per_round": fed.num_clients, "rounds": 2, "local_epochs": 2,
            "batch_size": 4, "lr": 0.01, "optimizer": "adam", "seed": 3, "plots": False, "grad_clip": clip,
            "algorithm_options": {"base": base, "rank": 2, "m": 3, "lora_dropout": 0.0, "rouge_samples": 0}}))
        exp = experiment(cfg, fed=fed)
        exp.run()
        return exp

    stacked, loop = go(0.0), go(1e9)
    assert stacked.algo.client_program(stacked.algo.configure_fit(stacked.state, RoundInfo(0, 1), [0])[0],
                                       None, fed.clients[0]) is not None
    assert loop.algo.client_program(loop.algo.configure_fit(loop.state, RoundInfo(0, 1), [0])[0],
                                    None, fed.clients[0]) is None
    for a, b in zip(stacked.state["adapters"], loop.state["adapters"], strict=True):
        for k in a:
            assert torch.allclose(a[k], b[k], atol=1e-6, rtol=1e-5), k
    for c in range(fed.num_clients):
        assert torch.allclose(stacked.client_states[c]["pi"], loop.client_states[c]["pi"], atol=1e-9)
    for ha, hb in zip(stacked.history, loop.history, strict=True):
        for k in ("samples", "client_flops", "optimised_parameters_per_client", "bytes_up"):
            assert ha.get(k) == hb.get(k), k
        assert ha["train_loss"] == pytest.approx(hb["train_loss"], rel=1e-6)
        assert ha["personal_perplexity"] == pytest.approx(hb["personal_perplexity"], rel=1e-6)


def test_lm_mixture_objective_hand_case():
    from fedfuse.fusion.mixture import mixture_objective as lm_mixture_objective

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4, 5)  # B=2 rows, M=3 adapters, T=4 tokens, V=5
    y = torch.tensor([[1, 2, IGNORE, 0], [IGNORE, IGNORE, IGNORE, 4]])
    q = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    got = lm_mixture_objective(logits, torch.cat([y.float(), q], dim=1))
    for b in range(2):
        counted = [t for t in range(4) if y[b, t] != IGNORE]
        want = sum(float(q[b, m]) * sum(-torch.log_softmax(logits[b, m, t], -1)[y[b, t]] for t in counted)
                   / len(counted) for m in range(3))
        assert float(got[b]) == pytest.approx(float(want), rel=1e-6)


def test_cross_term_gap_hand_case():
    A1, A2 = torch.eye(2), torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    B1, B2 = torch.eye(2), 2 * torch.eye(2)
    ad = [{"m.lora_A.default.weight": A1, "m.lora_B.default.weight": B1},
          {"m.lora_A.default.weight": A2, "m.lora_B.default.weight": B2}]
    # (½B1+½B2)(½A1+½A2) = 0.75 (A1 + A2);  ½B1A1 + ½B2A2 = ½A1 + A2
    sep, exact = 0.75 * (A1 + A2), 0.5 * A1 + A2
    want = float(torch.linalg.norm(sep - exact) / torch.linalg.norm(exact))
    assert cross_term_gap(ad, [0.5, 0.5]) == pytest.approx(want)
    assert cross_term_gap([ad[0], ad[0]], [0.3, 0.7]) == pytest.approx(0.0, abs=1e-12)
    assert torch.allclose(delta_weights(ad[1], 2.0)["m"], 4 * A2.double())


def test_encode_pairs_masks_prompt_and_padding():
    s = encode_pairs([([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10])], max_len=6, pad_id=0)
    assert s.x.tolist() == [[1, 2, 3, 4, 0, 0], [6, 7, 8, 9, 0, 0]]
    assert s.y.tolist() == [[IGNORE, IGNORE, 4, 5, IGNORE, IGNORE], [IGNORE, 8, 9, 10, IGNORE, IGNORE]]
    rows = rouge_rows(s, prompt_len=2, limit=5)
    assert rows == [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10])]
    plain = windows(list(range(20)), 8)
    assert rouge_rows(plain, prompt_len=3, limit=1) == [([0, 1, 2], [3, 4, 5, 6, 7, 8])]


def test_instruction_loader_formats(tmp_path):
    from fedfuse.data.instructions import instruction_federation, to_pair

    alpaca = [{"instruction": f"say {i}", "input": "" if i % 2 else "ctx", "output": f"ok {i}"} for i in range(12)]
    flan = tmp_path / "flan"
    for task in ("para", "nli"):
        (flan / task).mkdir(parents=True)
        with open(flan / task / "train.jsonl", "w") as f:
            for i in range(10):
                f.write(json.dumps({"inputs": f"{task} q{i}", "targets": f"a{i}"}) + "\n")
        (flan / task / "test.json").write_text(json.dumps([{"inputs": f"{task} t", "targets": "b"}] * 4))
    fed = instruction_federation(flan, TOK, train=8, test=3, max_len=32)
    assert fed.info["client_names"] == ["nli", "para"]
    assert [len(c.train) + len(c.val) for c in fed.clients] == [8, 8] and len(fed.clients[0].test) == 3
    one = tmp_path / "roles.json"
    one.write_text(json.dumps([{**r, "role": "a" if i < 6 else "b"} for i, r in enumerate(alpaca)]))
    fed2 = instruction_federation(one, TOK, test=2, max_len=200)
    assert fed2.info["client_names"] == ["a", "b"]
    p, a = to_pair(alpaca[0])
    assert "### Instruction:\nsay 0" in p and "### Input:\nctx" in p and a == "ok 0"
    y = fed2.clients[0].train.y[0]
    assert (y[:5] == IGNORE).all() and (y != IGNORE).any()


def test_shakespeare_roles_split():
    from fedfuse.data.lm_clients import shakespeare_roles

    roots = [SHARED_DATA, Path(os.environ.get("FEDFUSE_DATA", "-"))]
    root = next((r for r in roots if (r / "shakespeare-leaf").is_dir()), None)
    if root is None:
        pytest.skip("LEAF Shakespeare raw roles not available")
    fed = shakespeare_roles(TOK, root, clients=6, seq_len=32, max_chars=2000)
    assert fed.num_clients == 6 and fed.task == "lm"
    assert len(set(fed.info["client_names"])) == 6
    assert len(set(fed.info["plays"])) == 5  # round-robin over the 5 plays first
    assert all(len(c.train) and len(c.test) for c in fed.clients)
    assert np.array_equal(fed.clients[0].train.x[0, 1:].numpy(), fed.clients[0].train.y[0, :-1].numpy())


def test_fedmerge_lora_merge_preserving_init(base, fed):
    """init_scale=merge: each A_j is the peft init × √d, so the uniform merge keeps a fresh LoRA's scale."""
    a, _ = run(fed, "fedmerge-lora", base, rounds=1, d=4, merge_step=0.0)
    algo = a.algo
    peft_init = algo.init_state()["globals"]
    algo.opt.init_scale = "merge"
    scaled = algo.init_state()["globals"]
    for p, s in zip(peft_init, scaled):
        for k in p:
            assert torch.allclose(s[k], p[k] * (2.0 if ".lora_A." in k else 1.0))
    k = next(k for k in peft_init[0] if ".lora_A." in k)
    merged = sum(g[k] for g in scaled) / 4
    single = algo.am.init_adapter(123)[k]
    assert 0.6 < float(merged.std() / single.std()) < 1.6
