"""Local DP (dp=local): DP-SGD through Opacus on the clients — per-sample clipping bounds the step, the noise is
seeded, BatchNorm models are refused with Opacus's reason, and the run reports ε from Opacus's accountant."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

pytest.importorskip("opacus", reason="needs the dp extra: pip install -e '.[dp]'")

from fedfuse.config import ConfigError, RunConfig, apply
from fedfuse.engine.client import TrainConfig
from fedfuse.engine.local_dp import check_local_dp, local_epsilon, sample_rate, train_dp_sgd
from fedfuse.runner import experiment
from fedfuse.types import Split


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _split(n: int = 12) -> Split:
    g = torch.Generator().manual_seed(1)
    return Split(torch.randn(n, 6, generator=g) * 5, torch.randint(0, 3, (n,), generator=g))


def _dist(a: dict, b: dict) -> float:
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a)) ** 0.5


def test_per_sample_clipping_bounds_the_step() -> None:
    """Noise 0, every example in the (rate-1) batch: one SGD step moves the model by lr·‖mean of clipped
    per-sample gradients‖ ≤ lr·C, and by less than the unclipped step."""
    model, split = _model(), _split()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = TrainConfig(local_epochs=1, batch_size=len(split), lr=1.0)
    for clip in (1e-3, 1e-2):
        after, stats = train_dp_sgd(model, split, cfg, torch.Generator().manual_seed(0), noise=0.0, clip=clip)
        assert stats.steps == 1 and stats.samples == len(split)
        assert 0 < _dist(after, before) <= clip * 1.0 + 1e-7
    assert all(torch.equal(before[k], model.state_dict()[k]) for k in before)  # the caller's module is untouched
    big, _ = train_dp_sgd(model, split, cfg, torch.Generator().manual_seed(0), noise=0.0, clip=1e6)
    small, _ = train_dp_sgd(model, split, cfg, torch.Generator().manual_seed(0), noise=0.0, clip=1e-2)
    assert _dist(big, before) > _dist(small, before)


def test_noise_is_seeded_and_scales_with_z() -> None:
    model, split = _model(), _split()
    cfg = TrainConfig(local_epochs=1, batch_size=len(split), lr=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def run(z: float, seed: int) -> dict:
        torch.manual_seed(5)  # the batch sampling's global stream, as the executors seed it
        return train_dp_sgd(model, split, cfg, torch.Generator().manual_seed(seed), noise=z, clip=0.1)[0]

    a, b, c = run(1.0, 7), run(1.0, 7), run(1.0, 8)
    assert all(torch.equal(a[k], b[k]) for k in a) and any(not torch.equal(a[k], c[k]) for k in a)
    # the noise std on the mean gradient is z·C/B per coordinate: with zero signal the move is dominated by it
    d = sum(v.numel() for v in before.values())
    noisy = _dist(run(50.0, 9), before)
    assert noisy == pytest.approx(50.0 * 0.1 / len(split) * d ** 0.5, rel=0.25)


def test_batchnorm_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="BatchNorm cannot support training with differential privacy"):
        check_local_dp(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))
    check_local_dp(_model())
    with pytest.raises(ConfigError, match=r"dp=local: Opacus cannot clip per-sample gradients"):
        experiment(apply(RunConfig(), dict(dataset="digits", model="resnet9", clients=4, clients_per_round=2,
                                           rounds=1, dp="local", out=None)))


def _wrapped_and_by_hand(exp, info):
    """(payload, reply, state, stats): client 0's payload in round ``info``, its reply through the engine's wrapped
    step, and DP-SGD's state and stats by hand from the same payload, data and seeds (noise 1.1, clip 1.0)."""
    algo, data = exp.algo, exp.fed.blinded().clients[0]
    payload = algo.configure_fit(exp.state, info, [0])[0]
    torch.manual_seed(5)
    reply, _ = exp.client.fit(payload, None, data, torch.Generator().manual_seed(7))
    torch.manual_seed(5)
    state, stats = train_dp_sgd(algo.ctx.load(payload.tensors, payload.meta), data.train, algo.ctx.train,
                                torch.Generator().manual_seed(7), noise=1.1, clip=1.0)
    return payload, reply, state, stats


def test_a_local_dp_run_reports_opacus_epsilon(tmp_path) -> None:
    cfg = apply(RunConfig(), dict(dataset="digits", partition="iid", model="mlp", clients=6, clients_per_round=3,
                                  rounds=3, batch_size=16, lr=0.1, seed=2, out=str(tmp_path / "run"), plots=False,
                                  model_options={"widths": [16]}, dp="local", dp_noise=1.1, dp_clip=1.0))
    exp = experiment(cfg)
    exp.run()
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    sizes = exp.ctx.client_sizes
    steps: dict[int, int] = {}
    for rec in recs:
        for c in rec["clients"]:
            n = int(sizes[c])
            steps[c] = steps.get(c, 0) + cfg.local_epochs * round(1 / sample_rate(n, 16))
        eps = [local_epsilon(1.1, sample_rate(int(sizes[c]), 16), s, 1e-5) for c, s in steps.items()]
        assert rec["dp_epsilon"] == pytest.approx(max(eps)) and rec["dp_clients"] == len(steps)
    assert recs[0]["dp_epsilon"] <= recs[-1]["dp_epsilon"]
    assert 0 < recs[-1]["global_accuracy"] <= 1
    again = experiment(apply(cfg, {"out": str(tmp_path / "again")}))
    again.run()
    assert all(torch.equal(v, again.state["global"][k]) for k, v in exp.state["global"].items())


