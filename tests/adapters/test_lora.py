"""LoRA adapters (adapters/lora.py): adapter-only tensors and traffic, the cross-term gap, the shared model cache,
determinism, and the text data loaders."""

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
from fedfuse.data.lm_clients import encode_pairs, windows
from support import SHARED_DATA, lora_run, lora_tiny_base, lora_toy_federation

TOK = CharTokenizer()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return lora_tiny_base(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def fed():
    return lora_toy_federation()


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
    exp, summary = lora_run(fed, algo, base, rounds=1, **opts)
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


def test_the_first_run_in_a_process_equals_later_runs(base, fed):
    """The shared adapted model is built lazily, possibly inside a client's seeded step (local-lora builds it
    in ``fit``); building it must not move the global RNG that the step's LoRA dropout draws from."""
    from fedfuse.adapters.lora import clear_cache

    clear_cache()
    first, _ = lora_run(fed, "local-lora", base, rounds=1, seed=4, lora_dropout=0.5)
    later, _ = lora_run(fed, "local-lora", base, rounds=1, seed=4, lora_dropout=0.5)
    assert first.history[0]["train_loss"] == later.history[0]["train_loss"]


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
