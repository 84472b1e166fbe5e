"""Conformance: every registered algorithm runs the same under every executor.

For each algorithm ``fedfuse list`` names (bundled digits, 2 rounds, on the first tiny model that has what the
algorithm declares it ``requires``: a 64-16-10 MLP, or a BatchNorm ResNet for FedBN; Simple-FedMA and the LoRA
algorithms need a transformer, so they run on generated token sequences):

- ``processes`` equals ``sequential`` exactly (same seeds, same single-threaded kernels, other processes);
- ``batched`` equals ``sequential`` within float tolerance: losses to a relative 1e-4, accuracies to 2 %
  (a parameter difference of 1e-7 may flip a borderline prediction of a 180-sample test set);
- bytes, FLOPs, trained/communicated parameter counts and the sampled clients are *equal* everywhere;
- client order does not matter and the seed determines the run: the batched executor handed the jobs in
  reverse order reproduces its own run bit for bit;
- killed after a checkpoint and resumed from its directory, every algorithm writes the uninterrupted run's
  metrics bit for bit (batched executor).
"""

from __future__ import annotations

import json
import math

import pytest

import support
from fedfuse.algorithms import ALGORITHMS
from fedfuse.algorithms.base import RoundInfo
from fedfuse.config import RunConfig, apply
from fedfuse.engine.loop import strip_timing
from fedfuse.executors.batched import BatchedExecutor
from fedfuse.runner import experiment
from golden.make_golden import token_federation
from support import BF16_ACC_ATOL, BF16_LOSS_RTOL, EXACT, LORA
from support import conformance_cfg as _cfg
from support import conformance_close as _assert_close_history
from support import conformance_fed as _fed
from support import conformance_run as _run


class ReversedBatched(BatchedExecutor):
    """The batched executor, handed every round's jobs in reverse client order."""

    def fit(self, target, jobs):
        return super().fit(target, list(reversed(list(jobs))))

    def map(self, fn, jobs):
        return super().map(fn, list(reversed(list(jobs))))


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_executor_gives_the_same_run(algorithm):
    seq = _run(algorithm, "sequential")
    proc = _run(algorithm, "processes")
    assert [strip_timing(h) for h in proc.history] == [strip_timing(h) for h in seq.history]
    bat = _run(algorithm, "batched")
    _assert_close_history(seq.history, bat.history, f"{algorithm} batched vs sequential")
    rev = _run(algorithm, "batched", ReversedBatched(bat.fed.clients, bat.cfg.seed))
    assert [strip_timing(h) for h in rev.history] == [strip_timing(h) for h in bat.history]
    for key in ("global", "personal"):
        assert seq.summary()["final"].get(f"{key}_accuracy") == proc.summary()["final"].get(f"{key}_accuracy")




@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_bf16_runs_under_every_executor(algorithm):
    """``precision=bf16`` (one round): autocast reaches the training step of every executor — ``processes``
    equals ``sequential`` bit for bit and both differ from the fp32 run where anything was trained; ``batched``
    agrees within bf16 tolerance; the summary reports the precision."""
    seq = _run(algorithm, "sequential", precision="bf16", rounds=1)
    assert seq.summary()["precision"] == "bf16"
    proc = _run(algorithm, "processes", precision="bf16", rounds=1)
    assert [strip_timing(h) for h in proc.history] == [strip_timing(h) for h in seq.history]
    bat = _run(algorithm, "batched", precision="bf16", rounds=1)
    def close(k: str, va, vb) -> None:
        where = f"{algorithm} bf16 batched: {k} {va} vs {vb}"
        if isinstance(va, dict) and isinstance(vb, dict) and not any(t in k for t in EXACT):
            assert va.keys() == vb.keys(), where
            for kk in va:
                close(k, va[kk], vb[kk])
        elif any(t in k for t in EXACT) or not isinstance(va, float) or not isinstance(vb, float):
            assert va == vb, where
        elif "accuracy" in k:
            assert abs(va - vb) <= BF16_ACC_ATOL, where
        elif not math.isnan(va):
            assert vb == pytest.approx(va, rel=BF16_LOSS_RTOL, abs=1e-3), where

    for a, b in zip(seq.history, bat.history, strict=True):
        a, b = strip_timing(a), strip_timing(b)
        assert a.keys() == b.keys()
        for k, va in a.items():
            close(k, va, b[k])
    fp32 = _run(algorithm, "sequential", rounds=1)
    assert fp32.summary()["precision"] == "fp32"
    losses = [(h.get("train_loss"), f.get("train_loss")) for h, f in zip(seq.history, fp32.history, strict=True)]
    trained = [(a, b) for a, b in losses if a is not None and b is not None and not math.isnan(a)]
    if trained:  # bf16 products change the trained model: autocast was in effect in the training step
        assert any(a != b for a, b in trained), f"{algorithm}: bf16 training loss equals fp32"