def test_local_dp_is_refused_where_the_client_step_is_not_plain_sgd() -> None:
    with pytest.raises(ConfigError, match="'fedprox' does not admit local DP"):
        experiment(apply(RunConfig(), dict(algorithm="fedprox", dp="local", out=None)))


def test_fedmr_uploads_dp_sgd_models(tmp_path) -> None:
    """dp=local on FedMR (a family that needs individual models on the server): the client step is Opacus
    DP-SGD — the reply equals train_dp_sgd's model for the same seeds — and the run reports each client's ε."""
    from fedfuse.engine.context import RoundInfo
    from fedfuse.engine.local_dp import LocalDPClient

    cfg = apply(RunConfig(), dict(algorithm="fedmr", dataset="digits", partition="iid", model="mlp", clients=6,
                                  clients_per_round=3, rounds=2, batch_size=16, lr=0.1, seed=2, plots=False,
                                  out=str(tmp_path / "run"), model_options={"widths": [16]}, dp="local",
                                  dp_noise=1.1, dp_clip=1.0))
    exp = experiment(cfg)
    exp.run()
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert 0 < recs[0]["dp_epsilon"] <= recs[-1]["dp_epsilon"] < float("inf") and recs[-1]["dp_clients"] >= 3
    algo, data, client = exp.algo, exp.fed.blinded().clients[0], exp.client
    assert isinstance(client, LocalDPClient) and client.inner is algo  # the engine wraps the algorithm's step
    payload, reply, state, stats = _wrapped_and_by_hand(exp, RoundInfo(index=2, total=3))
    assert set(reply.tensors) == set(state) and all(torch.equal(reply.tensors[k], v) for k, v in state.items())
    assert reply.stats is not None and reply.stats.steps == stats.steps > 0
    assert client.client_program(payload, None, data) is None  # every executor calls fit (DP-SGD)
    assert algo.client_program(payload, None, data) is not None  # FedMR itself holds no DP code: a plain program


def test_secure_fedmr_trains_with_dp_sgd_in_its_first_stage(tmp_path) -> None:
    """secure=true + dp=local: stage 0 trains with DP-SGD (steps are accounted), the exchange stages train nothing."""
    cfg = apply(RunConfig(), dict(algorithm="fedmr", dataset="digits", partition="iid", model="mlp", clients=6,
                                  clients_per_round=3, rounds=2, batch_size=16, lr=0.1, seed=2, plots=False,
                                  out=str(tmp_path / "run"), model_options={"widths": [16]}, dp="local",
                                  dp_noise=1.1, dp_clip=1.0, algorithm_options={"secure": True}))
    exp = experiment(cfg)
    exp.run()
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    sizes = exp.ctx.client_sizes
    steps: dict[int, int] = {}
    for rec in recs:  # one epoch of DP-SGD per sampled client and round: the exchange stages add no steps
        for c in rec["clients"]:
            steps[c] = steps.get(c, 0) + exp.ctx.train.local_epochs * round(1 / sample_rate(int(sizes[c]), 16))
        eps = [local_epsilon(1.1, sample_rate(int(sizes[c]), 16), s, 1e-5) for c, s in steps.items()]
        assert rec["dp_epsilon"] == pytest.approx(max(eps))
    assert exp.local_dp_steps == steps


def test_a_secure_generator_is_not_reproducible_from_any_seed() -> None:
    """Two :func:`secure_generator` draws differ, and DP-SGD with one (Opacus secure mode: noise and Poisson batches
    from it) gives a different model each time from the same seeds, where the seeded generator repeats exactly."""
    from fedfuse.engine.executor import Job, seed_global
    from fedfuse.engine.local_dp import is_secure, secure_generator

    a, b = secure_generator(), secure_generator()
    assert is_secure(a) and not is_secure(torch.Generator())
    draws = torch.randn(20000, generator=a)
    assert not torch.equal(draws[:8], torch.randn(8, generator=b))
    assert abs(float(draws.mean())) < 0.05 and abs(float(draws.std()) - 1) < 0.05  # still N(0, 1)
    cfg = TrainConfig(local_epochs=1, batch_size=4, lr=0.5)

    def step(gen: torch.Generator) -> dict:
        seed_global(0, Job(0, None, None, ("fit", 0, 0)))  # the job's seeds, as every executor sets them
        return train_dp_sgd(_model(), _split(), cfg, gen, noise=1.0, clip=1.0)[0]

    assert _dist(step(torch.Generator().manual_seed(3)), step(torch.Generator().manual_seed(3))) == 0.0
    assert _dist(step(secure_generator()), step(secure_generator())) > 0.1


