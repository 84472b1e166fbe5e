"""Secure FedMR (App. B) run client side: the server never holds a client's own trained model, relays only
ciphertext, and the round ends exactly where the former server-side simulation ended — in process and over
Flower messages.  Plus the dropout policy between the stages and determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.algorithms.fedmr import FedMR
from fedfuse.config import validate
from fedfuse.engine.executor import SequentialExecutor
from fedfuse.engine.loop import TIMING_KEYS, Experiment, strip_timing
from fedfuse.fusion.envelopes import (
    ENVELOPE_OVERHEAD,
    envelope_aad,
    envelope_key,
    new_key_pair,
    seal,
    unit_from_plaintext,
    unit_plaintext,
    unseal,
)
from fedfuse.fusion.recombine import assemble, secure_exchange, unit_bytes
from fedfuse.rng import numpy_rng
from fedfuse.runner import experiment
from fedfuse.types import Message
from support import fedmr_cfg

SECURE = {"secure": True}
K = 5


def secure_cfg(**kw):
    return fedmr_cfg(clients=8, clients_per_round=K, rounds=2, algorithm_options=SECURE, **kw)


class Recording(FedMR):
    """FedMR that records everything the server is handed: (hook, round, stage, results)."""

    seen: list[tuple[str, int, int, dict[int, Message]]]

    def exchange(self, info, results):
        self.seen.append(("exchange", info.index, info.stage, dict(results)))
        return super().exchange(info, results)

    def aggregate_fit(self, state, info, results):
        self.seen.append(("aggregate_fit", info.index, info.stage, dict(results)))
        return super().aggregate_fit(state, info, results)


class ServerSideSecure(FedMR):
    """The former simulation (reference): clients upload their trained models, the server mixes them with
    ``secure_exchange`` + ``assemble`` in ``exchange`` and then recombines as usual."""

    def secure_round(self, info):
        return False

    def exchange(self, info, results):
        if not self.opt.secure or self.in_warmup(info) or len(results) < 2:
            return results, 0
        cids = sorted(results)
        ex = secure_exchange(len(cids), len(self.units()), numpy_rng(self.ctx.seed, "fedmr-secure", info.index, 0),
                             send_prob=float(self.opt.secure_send_prob), min_passes=int(self.opt.secure_min_passes))
        mixed = assemble([results[c].tensors for c in cids], self.units(), ex.sources)
        return {c: Message(mixed[j], dict(results[c].meta), results[c].stats) for j, c in enumerate(cids)}, 0


class RecordingExecutor(SequentialExecutor):
    """Sequential executor that keeps every client reply with the client's new state, and can drop the
    replies of ``drop[(round, stage)]`` clients (a client that goes away between stages)."""

    def __init__(self, clients, seed, drop=None):
        super().__init__(clients, seed)
        self.drop = drop or {}
        self.outs: dict[tuple[int, int], dict] = {}

    def fit(self, target, jobs):
        jobs = list(jobs)
        if not jobs:
            return {}
        _, r, stage = jobs[0].keys
        gone = self.drop.get((r, stage), ())
        out = {c: o for c, o in self.map(target.fit, jobs).items() if c not in gone}
        self.outs[(r, stage)] = out
        return out


def recorded_run(cfg, drop=None, algorithm=Recording) -> tuple[Experiment, RecordingExecutor]:
    exp = Experiment(cfg, algorithm)
    exp.algo.seen = []
    exp.executor = RecordingExecutor(exp.fed.clients, exp.cfg.seed, drop)
    exp.run()
    return exp, exp.executor


def trained_models(ex: RecordingExecutor, r: int) -> dict[int, dict[str, torch.Tensor]]:
    """Every client's own trained model of round r, read where it lives: in the client's state."""
    return {c: st["secure"]["model"] for c, (_, st) in ex.outs[(r, 0)].items()}


def holds(tensors, model) -> bool:
    return all(k in tensors and torch.equal(tensors[k], v) for k, v in model.items())


def source_of(unit, upload, trained) -> list[int]:
    return [c for c, m in trained.items() if all(torch.equal(upload[k], m[k]) for k in unit)]


# ---- (1) the server never holds a client's own model; envelopes are ciphertext -----------------------------
def test_server_never_receives_a_clients_own_model_and_relays_only_ciphertext():
    exp, ex = recorded_run(secure_cfg())
    units = exp.algo.units()
    assert len(exp.algo.seen) == 2 * 3 * 2  # two hooks x three stages x two rounds
    for hook, r, stage, results in exp.algo.seen:
        trained = trained_models(ex, r)
        assert len(trained) == K
        for c, msg in results.items():
            for own in trained.values():
                assert not holds(msg.tensors, own), (hook, r, stage, c)
            if stage == 0:
                assert msg.tensors == {} and "public_key" in msg.meta  # metadata only
            if stage == 1:
                plain = [unit_plaintext(m, unit) for m in trained.values() for unit in units]
                for name, env in msg.tensors.items():
                    assert name.startswith("sim/") and env.dtype == torch.uint8
                    raw = env.numpy().tobytes()
                    assert all(p not in raw for p in plain)  # no layer's bytes appear in an envelope
                    u = int(name.rsplit("/u", 1)[1])
                    assert len(raw) == unit_bytes(next(iter(trained.values())), units[u]) + ENVELOPE_OVERHEAD
            if stage == 2:  # the uploads: mixed models, each built from >= 2 clients' layers
                assert len({tuple(source_of(u, msg.tensors, trained)) for u in units}) >= 2
    assert all(h["bytes_peer"] > 0 for h in exp.history)


# ---- (2) equal to the former server-side simulation, every layer used exactly once --------------------------
def test_recombined_models_equal_the_server_side_simulation():
    exp, ex = recorded_run(secure_cfg())
    ref = Experiment(secure_cfg(), ServerSideSecure, fed=exp.fed)
    ref.run()
    for k, v in ref.state["global"].items():
        assert torch.equal(exp.state["global"][k], v)
    for a, b in zip(exp.state["slots"], ref.state["slots"], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)
    peer_free = ("bytes_peer", "total_bytes_peer")  # parameters sent per client: equal (envelopes are peer traffic)
    assert ([{k: v for k, v in strip_timing(h).items() if k not in peer_free} for h in exp.history]
            == [{k: v for k, v in strip_timing(h).items() if k not in peer_free} for h in ref.history])
    units = exp.algo.units()
    for r in range(2):
        trained = trained_models(ex, r)
        cids = sorted(trained)
        uploads = {c: rep.tensors for c, (rep, _) in ex.outs[(r, 2)].items()}
        assert sorted(uploads) == cids
        plan = secure_exchange(K, len(units), numpy_rng(exp.cfg.seed, "fedmr-secure", r, 0))
        expected = assemble([trained[c] for c in cids], units, plan.sources)
        for j, c in enumerate(cids):
            assert holds(uploads[c], expected[j])
        for unit in units:  # every trained layer is in exactly one upload
            found = [s for c in cids for s in source_of(unit, uploads[c], trained)]
            assert sorted(found) == cids
        # peer bytes: one envelope per unit that changes hands, each the unit's bytes + nonce + tag
        moved = sum(unit_bytes(trained[cids[0]], units[u]) + ENVELOPE_OVERHEAD
                    for j in range(K) for u in range(len(units)) if plan.sources[j, u] != j)
        assert exp.history[r]["bytes_peer"] == moved


# ---- (3) the same run through Flower messages ---------------------------------------------------------------
def test_secure_fedmr_over_flower_messages_equals_in_process():
    """Every job travels as a Flower message to in-process ClientApp nodes; the metrics equal the in-process
    run exactly, and nothing a node sends back — replies *and* the client state that returns with them —
    holds a client's trained model: the model and private key stay in the node's ``context.state``."""
    pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")
    from fedfuse.flower import wire
    from fedfuse.flower.app import KEPT, client_app
    from fedfuse.flower.executor import FlowerExecutor, LocalGrid

    class RecordingGrid(LocalGrid):
        def send_and_receive(self, messages, *, timeout=None):
            replies = super().send_and_receive(messages, timeout=timeout)
            self.seen += [wire.unpack(r.content)["result"] for r in replies if not r.has_error()]
            return replies

    cfg = validate(secure_cfg())
    ref, ex = recorded_run(cfg)
    grid = RecordingGrid(client_app, 2)
    grid.seen = []
    flw = experiment(cfg, executor=FlowerExecutor(grid, cfg, cfg.seed))
    flw.run()
    assert [strip_timing(h) for h in flw.history] == [strip_timing(h) for h in ref.history]
    totals = {k: v for k, v in flw.summary()["totals"].items() if k not in TIMING_KEYS}
    assert totals == {k: v for k, v in ref.summary()["totals"].items() if k not in TIMING_KEYS}
    for a, b in zip(flw.state["slots"], ref.state["slots"], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)
    trained = [m for r in range(2) for m in trained_models(ex, r).values()]
    fit_replies = [x for x in grid.seen if isinstance(x, tuple)]
    assert len(fit_replies) == 2 * 3 * K
    kept = 0
    for reply, state in fit_replies:
        assert not any(holds(reply.tensors, own) for own in trained)
        assert state is None or state == {"secure": KEPT}  # no tensor of the client's state reaches the server
        kept += state is not None
    assert kept == 2 * 2 * K  # after stages 0 and 1 the node keeps the model; stage 2 drops it
    assert all(st in (None, {"secure": KEPT}) for st in flw.client_states.values())


# ---- (4) determinism ----------------------------------------------------------------------------------------
def test_same_seed_same_models_fresh_keys():
    a, ea = recorded_run(secure_cfg())
    b, eb = recorded_run(secure_cfg())
    assert [strip_timing(h) for h in a.history] == [strip_timing(h) for h in b.history]
    for x, y in zip(a.state["slots"], b.state["slots"], strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)
    # the key pairs and nonces come from the OS, not from the (server-known) seed: the ciphertext differs
    env_a = {k: v for _, (rep, _) in ea.outs[(0, 1)].items() for k, v in rep.tensors.items()}
    env_b = {k: v for _, (rep, _) in eb.outs[(0, 1)].items() for k, v in rep.tensors.items()}
    assert env_a.keys() == env_b.keys() and env_a
    assert all(not torch.equal(env_a[k], env_b[k]) for k in env_a)


# ---- envelopes -----------------------------------------------------------------------------------------------
def test_envelope_round_trip_and_tamper_detection():
    state = {"w": torch.randn(3, 4), "b": torch.randn(4).to(torch.bfloat16), "n": torch.tensor(7)}
    unit = ("w", "b", "n")
    sk_a, pk_a = new_key_pair()
    sk_b, pk_b = new_key_pair()
    key = envelope_key(sk_a, pk_b, 3, 1, 2)
    assert key == envelope_key(sk_b, pk_a, 3, 1, 2) != envelope_key(sk_b, pk_a, 3, 2, 1)
    plain = unit_plaintext(state, unit)
    env = seal(key, plain, envelope_aad(3, 1, 2, 0))
    assert env.numel() == len(plain) + ENVELOPE_OVERHEAD == 48 + 8 + 8 + ENVELOPE_OVERHEAD
    back = unit_from_plaintext(unseal(key, env, envelope_aad(3, 1, 2, 0)), state, unit)
    assert all(back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]) for k in unit)
    with pytest.raises(ValueError, match="authentication"):
        unseal(key, env, envelope_aad(3, 1, 2, 1))  # replayed as another unit
    bad = env.clone()
    bad[20] ^= 1
    with pytest.raises(ValueError, match="authentication"):
        unseal(key, bad, envelope_aad(3, 1, 2, 0))


# ---- dropouts between the stages ---------------------------------------------------------------------------
def hand_plan(algo: FedMR) -> dict:
    # three clients, three units: u0 a 3-cycle 1<-2<-3<-1, u1 a 2-cycle 1<->2 (3 keeps), u2 everyone keeps
    sources = {1: [2, 2, 1], 2: [3, 1, 2], 3: [1, 3, 3]}
    return {"secure": {"round": 0, "cids": [1, 2, 3], "sources": sources, "passes": 1,
                       "keys": {1: "k1", 2: "k2", 3: "k3"}, "slots": {1: 0, 2: 1, 3: 2}}}


def mail(pairs: dict[int, list[str]]) -> dict[int, Message]:
    return {c: Message({f"sim/mail/{name}": torch.zeros(1, dtype=torch.uint8) for name in names})
            for c, names in pairs.items()}


def test_settle_plan_by_hand():
    exp = experiment(fedmr_cfg(clients=6, clients_per_round=3, algorithm_options=SECURE))
    algo = exp.algo
    assert len(algo.units()) == 3
    info = RoundInfo(index=0, total=1, stage=1)
    full = {1: ["2/u0", "2/u1"], 2: ["3/u0", "1/u1"], 3: ["1/u0"]}
    s = algo.settle_plan(hand_plan(algo), info, mail(full))["secure"]
    assert s["settled"] == hand_plan(algo)["secure"]["sources"] and s["withheld"] == []
    # client 3 gone after stage 0: the u0 cycle is broken (1 and 2 keep their own u0), the u1 swap stands
    s = algo.settle_plan(hand_plan(algo), info, mail({1: full[1], 2: full[2]}))["secure"]
    assert s["settled"] == {1: [1, 2, 1], 2: [2, 1, 2]} and s["withheld"] == []
    assert sorted(s["inbox"][1]) == ["sim/2/u1"] and sorted(s["inbox"][2]) == ["sim/1/u1"]
    # client 2 gone: both cycles through it break, 1 and 3 would upload their own models -> withheld
    s = algo.settle_plan(hand_plan(algo), info, mail({1: full[1], 3: full[3]}))["secure"]
    assert s["settled"] == {1: [1, 1, 1], 3: [3, 3, 3]} and s["withheld"] == [1, 3] and s["inbox"] == {}
    # everyone replied but one envelope (3 -> 2, u0) is missing: that cycle is kept at home, which leaves
    # client 3 with its own model (withheld)
    s = algo.settle_plan(hand_plan(algo), info, mail({1: full[1], 2: ["1/u1"], 3: full[3]}))["secure"]
    assert s["settled"] == {1: [1, 2, 1], 2: [2, 1, 2], 3: [3, 3, 3]} and s["withheld"] == [3]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_client_leaving_between_stages(stage):
    probe, _ = recorded_run(secure_cfg())
    gone = probe.history[0]["clients"][1]
    exp, ex = recorded_run(secure_cfg(), drop={(0, stage): [gone]})
    rec = exp.history[0]
    assert rec["dropped"] == [gone] and not rec["round_skipped"] and len(exp.history) == 2
    trained = trained_models(ex, 0)
    uploads = {c: rep.tensors for c, (rep, _) in ex.outs[(0, 2)].items()}
    assert gone not in uploads and 1 <= len(uploads) <= K - 1
    for up in uploads.values():
        assert not any(holds(up, own) for own in trained.values())
    for unit in exp.algo.units():  # every position filled once; no trained layer used twice
        found = [s for c in uploads for s in source_of(unit, uploads[c], trained)]
        assert len(found) == len(uploads) == len(set(found))
    for _, r, _, results in exp.algo.seen:
        for msg in results.values():
            assert not any(holds(msg.tensors, own) for own in trained_models(ex, r).values())


def test_two_clients_one_leaves_skips_the_round():
    cfg = fedmr_cfg(clients=4, clients_per_round=2, rounds=1, algorithm_options=SECURE)
    probe, _ = recorded_run(cfg)
    gone = probe.history[0]["clients"][0]
    exp, ex = recorded_run(cfg, drop={(0, 1): [gone]})
    rec = exp.history[0]
    assert rec["round_skipped"] and (0, 2) not in ex.outs  # the survivor withholds its own model
    assert exp.state["slots"] is None  # the server is left as it was
    assert np.isfinite(rec["global_accuracy"])


def test_flower_node_that_lost_its_store_is_a_dropout():
    """A node restarts between stage 0 and stage 1 (its ``context.state`` is empty): its clients cannot send
    their layers, the ClientApp raises, Flower turns that into an error reply (as its runtimes do), and the
    loop counts them as dropouts; the round completes under the dropout policy."""
    pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")
    from flwr.app import Error, RecordDict
    from flwr.app import Message as FlowerMessage

    from fedfuse.flower.app import client_app
    from fedfuse.flower.executor import FlowerExecutor, LocalGrid

    class RestartingGrid(LocalGrid):
        def send_and_receive(self, messages, *, timeout=None):
            if self.calls == 1:  # after round 1's stage 0: node 1 restarts
                self.contexts[1].state = RecordDict()
            out = []
            self.calls += 1
            for msg in messages:
                received = self._wire(msg)
                try:
                    reply = self.client_app(received, self.contexts[msg.metadata.dst_node_id])
                except Exception as e:  # what Flower's runtimes send back when a ClientApp raises
                    reply = FlowerMessage(Error(code=2, reason=str(e)), reply_to=received)
                out.append(self._wire(reply))
            return out

    cfg = validate(secure_cfg())
    flw = experiment(cfg, executor=FlowerExecutor(RestartingGrid(client_app, 2), cfg, cfg.seed))
    flw.run()
    rec = flw.history[0]
    node1 = [c for c in rec["clients"] if c % 2 == 0]  # client cid is served by node ids[cid % 2]
    assert node1 and sorted(rec["dropped"]) == node1 and not rec["round_skipped"]
    assert rec["replied"] <= K - len(node1) and len(flw.history) == 2
    assert np.isfinite(flw.history[-1]["global_accuracy"])
