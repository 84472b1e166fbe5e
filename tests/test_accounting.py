"""FLOP counting and byte accounting against hand-computed values."""

import torch

from fedfuse.engine.client import train_flops_per_sample
from fedfuse.models import build_model
from fedfuse.types import Message, tensor_bytes


def test_mlp_training_flops_hand_computed():
    m = build_model("mlp", (64,), 10, widths=[32])
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    fwd = 2 * (64 * 32 + 32 * 10)
    # backward: weight gradients of both layers + input gradient of the second layer only
    bwd = 2 * (64 * 32 + 32 * 10) + 2 * 32 * 10
    assert train_flops_per_sample(m, x, y, key=("t1",)) == fwd + bwd


def test_lstm_flops_include_the_recurrent_kernels():
    m = build_model("lstm", (80,), 81, task="classification", embed_dim=8, hidden=16, num_layers=2)
    x, y = torch.randint(0, 81, (4, 80)), torch.randint(0, 81, (4,))
    per_token = 2 * 4 * (8 * 16 + 16 * 16) + 2 * 4 * (16 * 16 + 16 * 16)
    f = train_flops_per_sample(m, x, y, key=("t2",))
    assert f >= 3 * per_token * 80  # recurrent part (3x forward for training) ...
    assert f < 3 * per_token * 80 + 3 * 2 * 16 * 81 + 1  # ... plus the linear head


def test_message_bytes_follow_dtype_and_numel():
    msg = Message({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float16), "n": torch.tensor(1)})
    assert msg.nbytes == 3 * 4 * 4 + 5 * 2 + 8 == tensor_bytes(msg.tensors)


def test_flop_counting_leaves_the_model_untouched():
    m = build_model("resnet9", (3, 8, 8), 10)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    train_flops_per_sample(m, torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)), key=("t3",))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in m.parameters())


def test_simulation_bookkeeping_tensors_are_not_counted():
    msg = Message({"w": torch.zeros(10), "sim/own/w": torch.zeros(1000)})
    assert msg.nbytes == 40
