"""Central DP (DP-FedAvg): clipping bound, noise scale, the accountant against dp-accounting called directly,
adaptive clipping's fixed point, BatchNorm buffers, and determinism of a DP run across executors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedfuse.config import ConfigError, RunConfig, apply, validate
from fedfuse.engine.loop import strip_timing
from fedfuse.fusion.privacy import adapt_clip, dp_mean, update_noise_multiplier, update_norm
from fedfuse.privacy.dp import central_epsilon, noise_for_epsilon
from fedfuse.runner import experiment


def _base() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(3, 4), "bn.running_mean": torch.zeros(4), "bn.num_batches_tracked": torch.tensor(7)}


def _client(scale: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g) * scale, "bn.running_mean": torch.randn(4, generator=g) * scale,
            "bn.num_batches_tracked": torch.tensor(7 + seed)}


def test_each_update_is_clipped_to_the_norm_and_small_ones_are_kept() -> None:
    base, gen = _base(), torch.Generator().manual_seed(0)
    big, small = _client(10.0, 1), _client(0.01, 2)
    assert update_norm(big, base) > 5 and update_norm(small, base) < 0.5
    for s in (big, small):
        out, rec = dp_mean([s], base, clip=0.5, noise_multiplier=0.0, denominator=1, gen=gen)
        norm = update_norm(out, base)
        assert norm == pytest.approx(min(0.5, update_norm(s, base)), rel=1e-6)
        cos = sum(float((out[k] * s[k]).sum()) for k in ("w", "bn.running_mean")) / (norm * update_norm(s, base))
        assert cos == pytest.approx(1.0, abs=1e-6)  # clipping scales, never turns
        assert rec.clipped == int(s is big)
        assert int(out["bn.num_batches_tracked"]) == 7  # not released: the server keeps its counter
    out, _ = dp_mean([big, small], base, clip=0.5, noise_multiplier=0.0, denominator=4, gen=gen)
    expect = {k: (big[k] * (0.5 / update_norm(big, base)) + small[k]) / 4 for k in ("w", "bn.running_mean")}
    for k, v in expect.items():  # the fixed denominator m, whoever replied
        assert torch.allclose(out[k], v, atol=1e-6)


def test_noise_std_on_the_mean_is_z_c_over_m() -> None:
    z, c, m = 1.3, 0.7, 10
    base = {"w": torch.zeros(400, 500), "bn.running_var": torch.ones(50_000), "n": torch.tensor(3)}
    states = [dict(base) for _ in range(4)]  # zero updates: what comes out is the noise alone
    out, rec = dp_mean(states, base, clip=c, noise_multiplier=z, denominator=m,
                       gen=torch.Generator().manual_seed(123))
    assert rec.noise_std == pytest.approx(z * c / m)
    for k in ("w", "bn.running_var"):  # BN statistics are noised like parameters (documented choice)
        noise = (out[k] - base[k]).double().flatten()
        se = 1 / math.sqrt(2 * noise.numel())  # relative standard error of a sample std
        assert float(noise.std()) == pytest.approx(z * c / m, rel=5 * se)
        assert abs(float(noise.mean())) < 5 * z * c / m / math.sqrt(noise.numel())
    assert torch.equal(out["n"], base["n"])
    again, _ = dp_mean(states, base, clip=c, noise_multiplier=z, denominator=m, gen=torch.Generator().manual_seed(123))
    assert all(torch.equal(out[k], again[k]) for k in out)  # the seed fixes the noise


def test_adaptive_noise_split_composes_to_z() -> None:
    z, sb = 1.0, 5.0
    zd = update_noise_multiplier(z, sb)
    assert (zd ** -2 + (2 * sb) ** -2) ** -0.5 == pytest.approx(z) and zd > z
    with pytest.raises(ValueError, match="2σ_b > z"):
        update_noise_multiplier(2.0, 0.5)


def test_adaptive_clip_converges_to_the_quantile() -> None:
    """100 clients whose update norms are 1, 2, ..., 100: the 0.3-quantile is 30."""
    base = {"w": torch.zeros(2)}
    states = [{"w": torch.tensor([float(n), 0.0])} for n in range(1, 101)]
    clip, gen, seen = 0.1, torch.Generator().manual_seed(0), []
    for _ in range(400):
        _, rec = dp_mean(states, base, clip=clip, noise_multiplier=0.0, denominator=100, gen=gen,
                         quantile=0.3, clip_lr=0.2)
        clip = rec.next_clip
        seen.append(clip)
    assert all(29.0 <= c <= 31.5 for c in seen[-50:]), seen[-5:]
    assert adapt_clip(1.0, 0.9, 0.5, 0.2) < 1.0 < adapt_clip(1.0, 0.1, 0.5, 0.2)  # too many fit → shrink


@pytest.mark.parametrize("sampling", ["poisson", "uniform"])
def test_epsilon_is_the_library_s(sampling: str) -> None:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    z, n, m, rounds, delta = 1.1, 1000, 50, 40, 1e-5
    if sampling == "poisson":
        one = dp_accounting.PoissonSampledDpEvent(m / n, dp_accounting.GaussianDpEvent(z))
        rel = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    else:  # replace-one: the sum's sensitivity is 2C, so the Gaussian's multiplier is z/2
        one = dp_accounting.SampledWithoutReplacementDpEvent(n, m, dp_accounting.GaussianDpEvent(z / 2))
        rel = dp_accounting.NeighboringRelation.REPLACE_ONE
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=rel)
    acc.compose(dp_accounting.SelfComposedDpEvent(one, rounds))
    assert central_epsilon(z, n, m, sampling, rounds, delta) == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    if sampling == "poisson":
        pld = pld_privacy_accountant.PLDAccountant(neighboring_relation=rel)
        pld.compose(dp_accounting.SelfComposedDpEvent(one, rounds))
        assert central_epsilon(z, n, m, sampling, rounds, delta, "pld") == pytest.approx(pld.get_epsilon(delta))
    eps = [central_epsilon(z, n, m, sampling, r, delta) for r in (1, 10, 40)]
    assert eps[0] < eps[1] < eps[2]  # composition only spends
    assert central_epsilon(0.0, n, m, sampling, 1, delta) == math.inf
    target = noise_for_epsilon(4.0, n, m, sampling, rounds, delta)
    assert central_epsilon(target, n, m, sampling, rounds, delta) <= 4.0 < central_epsilon(
        target * 0.99, n, m, sampling, rounds, delta)


def _cfg(tmp_path, **kw) -> RunConfig:
    base = dict(dataset="digits", partition="dirichlet", model="mlp", clients=20, clients_per_round=5, rounds=3,
                batch_size=32, lr=0.05, seed=3, out=str(tmp_path / "run"), plots=False, model_options={"widths": [16]},
                partition_options={"alpha": 0.5, "min_size": 20}, dp="central", dp_noise=0.8, dp_clip=0.5,
                sampling="poisson")
    base.update(kw)
    return apply(RunConfig(), base)


def test_a_dp_run_reports_epsilon_and_is_the_same_under_every_executor(tmp_path) -> None:
    """In the research mode (noise and sampling from the run seed, no guarantee) a DP run repeats bit for bit."""
    runs, models = {}, {}
    for ex in ("sequential", "processes", "batched"):
        exp = experiment(_cfg(tmp_path / ex, executor=ex, algorithm="fedprox", dp_quantile=0.5,
                              dp_count_noise=1.0, dp_reproducible=True))
        exp.run()
        runs[ex] = [strip_timing(json.loads(line)) for line in (tmp_path / ex / "run" / "metrics.jsonl").open()]
        models[ex] = exp.algo.global_model(exp.state)[0]
    assert runs["sequential"] == runs["processes"]  # the noise is the server's, seeded from the run seed
    for k, v in models["sequential"].items():  # batched training differs from sequential by float rounding only
        assert torch.allclose(v.double(), models["batched"][k].double(), atol=1e-4), k
    recs = runs["sequential"]
    for r, rec in enumerate(recs, 1):
        assert rec["dp_epsilon"] == pytest.approx(central_epsilon(0.8, 20, 5, "poisson", r, 1e-5))
        assert rec["dp_noise_std"] == pytest.approx(update_noise_multiplier(0.8, 1.0) * rec["dp_clip_used"] / 5)
    assert recs[1]["dp_clip_used"] == pytest.approx(recs[0]["dp_clip"])  # the adapted clip is used next round
    summary = json.loads((tmp_path / "sequential" / "run" / "summary.json").read_text())
    assert summary["final"]["dp_epsilon"] == pytest.approx(recs[-1]["dp_epsilon"])
    assert summary["dp_guarantee"] is False and "no privacy guarantee" in summary["dp_warning"]
    assert all(rec["dp_guarantee"] is False for rec in recs)


def test_dp_runs_differ_from_plain_ones_and_from_another_seed(tmp_path) -> None:
    def final(**kw):
        exp = experiment(_cfg(tmp_path / str(len(list(tmp_path.iterdir()))), **kw))
        exp.run()
        return exp.algo.global_model(exp.state)[0]

    plain, noised, other = final(dp="none"), final(), final(seed=4)
    assert any(not torch.equal(plain[k], noised[k]) for k in plain)
    assert any(not torch.equal(noised[k], other[k]) for k in noised)


def test_central_dp_config_errors() -> None:
    ok = dict(algorithm="fedavg", dp="central")
    with pytest.raises(ConfigError, match="pld covers Poisson"):
        validate(apply(RunConfig(), {**ok, "dp_accountant": "pld"}))
    with pytest.raises(ConfigError, match="central DP is accounted for sampling"):
        validate(apply(RunConfig(), {**ok, "sampling": "size-weighted"}))
    with pytest.raises(ConfigError, match="2σ_b > z"):
        validate(apply(RunConfig(), {**ok, "dp_quantile": 0.5, "dp_noise": 1.0, "clients_per_round": 5}))
    with pytest.raises(ConfigError, match="fusion='median' / clip_norm=0 read each client's update; drop them"):
        experiment(apply(RunConfig(), {**ok, "algorithm_options": {"fusion": "median"}, "out": None,
                                       "rounds": 1, "clients": 4, "clients_per_round": 2}))
