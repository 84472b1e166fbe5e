"""Faults: update checks and quarantine, robust fusion, dropouts/stragglers, divergence, resume under faults."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fedfuse.algorithms import ALGORITHMS
from fedfuse.config import ConfigError, RunConfig, apply, validate
from fedfuse.engine.faults import DROPOUT, LATE, FaultPlan, update_norm
from fedfuse.engine.loop import Experiment, build_federation, strip_timing
from fedfuse.errors import DivergenceError
from fedfuse.fusion.average import clip_updates, robust_average
from fedfuse.runner import experiment
from fedfuse.types import ClientData, Federation, FitStats, Message, Split
from golden.make_golden import tiny_model

BASE = dict(dataset="digits", model="mlp", model_options={"widths": [16]}, clients=4, clients_per_round=4,
            rounds=2, local_epochs=1, plots=False, eval_every=2, threads=1)


def _cfg(**kw) -> RunConfig:
    return validate(apply(RunConfig(), {**BASE, **kw}))


@pytest.fixture(scope="module")
def fed():
    return build_federation(_cfg())


def _run(fed, **kw) -> Experiment:
    exp = experiment(_cfg(**kw), fed=fed)
    exp.run()
    return exp


def _global(exp: Experiment) -> dict[str, torch.Tensor]:
    return exp.algo.global_model(exp.state)[0]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _identical(a, b) -> bool:
    """Bit-identity of two server states (nested dicts/lists of tensors and plain values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)  # NaN diagnostics compare equal


@pytest.mark.parametrize("algorithm", ["fedavg", "fedmerge", "fedmr", "fedma", "msfusion", "scaffold"])
def test_bad_update_leaves_global_model_as_without_that_client(fed, algorithm):
    opts = {"algorithm_options": {"d": 2}} if algorithm == "fedmerge" else {}
    clean = _run(fed, algorithm=algorithm, **opts).state
    ref = _run(fed, algorithm=algorithm, corrupt="drop", corrupt_clients=[1], **opts).state
    assert not _identical(clean, ref)  # client 1 matters, so the comparison below means something
    for mode in ("nan", "inf", "shape", "scale", "count"):
        if mode == "count" and algorithm == "msfusion":
            continue  # no example count is fused by MSfusion (checked by the unit test below)
        exp = _run(fed, algorithm=algorithm, corrupt=mode, corrupt_clients=[1], **opts)
        assert _identical(exp.state, ref), (algorithm, mode)
        assert all("1" in h["quarantined"] for h in exp.history), (algorithm, mode, exp.history[0]["quarantined"])
        assert exp.totals.quarantined >= 2



def test_a_quarantined_client_keeps_its_own_state(fed):
    """What the quarantine does not promise (docs/reliability.md §3): the server refuses the reply, but the client
    keeps the state it computed (SCAFFOLD's c_i): the server cannot undo it."""
    exp = _run(fed, algorithm="scaffold", corrupt="nan", corrupt_clients=[1])
    assert all("1" in h["quarantined"] for h in exp.history)
    ci = exp.client_states[1]["c"]
    assert any(v.abs().sum() > 0 for v in ci.values())  # the client updated c_i although its reply was refused

def _msg(**tensors) -> Message:
    return Message({k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()},
                   stats=FitStats(num_examples=10, train_loss=0.5))


def test_update_norm_state_vs_delta():
    sent = _msg(w=[3.0, 0.0])
    reply = _msg(w=[3.0, 4.0])
    assert update_norm(sent, reply, state_like=True) == pytest.approx(4.0)
    assert update_norm(sent, reply, state_like=False) == pytest.approx(5.0)


