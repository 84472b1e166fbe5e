"""FedMR: the secure exchange through the algorithm's hooks, K = 1, warm-up = FedAvg, the two stages and the
global model, recombination inside the algorithm, diagnostics, determinism and resume."""

import json

import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.config import RunConfig, apply
from fedfuse.engine.client import train_local
from fedfuse.engine.executor import SequentialExecutor
from fedfuse.engine.loop import Experiment, strip_timing
from fedfuse.fusion.average import weighted_average
from fedfuse.fusion.recombine import (
    assemble,
    secure_exchange,
    unit_bytes,
)
from fedfuse.rng import derive_seed, numpy_rng, torch_generator
from fedfuse.runner import experiment
from fedfuse.types import FitStats, Message
from support import fedmr_cfg, random_states, source_of
from support import same_tensor as same

BN_MODEL = dict(model="resnet9", model_options={"width_mult": 0.25})


def test_secure_exchange_through_the_algorithm_hooks():
    """The three secure stages driven hook by hook on a BN model (units carry running stats and the 0-d
    ``num_batches_tracked``): the server's hands hold metadata, ciphertext and mixed models only."""
    from fedfuse.fusion.envelopes import ENVELOPE_OVERHEAD, new_key_pair

    exp = experiment(fedmr_cfg(clients=8, clients_per_round=5, algorithm_options={"secure": True}, **BN_MODEL))
    algo = exp.algo
    inputs = random_states(exp.ctx.model(), 5, seed=11)
    cids = [0, 2, 3, 5, 7]
    keys = {c: new_key_pair() for c in cids}
    states = {c: {"secure": {"round": 0, "model": s, "secret": keys[c][0]}} for c, s in zip(cids, inputs)}
    state = algo.init_state()
    stage0 = {c: Message({}, {"slot": i, "public_key": keys[c][1]}, FitStats(num_examples=10))
              for i, c in enumerate(cids)}
    state = algo.aggregate_fit(state, RoundInfo(index=0, total=1, stage=0), stage0)
    info1 = RoundInfo(index=0, total=1, stage=1)
    sent = algo.configure_fit(state, info1, cids)
    replies = {c: algo.secure_send(sent[c], states[c], c)[0] for c in cids}
    routed, moved = algo.exchange(info1, replies)
    state = algo.aggregate_fit(state, info1, routed)
    info2 = RoundInfo(index=0, total=1, stage=2)
    mail = algo.configure_fit(state, info2, cids)
    received = {c: algo.secure_assemble(mail[c], states[c], c)[0] for c in cids}
    units = algo.units()
    for c in cids:
        out = received[c].tensors
        for s in inputs:  # the server never sees any client's own trained model
            assert not all(same(out[k], s[k]) for k in s)
    for unit in units:  # ... yet the layer multiset is preserved
        assert sorted(source_of(unit, received[c].tensors, inputs) for c in cids) == list(range(5))
    ex = secure_exchange(5, len(units), numpy_rng(exp.cfg.seed, "fedmr-secure", 0, 0))
    changes = [(j, u) for j in range(5) for u in range(len(units)) if ex.sources[j, u] != j]
    assert moved == sum(unit_bytes(inputs[0], units[u]) + ENVELOPE_OVERHEAD for _, u in changes) > 0
    expected = assemble(inputs, units, ex.sources)
    for j, c in enumerate(cids):
        assert all(same(received[c].tensors[k], expected[j][k]) for k in expected[j])


def test_secure_run_counts_peer_bytes(tmp_path):
    exp = experiment(fedmr_cfg(rounds=2, algorithm_options={"secure": True}))
    exp.run()
    assert all(h["bytes_peer"] > 0 for h in exp.history)
    plain = experiment(fedmr_cfg(rounds=2), fed=exp.fed)
    plain.run()
    assert all(h["bytes_peer"] == 0 for h in plain.history)
    assert [h["bytes_up"] for h in plain.history] == [h["bytes_up"] for h in exp.history]


def test_k1_equals_sequential_training():
    exp = experiment(fedmr_cfg(clients=4, clients_per_round=1, rounds=3))
    exp.run()
    seed = exp.cfg.seed
    current = {k: v.clone() for k, v in exp.algo.init_state()["global"].items()}
    model = exp.ctx.build()
    for r in range(3):
        (c,) = exp.algo.select_clients(RoundInfo(r, 3), numpy_rng(seed, "select", r))
        torch.manual_seed(derive_seed(seed, "fit", r, 0, c, "torch"))
        model.load_state_dict(current)
        train_local(model, exp.fed.clients[c].train, exp.ctx.train, torch_generator(seed, "fit", r, 0, c))
        current = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in current.items():
        assert same(exp.state["global"][k], v)
        assert same(exp.state["slots"][0][k], v)


def warm_flop_cache(exp: Experiment) -> None:
    """``train_flops_per_sample`` runs one train-mode forward on the live model the first time it sees an
    architecture, which moves BN running statistics once per process; fill its cache on a throwaway copy."""
    from fedfuse.engine.client import train_flops_per_sample

    data = exp.fed.clients[0].train
    train_flops_per_sample(exp.ctx.build(), data.x, data.y, key=(exp.ctx.model_name,))


