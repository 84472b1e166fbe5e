"""FedRep: head epochs with the representation frozen, then representation epochs with the head frozen; the head
stays on the client, the representation is averaged."""

from __future__ import annotations

import torch

from fedfuse.algorithms.fedrep import phase_flops
from fedfuse.config import RunConfig, apply
from fedfuse.engine.client import train_flops_per_sample
from fedfuse.engine.program import ClientProgram, run_program
from fedfuse.runner import experiment
from fedfuse.types import Message
from support import check_same_seed_same_run

HEAD = {"fc.weight", "fc.bias"}


def _cfg(**kw) -> RunConfig:
    base = dict(algorithm="fedrep", dataset="digits", model="mlp", model_options={"widths": [16]}, clients=4,
                clients_per_round=2, rounds=2, batch_size=32, lr=0.05, seed=2, plots=False, local_epochs=1,
                partition="shards", partition_options={"classes_per_client": 2},
                algorithm_options={"head_epochs": 2})
    base.update(kw)
    return apply(RunConfig(), base)


def test_head_then_body_by_hand():
    """One client's step equals, by hand: the head trained alone for head_epochs (representation untouched), then
    the representation trained alone for local_epochs from that head (head untouched), one generator throughout."""
    exp = experiment(_cfg())
    algo, data = exp.algo, exp.fed.clients[0]
    w = algo.init_state()["global"]
    model = exp.ctx.model()
    reply, _ = algo.fit(Message(dict(w)), None, data, torch.Generator().manual_seed(5))

    gen = torch.Generator().manual_seed(5)
    params = {k for k, _ in model.named_parameters()}

    def keep(s, st):
        return s, st

    first = ClientProgram(model=model, init=dict(w), spec=exp.ctx.train.replace(local_epochs=2), finalize=keep,
                          trainable=frozenset(HEAD))
    after_head, st1 = run_program(first, data, gen)
    assert all(torch.equal(after_head[k], w[k]) for k in params - HEAD)  # the representation was frozen
    assert all(not torch.equal(after_head[k], w[k]) for k in HEAD)
    second = ClientProgram(model=model, init=after_head, spec=exp.ctx.train, finalize=keep,
                           trainable=frozenset(params - HEAD))
    final, st2 = run_program(second, data, gen)
    assert all(torch.equal(final[k], after_head[k]) for k in HEAD)  # the head was frozen
    assert all(torch.equal(reply.tensors[k], final[k]) for k in final)
    n = len(data.train)
    assert reply.stats.samples == 3 * n and reply.stats.steps == st1.steps + st2.steps
    assert reply.stats.train_loss == (st1.loss_sum + st2.loss_sum) / (3 * n)


def test_phase_flops_count_each_backward_at_its_depth():
    """A head phase's backward stops at the head: fewer FLOPs than a full step; a body phase computes no head
    weight gradient: fewer than a full step but more than a head phase.  The reply adds them per sample."""
    exp = experiment(_cfg())
    model, x, y = exp.ctx.model(), exp.fed.clients[0].train.x, exp.fed.clients[0].train.y
    params = frozenset(k for k, _ in model.named_parameters())
    full = train_flops_per_sample(model, x, y, key=("t-full",))
    head = phase_flops(model, x, y, frozenset(HEAD), ("t-head",))
    body = phase_flops(model, x, y, params - HEAD, ("t-body",))
    assert head < body < full
    fwd = 2 * (64 * 16 + 16 * 10)  # multiply-adds of the MLP's forward pass, per sample
    assert head == fwd + 2 * 16 * 10  # forward + the head's weight gradient
    reply, _ = exp.algo.fit(Message(exp.algo.init_state()["global"]), None, exp.fed.clients[0],
                            torch.Generator().manual_seed(0))
    n = len(exp.fed.clients[0].train)
    assert reply.stats.flops == head * 2 * n + body * n


def test_the_head_stays_local_and_the_representation_is_averaged():
    exp = experiment(_cfg(rounds=2, clients_per_round=4))
    exp.run()
    assert exp.client.own_keys() == HEAD
    assert exp.history[-1]["global_accuracy"] is None
    heads = [exp.client_states[c]["fedfuse:own"]["fc.weight"] for c in range(4)]
    assert all(not torch.equal(heads[0], h) for h in heads[1:])


def test_same_seed_same_run():
    check_same_seed_same_run(_cfg(), metric="personal_accuracy")
