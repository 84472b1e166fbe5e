"""FedSAM / FedASAM: the (A)SAM perturbation by hand (engine/sam.py), zero radius = plain training, the
trajectory change and the doubled FLOPs, determinism."""

import math

import pytest
import torch
from torch import nn

from fedfuse.algorithms.fedsam import train_sam
from fedfuse.engine.client import TrainConfig, train_local
from fedfuse.engine.sam import sam_perturbation
from fedfuse.models import build_model
from fedfuse.runner import experiment
from fedfuse.types import Split
from support import baseline_cfg as cfg_for
from support import check_same_seed_same_run


def test_sam_and_asam_perturbation_hand_case():
    w = nn.Parameter(torch.tensor([1.0, -2.0]))
    b = nn.Parameter(torch.tensor([0.5]))
    w.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.0])
    eps = sam_perturbation([("fc.weight", w), ("fc.bias", b)], rho=0.1)
    torch.testing.assert_close(eps[0], 0.1 * torch.tensor([3.0, 4.0]) / 5)
    eps = sam_perturbation([("fc.weight", w), ("fc.bias", b)], rho=0.1, adaptive=True, eta=0.0)
    # T = |w| = (1, 2): T g = (3, 8), ||T g|| = sqrt(73), eps = rho T^2 g / ||T g|| = rho (3, 16) / sqrt(73)
    torch.testing.assert_close(eps[0], 0.1 * torch.tensor([3.0, 16.0]) / math.sqrt(73))
    b.grad = torch.tensor([1.0])  # biases are not scaled by T
    eps = sam_perturbation([("fc.weight", w), ("fc.bias", b)], rho=1.0, adaptive=True, eta=0.0)
    n = math.sqrt(9 + 64 + 1)
    torch.testing.assert_close(eps[1], torch.tensor([1.0 / n]))


@pytest.mark.parametrize("adaptive", [False, True])
def test_sam_with_zero_radius_equals_plain_training_including_bn_stats(adaptive):
    torch.manual_seed(0)
    model = build_model("resnet9", (1, 8, 8), 10, width_mult=0.25)
    data = Split(torch.randn(40, 64), torch.randint(0, 10, (40,)))
    cfg = TrainConfig(local_epochs=2, batch_size=16, lr=0.05, momentum=0.9)
    a = {k: v.clone() for k, v in model.state_dict().items()}
    train_local(model, data, cfg, torch.Generator().manual_seed(1))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(a)
    train_sam(model, data, cfg, torch.Generator().manual_seed(1), rho=0.0, adaptive=adaptive)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, plain[k], rtol=0, atol=1e-6, msg=k)  # BN stats: one update per step


def test_sam_changes_the_trajectory_and_counts_double_flops():
    a = experiment(cfg_for(algorithm="fedavg", rounds=1))
    a.run()
    b = experiment(cfg_for(algorithm="fedasam", rounds=1), fed=a.fed)
    b.run()
    assert b.history[0]["client_flops"] == pytest.approx(2 * a.history[0]["client_flops"])
    assert any(not torch.equal(a.state["global"][k], b.state["global"][k]) for k in a.state["global"])


@pytest.mark.parametrize("algorithm", ["fedsam", "fedasam"])
def test_same_seed_same_metrics(algorithm):
    check_same_seed_same_run(cfg_for(algorithm=algorithm), "global_accuracy")