def test_update_norm_equals_the_float64_norm_of_the_concatenated_update():
    """Per-tensor norms combined in float64 equal the norm of the whole update vector computed in float64 (the
    definition), to float32 rounding; integer tensors are left out."""
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (200, 784), "b": (200,), "c": (10, 200), "d": (0,)}
    sent = Message({k: torch.randn(s, generator=g) for k, s in shapes.items()})
    reply = Message({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in sent.tensors.items()}
                    | {"n": torch.tensor([7])})
    want = torch.cat([(reply.tensors[k].double() - sent.tensors[k].double()).reshape(-1) for k in shapes]).norm()
    assert update_norm(sent, reply, state_like=True) == pytest.approx(float(want), rel=1e-6)
    alone = torch.cat([reply.tensors[k].double().reshape(-1) for k in shapes]).norm()
    assert update_norm(sent, reply, state_like=False) == pytest.approx(float(alone), rel=1e-6)


def test_median_trimmed_mean_and_clipping_by_hand():
    states = [{"w": torch.tensor([1.0, 10.0]), "bn.num_batches_tracked": torch.tensor(3)},
              {"w": torch.tensor([2.0, 20.0]), "bn.num_batches_tracked": torch.tensor(5)},
              {"w": torch.tensor([3.0, -1e9]), "bn.num_batches_tracked": torch.tensor(4)},
              {"w": torch.tensor([1e9, 30.0])}]  # did not send the BN counter
    base = {"w": torch.zeros(2), "bn.num_batches_tracked": torch.tensor(1), "frozen": torch.ones(1)}
    med = robust_average(states, "median", base=base)
    assert torch.equal(med["w"], torch.tensor([2.5, 15.0]))
    assert int(med["bn.num_batches_tracked"]) == 5 and torch.equal(med["frozen"], torch.ones(1))
    tm = robust_average(states, "trimmed-mean", trim=0.25, base=base)  # drops 1 at each end of 4
    assert torch.allclose(tm["w"], torch.tensor([2.5, 15.0]))
    assert torch.allclose(robust_average(states[:3], "trimmed-mean", trim=0.0)["w"],
                          torch.stack([s["w"] for s in states[:3]]).double().mean(0).float())
    clipped = clip_updates([{"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(7)}], {"w": torch.zeros(2)}, 1.0)
    assert torch.allclose(clipped[0]["w"], torch.tensor([0.6, 0.8])) and int(clipped[0]["n"]) == 7
    assert torch.equal(clip_updates([{"w": torch.tensor([0.3, 0.4])}], {"w": torch.zeros(2)}, 1.0)[0]["w"],
                       torch.tensor([0.3, 0.4]))


def test_robust_fusion_resists_a_scaled_client_when_checks_are_off(fed):
    ref = _global(_run(fed, corrupt="drop", corrupt_clients=[1]))
    plain = _global(_run(fed, corrupt="scale", corrupt_clients=[1], check_updates=False))
    med = _global(_run(fed, corrupt="scale", corrupt_clients=[1], check_updates=False,
                       algorithm_options={"fusion": "median"}))
    dist = lambda a: sum(float((a[k] - ref[k]).double().norm()) for k in ref if a[k].is_floating_point())  # noqa: E731
    assert dist(med) < dist(plain) / 20


def test_fault_schedule_is_seeded_and_has_the_asked_rates():
    plan = FaultPlan(seed=3, dropout=0.3, stragglers=0.5, deadline=2.0)
    fates = [plan.fate(r, c) for r in range(200) for c in range(20)]
    assert fates == [FaultPlan(seed=3, dropout=0.3, stragglers=0.5, deadline=2.0).fate(r, c)
                     for r in range(200) for c in range(20)]
    n = len(fates)
    assert abs(fates.count(DROPOUT) / n - 0.3) < 0.03
    assert abs(fates.count(LATE) / n - 0.7 * 0.5 * math.exp(-1)) < 0.03
    assert FaultPlan(seed=4, dropout=0.3).fate(0, 0) in ("ok", DROPOUT)
    assert all(FaultPlan(stragglers=1.0, deadline=math.inf).fate(r, 0) == "ok" for r in range(50))


def _lm_fed() -> Federation:
    """Four clients of generated token sequences (each a run of consecutive ids mod 12)."""
    vocab, length = 12, 8
    g = torch.Generator().manual_seed(0)

    def split(n: int) -> Split:
        seq = (torch.randint(0, vocab, (n, 1), generator=g) + torch.arange(length + 1)) % vocab
        return Split(seq[:, :-1], seq[:, 1:])

    clients = [ClientData(c, split(24), split(4), split(4)) for c in range(4)]
    return Federation(clients, split(16), vocab, (length,), task="lm", dataset="tiny-shakespeare", partition="iid")


_BASE: list[str] = []


def _lora_base() -> str:
    """A tiny frozen base LM for the LoRA algorithms (the format `fedfuse pretrain` writes)."""
    pytest.importorskip("peft", reason="needs the lora extra: pip install -e '.[lora]'")
    if not _BASE:
        import tempfile

        from fedfuse.models.transformer import TransformerModel

        torch.manual_seed(0)
        kw = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "dropout": 0.0, "norm_first": True,
              "max_len": 16}
        vocab = [chr(97 + i) for i in range(12)]
        m = TransformerModel(len(vocab), len(vocab), task="lm", **kw)
        path = Path(tempfile.mkdtemp()) / "base.pt"
        torch.save({"kind": "fedfuse-lm", "model": kw, "vocab": vocab, "state": m.state_dict(), "info": {}}, path)
        _BASE.append(f"fedfuse:{path}")
    return _BASE[0]


LM = dict(dataset="tiny-shakespeare", model="transformer",
          model_options={"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "dropout": 0.0, "max_len": 16})


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_runs_a_partial_round(fed, algorithm):
    """Dropouts and stragglers: every algorithm completes with what arrived, reports accuracy, quarantines nobody
    honest, and is deterministic."""
    kw = dict(algorithm=algorithm, rounds=2, eval_every=2, dropout=0.3, stragglers=0.3, seed=1)
    if ALGORITHMS[algorithm].requires:  # e.g. FedBN: the first tiny model that has what it requires
        kw.update(tiny_model(algorithm))
    if algorithm == "simple-fedma":  # a transformer method
        fed, kw = _lm_fed(), {**kw, **LM}
    if "lora" in algorithm or algorithm == "fedit":  # adapters on a frozen base LM
        fed, kw = _lm_fed(), {**kw, **LM, "batch_size": 4, "optimizer": "adam", "lr": 0.01,
                              "algorithm_options": {"base": _lora_base(), "rank": 2, "rouge_samples": 0}}
    a = _run(fed, **kw)
    assert len(a.history) == 2
    assert a.totals.dropped + a.totals.late > 0
    assert all(not h["quarantined"] for h in a.history), a.history
    final = a.history[-1]
    assert final.get("personal_accuracy") is not None or final.get("global_accuracy") is not None
    if algorithm in ("fedmr", "fedma", "msfusion"):  # same seed, same faults: identical metrics
        b = _run(fed, **kw)
        assert [strip_timing(h) for h in a.history] == [strip_timing(h) for h in b.history]


def test_late_replies_join_the_next_round(fed):
    kw = dict(stragglers=0.6, deadline=1.2, rounds=3, seed=5)
    dropped = _run(fed, **kw)
    late = _run(fed, late_replies="next-round", **kw)
    assert sum(len(h["late"]) for h in late.history[:-1]) > 0
    for r in range(1, 3):  # what missed round r arrives in round r + 1 (unless that client replied afresh)
        missed = set(late.history[r - 1]["late"]) - (set(late.history[r]["clients"]) - set(late.history[r]["late"]))
        assert set(late.history[r]["delivered_late"]) == missed
    assert not _same(_global(dropped), _global(late))
    assert all(not h["quarantined"] for h in late.history)
    with pytest.raises(ConfigError, match="late_replies: 'fedmr' cannot fuse"):
        _cfg(algorithm="fedmr", late_replies="next-round")


def test_quorum_skips_a_round_and_keeps_the_server_state(fed):
    exp = _run(fed, dropout=0.6, quorum=4, rounds=2, seed=2)
    assert all(h["round_skipped"] for h in exp.history)
    init = experiment(_cfg(seed=2), fed=fed).algo.init_state()["global"]
    assert _same(_global(exp), init)


def test_fedmr_partial_round_keeps_the_missing_slot(fed):
    exp = experiment(_cfg(algorithm="fedmr", seed=0), fed=fed)
    state = exp.algo.init_state()
    slots = [{k: v + i for k, v in state["global"].items()} for i in range(4)]
    state = {**state, "slots": slots}
    from fedfuse.algorithms.base import RoundInfo

    info = RoundInfo(index=1, total=2)
    sent = exp.algo.configure_fit(state, info, [0, 1, 2, 3])
    replies = {c: Message(sent[c].tensors, {"slot": sent[c].meta["slot"]}, FitStats(num_examples=5)) for c in (0, 1, 3)}
    new = exp.algo.aggregate_fit(state, info, replies)
    # recombination permutes layers among the 4 slots: slot 2's layers survive (nothing is lost or duplicated)
    first = next(k for k in state["global"] if state["global"][k].is_floating_point())
    offsets = sorted(round(float((s[first] - state["global"][first]).flatten()[0])) for s in new["slots"])
    assert offsets == [0, 1, 2, 3]


def _poison_when(exp: Experiment, bad) -> None:
    """Make the algorithm's fusion return a NaN model whenever ``bad(exp)`` holds (a stand-in for an lr that
    makes training blow up)."""
    fuse = exp.algo.aggregate_fit

    def aggregate_fit(state, info, results):
        new = fuse(state, info, results)
        if bad(exp):
            new = {**new, "global": {k: v * math.nan if v.is_floating_point() else v for k, v in new["global"].items()}}
        return new

    exp.algo.aggregate_fit = aggregate_fit


def test_divergence_stops_and_keeps_the_last_good_checkpoint(tmp_path, fed):
    out = tmp_path / "r"
    exp = experiment(_cfg(rounds=4, eval_every=1, out=str(out)), fed=fed)
    _poison_when(exp, lambda e: len(e.history) == 2)  # the third round
    with pytest.raises(DivergenceError, match=r"diverged in round 3: the global model holds non-finite") as e:
        exp.run()
    assert "after round 2" in str(e.value) and "Lower --lr" in str(e.value)
    ck = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ck["round"] == 2 and all(torch.isfinite(v).all() for v in ck["state"]["global"].values())
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2  # the diverged round is not reported


def test_rollback_halves_the_lr_until_the_round_is_finite(tmp_path, fed):
    out = tmp_path / "r"
    exp = experiment(_cfg(lr=80.0, rounds=3, on_divergence="rollback", out=str(out)), fed=fed)
    _poison_when(exp, lambda e: e.ctx.train.lr > 10)
    exp.run()
    assert exp.ctx.train.lr == 10.0 and exp.history[0]["rollbacks"] == 3 and len(exp.history) == 3
    assert all(torch.isfinite(v).all() for v in _global(exp).values() if v.is_floating_point())
    # the halved lr is part of the checkpoint, so a resume continues with it
    assert torch.load(out / "checkpoint.pt", weights_only=False)["lr"] == 10.0


def test_nan_client_without_update_checks_stops_the_run(fed, capsys, tmp_path):
    from fedfuse.cli import main

    argv = ["run", "--clients", "4", "--clients-per-round", "4", "--rounds", "2", "--model", "mlp", "--set",
            "widths=[16]", "--set", "check_updates=false", "--set", "corrupt=nan", "--set", "corrupt_clients=[0]",
            "--set", "plots=false", "--no-progress", "--out", str(tmp_path / "r")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedfuse: error: the run diverged in round 1") and len(err.splitlines()) == 1