def test_declared_programs_are_batched_not_fallen_back():
    """The standard step (FedAvg, FedAvg-FT, FedExP, FedMR, FedMut), FedProx, the two-pass (A)SAM step, FedMerge
    (a delta reply, an optional proximal term), IFCA (client-side choice, then the standard step) and the width
    slices of HeteroFL/FedRolex (sub-models, masked logits) and MSfusion (peer-assembled sub-models, a contrastive
    term on frozen models' features), D-PSGD (gossip average, then the standard step), Dis-PFL (gradient masks,
    a finalize that continues the client's generator), Local, FedMA (frozen matched layers, per-stage
    retraining specs), pFedMoE (a mixture module with an untrained expert head) and Simple-FedMA (the standard step
    on a transformer, distinct initialisations in round 0), the one-shot and ensemble baselines' local models and
    Fed-ET's small models, FedEM's M learners (one stacked module, a responsibility-weighted objective) and
    FedGen's step (a frozen generator in the loss, its noise drawn up front as per-step constants) really run
    vmapped."""
    for algorithm in ("fedavg", "fedprox", "fedmr", "fedmut", "fedexp", "fedavg-ft", "fedsam", "fedasam", "fedmerge",
                      "ifca", "heterofl", "fedrolex", "msfusion", "dpsgd", "dispfl", "local", "fedma", "pfedmoe",
                      "simple-fedma", "oneshot-avg", "oneshot-match", "ensemble", "fedet", "fedem", "fedgen"):
        exp = _run(algorithm, "batched")
        assert exp.executor.fallbacks == {}, (algorithm, exp.executor.fallbacks)


@pytest.mark.parametrize("algorithm", ["fedit", "fedlora", "local-lora", "fedmerge-lora", "fedem-lora"])
def test_lora_adapter_programs_run_vmapped_on_a_shared_base(algorithm, monkeypatch):
    """The LoRA algorithms declare adapter-only programs on the shared frozen base (``init`` = the adapter; the
    template's other entries are the base): without
    dropout they train batched (one base for all clients, adapters stacked) and match the sequential run; the
    programs' state is the adapter alone."""
    pytest.importorskip("peft", reason="needs the lora extra: pip install -e '.[lora]'")

    def no_dropout(algorithm: str, executor: str) -> RunConfig:
        cfg = _BASE_CFG(algorithm, executor)
        return apply(cfg, {"algorithm_options": {**cfg.algorithm_options, "lora_dropout": 0.0}})

    monkeypatch.setattr(support, "conformance_cfg", no_dropout)  # conformance_run reads it there
    seq, bat = _run(algorithm, "sequential"), _run(algorithm, "batched")
    assert bat.executor.fallbacks == {}
    _assert_close_history(seq.history, bat.history, f"{algorithm} batched vs sequential")
    fed = bat.fed
    prog = bat.algo.client_program(bat.algo.configure_fit(bat.state, RoundInfo(0, 1), [0])[0], None, fed.clients[0])
    assert set(prog.init) == set(prog.trainable) and set(prog.init) < set(prog.model.state_dict())
    if algorithm == "fedem-lora":  # M adapters as one stack, each adapter's tensors once
        M, keys = int(bat.algo.opt.m), bat.algo.am.keys
        assert len(prog.init) == M * len(keys)
        assert not any(k.startswith("base.") for k in prog.init)
    else:
        assert set(prog.init) == set(bat.algo.am.keys)


_BASE_CFG = _cfg


class _Killed(Exception):
    pass


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_resumes_bit_identically(algorithm, tmp_path):
    """Killed after round 2 of 3 (checkpoint every round) and resumed from its directory, every algorithm under
    the batched executor writes the same metrics as the uninterrupted run — server state, client states, peer
    messages and every random stream are in the checkpoint."""
    from fedfuse.config import load_yaml

    lm = algorithm == "simple-fedma" or algorithm in LORA
    if algorithm in LORA:
        pytest.importorskip("peft", reason="needs the lora extra: pip install -e '.[lora]'")
    fed = _fed(algorithm) or (token_federation() if lm else None)

    def cfg(out) -> RunConfig:
        return apply(_cfg(algorithm, "batched"), dict(rounds=3, eval_every=1, checkpoint_every=1, out=str(out)))

    full = experiment(cfg(tmp_path / "a"), fed=fed)
    full.run()
    fed = full.fed

    def kill(rec: dict) -> None:
        if rec["round"] == 2:
            raise _Killed

    with pytest.raises(_Killed):
        experiment(cfg(tmp_path / "b"), fed=fed, on_round=kill).run()
    resumed = experiment(apply(RunConfig(), load_yaml(tmp_path / "b" / "config.yaml")), fed=fed)
    resumed.run(resume=True)
    ma = [strip_timing(json.loads(x)) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    mb = [strip_timing(json.loads(x)) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert len(ma) == 3 and ma == mb
