"""What stays on the client (engine/personal.py): the declaration resolves to the right keys, the client's own
entries never reach the server (payloads, replies, byte counts), each client trains and evaluates with its own,
they start from the run's initial model, the engine's client state carries them beside the algorithm's, and a
personalised algorithm needs no hook of its own for any of it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.config import RunConfig, apply
from fedfuse.engine.context import seeded_state
from fedfuse.engine.executor import SequentialExecutor
from fedfuse.engine.loop import Experiment
from fedfuse.engine.personal import (
    OWN,
    ClientSide,
    StaysLocal,
    check_requirements,
    join_state,
    split_state,
    unmet_requirements,
)
from fedfuse.errors import UnsupportedModel
from fedfuse.models import build_model
from fedfuse.structure import batchnorm_keys
from fedfuse.types import Message


def _mlp():
    return build_model("mlp", (1, 8, 8), 10, widths=[16, 12])


def _resnet():
    return build_model("resnet9", (1, 8, 8), 10, width_mult=0.25)


def test_the_declaration_resolves_by_kind_head_last_layers_and_pattern():
    res, mlp = _resnet(), _mlp()
    bn = StaysLocal(kinds=("bn",)).keys(res)
    assert bn == batchnorm_keys(res) and len(bn) == 60
    assert {"bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"} <= bn
    assert StaysLocal(head=True).keys(mlp) == {"fc.weight", "fc.bias"}
    assert StaysLocal(last_layers=2).keys(mlp) == {"fc.weight", "fc.bias", "hidden.1.weight", "hidden.1.bias"}
    assert StaysLocal(match=r"hidden\.0\..*").keys(mlp) == {"hidden.0.weight", "hidden.0.bias"}
    assert StaysLocal(kinds=("bn",)).keys(mlp) == frozenset()  # nothing of that kind: nothing stays
    both = StaysLocal(kinds=("bn",), head=True).keys(res)
    assert both == bn | set(res.head_keys())


def test_requirements_name_what_a_model_lacks():
    assert unmet_requirements(_mlp(), {"batchnorm", "head", "features"}) == ["batchnorm"]
    assert unmet_requirements(_resnet(), {"batchnorm", "head", "features"}) == []
    with pytest.raises(UnsupportedModel, match="fedbn needs a model with BatchNorm layers; MLP has none"):
        check_requirements("fedbn", _mlp(), {"batchnorm"})
    with pytest.raises(ValueError, match="unknown model requirement"):
        unmet_requirements(_mlp(), {"wings"})


def test_the_engine_state_keeps_the_algorithms_state_as_it_was():
    own = {"fc.bias": torch.ones(2)}
    for inner in (None, {}, {"c": 1}):
        joined = join_state(own, inner)
        got_own, got_inner = split_state(joined)
        assert got_own is own and got_inner == inner and (got_inner is None) == (inner is None)
    assert split_state(None) == (None, None) and split_state({"c": 1}) == (None, {"c": 1})
    assert split_state({OWN: "fedfuse:kept-on-node"}) == (None, None)  # a node's marker is not a model
    with pytest.raises(KeyError):
        join_state(own, {OWN: 1})


class HeadStays(FedAvg):
    """FedAvg with the head declared local and nothing else: the engine does everything."""

    name = ""
    stays_local = StaysLocal(head=True)

    @dataclass
    class Options(FedAvg.Options):
        pass


class Spy(SequentialExecutor):
    """The sequential executor that records every payload it is given and every reply it returns."""

    def __init__(self, clients, seed):
        super().__init__(clients, seed)
        self.sent: list[Message] = []
        self.replies: list[Message] = []

    def fit(self, target, jobs):
        self.sent += [j.payload for j in jobs]
        out = super().fit(target, jobs)
        self.replies += [r for r, _ in out.values()]
        return out

    def map(self, fn, jobs):
        self.sent += [j.payload for j in jobs]
        return super().map(fn, jobs)


def _cfg(**kw) -> RunConfig:
    base = dict(algorithm="fedavg", dataset="digits", model="mlp", clients=4, clients_per_round=3, rounds=3,
                batch_size=32, lr=0.05, seed=1, plots=False, local_epochs=1, eval_every=1,
                model_options={"widths": [16]}, partition_options={"alpha": 1.0, "min_size": 20})
    base.update(kw)
    return apply(RunConfig(), base)


def _spied(cls=HeadStays) -> tuple[Experiment, Spy]:
    probe = Experiment(_cfg(), cls)
    spy = Spy(probe.fed.blinded().clients, 1)
    exp = Experiment(_cfg(), cls, fed=probe.fed, executor=spy)
    exp.run()
    return exp, spy


def test_the_server_never_sees_a_clients_own_entries():
    """Attack as the server (or anyone on the wire between it and the clients): every message that crossed —
    training and evaluation payloads, replies — holds no head entry, and the bytes counted are the shared ones."""
    exp, spy = _spied()
    head = {"fc.weight", "fc.bias"}
    assert spy.sent and spy.replies
    assert all(not head & set(m.tensors) for m in spy.sent + spy.replies)
    shared = sum(v.numel() * v.element_size() for k, v in exp.state["global"].items() if k not in head)
    fits = [len(h["clients"]) for h in exp.history]
    assert [h["bytes_down"] for h in exp.history] == [n * shared for n in fits]
    assert [h["bytes_up"] for h in exp.history] == [n * shared for n in fits]
    assert all(h["global_accuracy"] is None and h["personal_accuracy"] is not None for h in exp.history)
    assert exp.history[-1]["server_parameters"] == 64 * 16 + 16  # the shared hidden layer only
    # the server's copy of the head is the initial one: it never averaged a client's
    w0 = seeded_state(exp.ctx, exp.ctx.seed)
    assert all(torch.equal(exp.state["global"][k], w0[k]) for k in head)


def test_each_client_trains_and_evaluates_with_its_own_entries():
    exp, _ = _spied()
    trained = {c for h in exp.history for c in h["clients"]}
    heads = {c: exp.client_states[c][OWN]["fc.weight"] for c in trained}
    assert len(trained) >= 2
    a, b = sorted(trained)[:2]
    assert not torch.equal(heads[a], heads[b])  # personal heads differ
    # a client's evaluation is the algorithm's evaluation of the shared model completed with its own head
    side: ClientSide = exp.client
    payload = side.outgoing(exp.algo.configure_evaluate(exp.state, [a]))[a]
    full = Message({**payload.tensors, **exp.client_states[a][OWN]})
    gen = torch.Generator()
    got = side.evaluate(payload, exp.client_states[a], exp.fed.clients[a], gen)
    assert got == exp.algo.evaluate(full, None, exp.fed.clients[a], gen)
    assert got["test_accuracy"] == exp.history[-1]["client_test_accuracy"][str(a)]


def test_a_clients_own_entries_start_from_the_runs_initial_model_and_follow_its_training():
    """The first step merges the initial model's head; the kept head is the one the client's reply trained."""
    exp = Experiment(_cfg(rounds=1), HeadStays)
    exp._fresh()
    side: ClientSide = exp.client
    payload = side.outgoing(exp.algo.configure_fit(exp.state, RoundInfo(0, 1), [0]))[0]
    assert set(payload.tensors) == {"hidden.0.weight", "hidden.0.bias"}
    prog = side.client_program(payload, None, exp.fed.clients[0])
    w0 = seeded_state(exp.ctx, exp.ctx.seed)
    assert torch.equal(prog.init["fc.weight"], w0["fc.weight"])
    reply, state = side.fit(payload, None, exp.fed.clients[0], torch.Generator().manual_seed(0))
    full, _ = exp.algo.fit(Message({**payload.tensors, "fc.weight": w0["fc.weight"], "fc.bias": w0["fc.bias"]}),
                           None, exp.fed.clients[0], torch.Generator().manual_seed(0))
    assert set(reply.tensors) == set(payload.tensors)
    assert all(torch.equal(reply.tensors[k], full.tensors[k]) for k in reply.tensors)
    assert set(state) == {OWN} and torch.equal(state[OWN]["fc.weight"], full.tensors["fc.weight"])
    assert reply.stats == full.stats  # the FLOPs and work of the whole model's training


def test_a_resumed_run_keeps_the_clients_own_entries(tmp_path):
    """The checkpoint holds the client states, own entries included: a resume continues bit for bit."""
    import json

    from fedfuse.engine.loop import strip_timing

    def run(out, kill=False):
        exp = Experiment(_cfg(rounds=3, checkpoint_every=1, out=str(out)), HeadStays,
                         on_round=(lambda rec: (_ for _ in ()).throw(KeyboardInterrupt) if rec["round"] == 2
                                   else None) if kill else None)
        return exp

    run(tmp_path / "a").run()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", kill=True).run()
    run(tmp_path / "b").run(resume=True)
    ma, mb = ([strip_timing(json.loads(x)) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
              for d in "ab")
    assert len(ma) == 3 and ma == mb


def _names(obj) -> set[str]:
    """Every dict key inside ``obj`` (messages' tensors, client states), recursively."""
    if isinstance(obj, Message):
        return set(obj.tensors) | _names(obj.meta)
    if isinstance(obj, dict):
        return set(obj) | {n for v in obj.values() for n in _names(v)}
    if isinstance(obj, tuple | list):
        return {n for v in obj for n in _names(v)}
    return set()


def test_the_flower_wire_carries_no_clients_own_entries():
    """Attack as anyone on the network under Flower (FedPer: its head stays local): decode every message the
    server sends and every reply a node returns, as serialised on the wire.  No head entry crosses in either
    direction — not in a payload, not in a reply, not in the client state that travels with the job (the own
    entries are node-private: the server holds the node's marker) — and the run equals the in-process one."""
    pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")
    from fedfuse.engine.loop import strip_timing
    from fedfuse.flower import wire
    from fedfuse.flower.app import KEPT, client_app
    from fedfuse.flower.executor import FlowerExecutor, LocalGrid
    from fedfuse.runner import experiment

    seen: list[set[str]] = []

    class Tapped(LocalGrid):
        def _wire(self, msg):
            out = super()._wire(msg)
            content = out.content
            if wire.ARRAYS not in content:  # a query (which clients a node serves): no model
                return out
            names = _names(wire.unpack(content))
            if wire.PAYLOAD_ARRAYS in content:
                names |= _names(wire.from_records(content[wire.PAYLOAD_ARRAYS], content[wire.PAYLOAD_SKELETON]))
            seen.append(names)
            return out

    # a Flower node rebuilds the algorithm from the config's name: FedPer (its last layer, the head, stays local)
    ref = experiment(_cfg(algorithm="fedper"))
    ref.run()
    cfg = ref.cfg
    grid = Tapped(client_app, 2)
    flw = experiment(cfg, executor=FlowerExecutor(grid, cfg, cfg.seed))
    flw.run()
    assert len(seen) > 6 and any("hidden.0.weight" in s for s in seen)
    assert not any({"fc.weight", "fc.bias"} & s for s in seen)
    assert [strip_timing(h) for h in flw.history] == [strip_timing(h) for h in ref.history]
    kept = [s for s in flw.client_states.values() if s is not None]
    assert kept and all(s == {OWN: KEPT} for s in kept)
