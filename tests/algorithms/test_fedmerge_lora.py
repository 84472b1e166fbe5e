"""FedMerge-LoRA and FedEM-LoRA (algorithms/fedmerge_lora.py): d = 1 is FedIT, the weighted merge and its logits,
the merge-preserving init, the FedEM router and its stacked program, determinism."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="needs the lora extra: pip install -e '.[lora]'")

from fedfuse.algorithms.base import RoundInfo
from fedfuse.config import RunConfig, apply, validate
from fedfuse.engine.loop import strip_timing
from fedfuse.runner import experiment
from fedfuse.types import Message
from support import lora_fake_results, lora_run, lora_tiny_base, lora_toy_federation


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return lora_tiny_base(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def fed():
    return lora_toy_federation()


def test_fedmerge_lora_one_global_adapter_is_fedit(base, fed):
    """d = 1: θ_i = Θ and Θ ← Θ + Σ_i (n_i/n) Δθ_i, i.e. the size-weighted average of the clients' adapters."""
    exp, _ = lora_run(fed, "fedmerge-lora", base, rounds=1, d=1, merge_step=0.3)
    algo = exp.algo
    theta = exp.state["globals"][0]
    after = lora_fake_results(algo.am, [2, 1, 1], seed=3)
    deltas = {c: Message({k: m.tensors[k] - theta[k] for k in theta}, m.meta, m.stats) for c, m in after.items()}
    new = algo.aggregate_fit(exp.state, RoundInfo(0, 1), deltas)
    for k in theta:
        want = (2 * after[0].tensors[k] + after[1].tensors[k] + after[2].tensors[k]) / 4
        assert torch.allclose(new["globals"][0][k], want, atol=1e-5)
    assert torch.allclose(algo.weights(new), torch.ones(3, 1, dtype=torch.float64))


def test_fedmerge_lora_sends_the_weighted_merge_and_moves_logits(base, fed):
    exp, summary = lora_run(fed, "fedmerge-lora", base, rounds=2, d=3, merge_step=0.5)
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
    a, _ = lora_run(fed, "fedmerge-lora", base, rounds=2, d=2, merge_step=0.5, seed=3)
    b, _ = lora_run(fed, "fedmerge-lora", base, rounds=2, d=2, merge_step=0.5, seed=3)
    assert [strip_timing(r) for r in a.history] == [strip_timing(r) for r in b.history]


def test_fedem_lora_router_is_a_distribution(base, fed):
    exp, _ = lora_run(fed, "fedem-lora", base, rounds=1, m=2)
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


def test_fedmerge_lora_merge_preserving_init(base, fed):
    """init_scale=merge: each A_j is the peft init × √d, so the uniform merge keeps a fresh LoRA's scale."""
    a, _ = lora_run(fed, "fedmerge-lora", base, rounds=1, d=4, merge_step=0.0)
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
