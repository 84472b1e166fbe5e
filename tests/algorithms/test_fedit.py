"""FedIT, FedLoRA and Local-LoRA (algorithms/fedit.py): the size-weighted adapter average, fine-tuning only for
evaluation, no traffic for Local-LoRA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="needs the lora extra: pip install -e '.[lora]'")

from fedfuse.algorithms.base import RoundInfo
from support import lora_fake_results, lora_run, lora_tiny_base, lora_toy_federation


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return lora_tiny_base(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def fed():
    return lora_toy_federation()


def test_local_lora_sends_nothing(base, fed):
    exp, _ = lora_run(fed, "local-lora", base, rounds=1)
    assert exp.history[0]["bytes_down"] == 0 and exp.history[0]["bytes_up"] == 0


def test_fedit_averages_a_and_b_by_size(base, fed):
    exp, _ = lora_run(fed, "fedit", base, rounds=1)
    algo = exp.algo
    res = lora_fake_results(algo.am, [1, 3, 0])
    new = algo.aggregate_fit(exp.state, RoundInfo(0, 1), res)["adapter"]
    for k in algo.am.keys:
        assert torch.allclose(new[k], (res[0].tensors[k] + 3 * res[1].tensors[k]) / 4, atol=1e-6)


def test_fedlora_finetunes_only_for_evaluation(base, fed):
    it, s_it = lora_run(fed, "fedit", base, rounds=1)
    lo, s_lo = lora_run(fed, "fedlora", base, rounds=1, ft_epochs=2)
    for k, v in it.state["adapter"].items():
        assert torch.equal(v, lo.state["adapter"][k])  # same training, fine-tuning never reaches the server
    assert s_lo["final"]["personal_loss"] < s_it["final"]["personal_loss"]
