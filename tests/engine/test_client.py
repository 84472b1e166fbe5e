"""FLOP counting and byte accounting against hand-computed values."""

import dataclasses

import pytest
import torch

from fedfuse.engine.client import train_flops_per_sample
from fedfuse.models import build_model
from fedfuse.types import FitStats, Message, tensor_bytes


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


def test_local_work_is_a_typed_record_not_metadata():
    stats = FitStats(num_examples=4, samples=8, steps=2, train_loss=0.5, flops=10.0, trained_params=3)
    msg = Message({"w": torch.zeros(2)}, {"slot": 1}, stats)
    assert msg.num_examples == 4 and Message().num_examples == 0
    moved = msg.to("cpu")
    assert moved.stats == stats and moved.stats is not stats  # a copy travels, not a shared record
    for name in ("num_examples", "flops", "trained_params"):
        with pytest.raises(ValueError, match="FitStats"):
            Message({}, {name: 1})


def test_round_record_sums_the_replies_fitstats(tmp_path):
    """The engine's client_flops, train_loss and trained_params come from each reply's FitStats."""
    from fedfuse.config import RunConfig, apply
    from fedfuse.runner import experiment

    cfg = apply(RunConfig(), {"dataset": "digits", "clients": 4, "clients_per_round": 4, "rounds": 1,
                              "local_epochs": 1, "model": "mlp", "out": str(tmp_path), "plots": False,
                              "device": "cpu"})
    exp = experiment(cfg, progress=False)
    seen: list[Message] = []
    declare = exp.algo.client_program

    def spy(*args):  # record every reply the declared program finalises
        program = declare(*args)
        finalize = program.finalize

        def record(state, stats):
            reply, cstate = finalize(state, stats)
            seen.append(reply)
            return reply, cstate

        return dataclasses.replace(program, finalize=record)

    exp.algo.client_program = spy
    exp.run()
    rec = exp.history[0]
    assert len(seen) == 4 and all(r.stats is not None and not (set(r.meta) & {"flops", "samples"}) for r in seen)
    assert rec["client_flops"] == pytest.approx(sum(r.stats.flops for r in seen))
    n = sum(r.stats.samples for r in seen)
    assert rec["train_loss"] == pytest.approx(sum(r.stats.train_loss * r.stats.samples for r in seen) / n)


def test_communicated_parameters_sum_a_clients_stages_and_skip_simulation_tensors(tmp_path):
    """Secure FedMR sends each client its slot model in stage 0, metadata in stage 1 and relayed envelopes
    (``sim/...``, peer traffic) in stage 2: per client and round that is one model, as for plain FedMR."""
    from fedfuse.config import RunConfig, apply
    from fedfuse.runner import experiment

    seen = {}
    for secure in (False, True):
        cfg = apply(RunConfig(), {"algorithm": "fedmr", "dataset": "digits", "clients": 6, "clients_per_round": 4,
                                  "rounds": 1, "local_epochs": 1, "model": "mlp", "out": str(tmp_path / str(secure)),
                                  "plots": False, "device": "cpu", "algorithm_options": {"secure": secure}})
        exp = experiment(cfg, progress=False)
        exp.run()
        seen[secure] = exp.history[0]["communicated_parameters_per_client"]
        model = sum(p.numel() for p in exp.ctx.model().parameters()) + sum(b.numel() for b in exp.ctx.model().buffers())
    assert seen[True] == seen[False] == model