@pytest.mark.parametrize("warmup_weighting,fedavg_weighting", [("uniform", "uniform"), ("samples", "samples")])
def test_warmup_for_all_rounds_equals_fedavg(warmup_weighting, fedavg_weighting):
    """Default warm-up = uniform average of the uploads (author code); ``samples`` = sample-weighted FedAvg."""
    a = experiment(fedmr_cfg(algorithm_options={"warmup_rounds": 3, "warmup_weighting": warmup_weighting},
                           **BN_MODEL))
    warm_flop_cache(a)
    a.run()
    b = experiment(fedmr_cfg(algorithm="fedavg", algorithm_options={"weighting": fedavg_weighting}, **BN_MODEL),
                   fed=a.fed)
    b.run()
    for k, v in b.state["global"].items():
        assert same(a.state["global"][k], v), k
    for ha, hb in zip(a.history, b.history):
        assert ha["global_accuracy"] == hb["global_accuracy"]
        assert ha["personal_accuracy"] == hb["personal_accuracy"]
        assert ha["bytes_down"] == hb["bytes_down"] and ha["bytes_up"] == hb["bytes_up"]


def test_uniform_warmup_differs_from_weighted_on_unequal_clients():
    """The two warm-up forms are different operators when clients hold different amounts of data."""
    runs = {}
    for w in ("uniform", "samples"):
        exp = experiment(fedmr_cfg(rounds=1, algorithm_options={"warmup_rounds": 1, "warmup_weighting": w}))
        exp.run()
        runs[w] = exp.state["global"]
    sizes = [len(c.train.y) for c in exp.fed.clients]
    assert len(set(sizes)) > 1
    assert any(not torch.equal(runs["uniform"][k], runs["samples"][k]) for k in runs["uniform"])


def test_two_stage_switches_to_recombination_and_global_is_uniform_slot_average():
    exp = experiment(fedmr_cfg(rounds=3, algorithm_options={"warmup_rounds": 2}, **BN_MODEL))
    exp.run()
    slots = exp.state["slots"]
    assert slots is not None and len(slots) == 3
    assert any(not same(slots[0][k], slots[1][k]) for k in slots[0])
    expected = weighted_average(slots, [1.0, 1.0, 1.0])
    for k, v in expected.items():
        assert same(exp.state["global"][k], v), k
    nbt = [k for k in slots[0] if k.endswith("num_batches_tracked")]
    assert nbt and all(int(exp.state["global"][k]) == max(int(s[k]) for s in slots) for k in nbt)


def test_algorithm_recombination_uses_each_uploaded_layer_once():
    exp = experiment(fedmr_cfg(clients=8, clients_per_round=4, **BN_MODEL))
    algo = exp.algo
    state = algo.init_state()
    inputs = random_states(exp.ctx.model(), 4, seed=3)
    results = {c: Message(s, stats=FitStats(num_examples=5)) for c, s in zip([1, 3, 4, 6], inputs)}
    new = algo.aggregate_fit(state, RoundInfo(0, 1), results)
    for unit in algo.units():
        assert sorted(source_of(unit, s, inputs) for s in new["slots"]) == [0, 1, 2, 3]
    payloads = algo.configure_fit(new, RoundInfo(1, 2), [2, 5, 0, 7])  # slot i -> i-th sampled client
    for i, c in enumerate([0, 2, 5, 7]):
        assert payloads[c].tensors is new["slots"][i] and payloads[c].meta["slot"] == i


def test_segments_option_in_the_algorithm():
    exp = experiment(fedmr_cfg(clients=8, clients_per_round=4, algorithm_options={"segments": 1}, **BN_MODEL))
    algo = exp.algo
    inputs = random_states(exp.ctx.model(), 4, seed=4)
    results = {c: Message(s, stats=FitStats(num_examples=5)) for c, s in enumerate(inputs)}
    new = algo.aggregate_fit(algo.init_state(), RoundInfo(0, 1), results)
    whole = tuple(inputs[0])
    assert sorted(source_of(whole, s, inputs) for s in new["slots"]) == [0, 1, 2, 3]


def test_metrics_have_cosine_and_plot(tmp_path):
    exp = experiment(fedmr_cfg(tmp_path, plots=True))
    exp.run()
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["model_cosine"] is not None and -1.0 <= r["model_cosine"] <= 1.0 + 1e-9 for r in recs)
    assert (tmp_path / "run" / "fedmr_similarity.png").exists()


class ReversedExecutor(SequentialExecutor):
    def map(self, fn, jobs):
        return {job.cid: self.run_one(fn, job) for job in reversed(list(jobs))}


def test_deterministic_and_client_order_independent():
    opts = {"secure": True}
    a = experiment(fedmr_cfg(algorithm_options=opts))
    a.run()
    b = experiment(fedmr_cfg(algorithm_options=opts), fed=a.fed)
    b.executor = ReversedExecutor(b.fed.clients, b.cfg.seed)
    b.run()
    assert [strip_timing(h) for h in a.history] == [strip_timing(h) for h in b.history]


class Killed(Exception):
    pass


@pytest.mark.parametrize("algorithm,opts", [("fedmr", {"secure": True, "warmup_rounds": 1}), ("fedmut", {})])
def test_resume_is_bit_identical(tmp_path, algorithm, opts):
    from fedfuse.config import load_yaml

    full = experiment(fedmr_cfg(tmp_path / "a", algorithm=algorithm, rounds=4, algorithm_options=opts))
    full.run()

    def kill(rec):
        if rec["round"] == 2:
            raise Killed

    with pytest.raises(Killed):
        cfg_b = fedmr_cfg(tmp_path / "b", algorithm=algorithm, rounds=4, algorithm_options=opts)
        experiment(cfg_b, on_round=kill).run()
    cfg = apply(RunConfig(), load_yaml(tmp_path / "b" / "run" / "config.yaml"))
    experiment(cfg).run(resume=True)
    ma = [strip_timing(json.loads(x)) for x in (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()]
    mb = [strip_timing(json.loads(x)) for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert ma == mb and len(ma) == 4
