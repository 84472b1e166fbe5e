"""The Hugging Face path: a tiny randomly initialised LLaMA-architecture model saved to disk, wrapped with
LoRA by peft, fine-tuned federatedly on instruction data (one client per task) with adapter-only traffic."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("peft", reason="needs the lora extra: pip install -e '.[lora]'")
transformers = pytest.importorskip("transformers", reason="needs the lora extra: pip install -e '.[lora]'")

from fedfuse.adapters.lora import LoraSpec, adapter_model  # noqa: E402
from fedfuse.adapters.text import CharTokenizer  # noqa: E402
from fedfuse.config import RunConfig, apply, validate  # noqa: E402
from fedfuse.data.instructions import instruction_federation  # noqa: E402
from fedfuse.runner import experiment  # noqa: E402

TOK = CharTokenizer()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg)
    d = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def flan(tmp_path_factory):
    root = tmp_path_factory.mktemp("flan")
    tasks = {"upper": str.upper, "reverse": lambda s: s[::-1]}
    words = ["king", "queen", "light", "night", "sword", "crown", "grace", "fool"]
    for name, fn in tasks.items():
        (root / name).mkdir()
        recs = [{"instruction": f"{name} this", "input": f"{words[i % 8]} {words[(i * 3) % 8]}",
                 "output": fn(f"{words[i % 8]} {words[(i * 3) % 8]}")} for i in range(16)]
        (root / name / "data.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    return root


def test_hf_llama_lora_federated_round(hf_dir, flan):
    base = f"hf:{hf_dir}"
    fed = instruction_federation(flan, TOK, train=10, test=4, max_len=200)
    assert fed.info["client_names"] == ["reverse", "upper"]
    cfg = validate(apply(RunConfig(), {
        "algorithm": "fedmerge-lora", "dataset": "shakespeare", "partition": "natural", "model": "transformer",
        "clients": 2, "clients_per_round": 2, "rounds": 2, "local_epochs": 1, "batch_size": 4, "lr": 0.01,
        "optimizer": "adam", "plots": False,
        "algorithm_options": {"base": base, "rank": 4, "d": 2, "merge_step": 0.5, "rouge_samples": 2,
                              "gen_tokens": 3}}))
    exp = experiment(cfg, fed=fed)
    summary = exp.run()
    am = adapter_model(base, LoraSpec(rank=4))
    assert isinstance(am.module.lm, transformers.LlamaForCausalLM)
    assert all("lora_" in k for k in am.keys) and len(am.keys) == 2 * 2 * 2  # q,v × A,B × 2 layers
    assert all(r["bytes_down"] == 2 * am.nbytes and r["bytes_up"] == 2 * am.nbytes for r in exp.history)
    assert exp.history[-1]["server_parameters"] == 2 * am.numel
    f = summary["final"]
    assert math.isfinite(f["personal_perplexity"]) and 0.0 <= f["personal_rouge1"] <= 1.0
    # the base stayed frozen: its weights equal the saved ones
    ref = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    live = {k.replace(".base_layer", ""): v for k, v in am.module.lm.state_dict().items() if "lora_" not in k}
    for k, v in ref.state_dict().items():
        assert torch.equal(live[k], v), k


def test_unknown_targets_say_what_exists(hf_dir):
    with pytest.raises(ValueError, match="q_proj"):
        adapter_model(f"hf:{hf_dir}", LoraSpec(rank=2, targets=("nope",)))