@pytest.mark.parametrize("epochs,batch,cap", [(1, 4, 0), (3, 5, 0), (2, 12, 0), (3, 4, 4), (2, 100, 0)])
def test_planned_steps_are_the_steps_dp_sgd_takes(epochs, batch, cap) -> None:
    """What a device charges before training (local_epochs · ⌈n/B⌉, capped by max_steps over the whole client
    step) is exactly what :func:`train_dp_sgd` then takes, empty Poisson batches included."""
    from fedfuse.engine.local_dp import planned_steps

    cfg = TrainConfig(local_epochs=epochs, batch_size=batch, lr=0.1, max_steps=cap)
    _, stats = train_dp_sgd(_model(), _split(12), cfg, torch.Generator().manual_seed(0), noise=1.0, clip=1.0)
    assert stats.steps == planned_steps(12, cfg)


# ---- local DP as a wrapper of the client step (LocalDPClient) -----------------------------------------------------
def _small(algorithm: str, tmp_path, **kw):
    base = dict(dataset="digits", partition="iid", model="mlp", clients=6, clients_per_round=3, rounds=1,
                batch_size=16, lr=0.1, seed=2, plots=False, out=str(tmp_path / algorithm),
                model_options={"widths": [16]}, algorithm=algorithm)
    cfg = apply(RunConfig(), {**base, **kw})
    return experiment(cfg)


@pytest.mark.parametrize("algorithm", ["fedavgm", "fedadam"])
def test_a_server_optimiser_admits_local_dp_by_its_plain_client_step(tmp_path, algorithm) -> None:
    """FedAvgM and FedAdam hold no DP code: the engine wraps their declared step, whose reply is DP-SGD's model for
    the same seeds, under the batched executor too (it declares no program, so every executor calls fit)."""
    from fedfuse.engine.context import RoundInfo
    from fedfuse.engine.local_dp import LocalDPClient

    exp = _small(algorithm, tmp_path, dp="local", dp_noise=1.1, dp_clip=1.0, executor="batched")
    exp.run()
    rec = json.loads((tmp_path / algorithm / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < rec["dp_epsilon"] < float("inf")
    client, data = exp.client, exp.fed.blinded().clients[0]
    assert isinstance(client, LocalDPClient) and client.client_program(None, None, data) is None
    _, reply, state, _ = _wrapped_and_by_hand(exp, RoundInfo(index=1, total=2))
    assert all(torch.equal(reply.tensors[k], v) for k, v in state.items())


def test_the_wrapper_refuses_a_step_that_is_more_than_plain_sgd(tmp_path) -> None:
    """A program with a loss term (FedProx's proximal term) or an opaque fit that trains (Ditto's) is refused with
    what makes it more, never trained with DP-SGD on part of its loss or outside DP-SGD."""
    from fedfuse.engine.context import RoundInfo
    from fedfuse.engine.local_dp import LocalDPClient, beyond_plain_sgd
    from fedfuse.errors import UserError

    for algorithm, why in (("fedprox", "loss terms proximal"), ("ditto", "trained outside DP-SGD")):
        exp = _small(algorithm, tmp_path)
        algo, data = exp.algo, exp.fed.blinded().clients[0]
        payload = algo.configure_fit(algo.init_state(), RoundInfo(index=0, total=1), [0])[0]
        with pytest.raises(UserError, match=why):
            LocalDPClient(algo, 1.0, 1.0).fit(payload, algo.init_client_state(0), data, torch.Generator())
    prog = _small("fedavg", tmp_path).algo.client_program(payload, None, data)
    assert beyond_plain_sgd(prog) == []
    assert beyond_plain_sgd(dataclasses.replace(prog, spec=prog.spec.with_two_pass("sam", 0.05))) == \
        ["sam two-pass steps"]


def test_the_wrapped_step_runs_in_worker_processes_as_in_process(tmp_path) -> None:
    """The wrapper travels to the process executor's workers (fork, or pickled under spawn) and their DP-SGD
    replies equal the sequential executor's bit for bit (the noise is seeded per client step in process)."""
    import pickle

    from fedfuse.engine.local_dp import LocalDPClient

    kw = dict(dp="local", dp_noise=1.1, dp_clip=1.0, rounds=2)
    seq = _small("fedavgm", tmp_path / "seq", **kw)
    seq.run()
    pro = _small("fedavgm", tmp_path / "pro", executor="processes", **kw)
    pro.run()
    assert all(torch.equal(v, pro.state["global"][k]) for k, v in seq.state["global"].items())
    again = pickle.loads(pickle.dumps(seq.client))
    assert isinstance(again, LocalDPClient) and (again.noise, again.clip) == (1.1, 1.0) and again.name == "fedavgm"
