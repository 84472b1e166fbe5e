"""Central DP attacked as each party it protects against would attack it.

* A reader of the run directory or records (who knows the seed from config.yaml) regenerates the noise the way
  fedfuse drew it before it came from the OS, and subtracts it from a released model: it recovers nothing.
* The same config and seed, run twice, release different models (nothing about the noise or the sampling is a
  function of what is written down); the research mode that keeps runs bit-reproducible says it has no guarantee.
* Whoever resumes a DP run cannot rewrite its accounting: a changed sampling, noise or δ is refused, and ε composes
  the rounds the checkpoint stored.
* The round records publish nothing un-noised about individual clients (ids, counts, the clipped count, the
  training loss) unless the run is marked as having no guarantee.
* Every round releases a noised aggregate, also when nobody replied; an absent client is not replaced.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import fedfuse.privacy.central as central_module
from fedfuse.config import ConfigError, RunConfig, apply, validate
from fedfuse.engine.privacy_account import DP_WITHHELD, DP_WITHHELD_PREFIXES
from fedfuse.fusion.privacy import noised_keys
from fedfuse.privacy.dp import DPSettings, events_epsilon, round_event
from fedfuse.rng import derive_seed
from fedfuse.runner import experiment


def _cfg(tmp_path, name: str = "run", **kw) -> RunConfig:
    base = dict(dataset="digits", partition="dirichlet", model="mlp", clients=20, clients_per_round=5, rounds=1,
                batch_size=32, lr=0.05, seed=3, out=str(tmp_path / name), plots=False, model_options={"widths": [16]},
                partition_options={"alpha": 0.5, "min_size": 20}, dp="central", dp_noise=1.0, dp_clip=0.5,
                sampling="poisson")
    base.update(kw)
    return apply(RunConfig(), base)


def _attack(tmp_path, monkeypatch, name: str, **kw) -> tuple[float, float]:
    """One DP round; the attacker regenerates the noise from config.yaml's seed as ``(seed, "dp-noise", round,
    stage)`` and subtracts it.  Returns (RMS error of the attack against the noiseless model the server computed,
    the noise std on the mean)."""
    seen: dict = {}
    inner = central_module.noised_mean

    def spy(base, clipped_sum, centred, **k):  # what the server held before noising: the noiseless mean
        seen["noiseless"] = {key: base[key].double() + clipped_sum[key].double() / k["denominator"]
                             for key in clipped_sum}
        return inner(base, clipped_sum, centred, **k)

    monkeypatch.setattr(central_module, "noised_mean", spy)
    exp = experiment(_cfg(tmp_path, name, **kw))
    exp.run()
    out = tmp_path / name
    seed = int(next(line.split(":")[1] for line in (out / "config.yaml").read_text().splitlines()
                    if line.startswith("seed:")))
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    released = torch.load(out / "model_final.pt", weights_only=True)["state"]
    std = rec["dp_noise_std"]
    gen = torch.Generator().manual_seed(derive_seed(seed, "dp-noise", 0, 0))  # the noise as the old code drew it
    err, count = 0.0, 0
    for key in noised_keys(released):
        guess = released[key].double() - torch.randn(released[key].shape, dtype=torch.float64, generator=gen) * std
        err += float(((guess - seen["noiseless"][key]) ** 2).sum())
        count += released[key].numel()
    return math.sqrt(err / count), std


def test_regenerating_the_noise_from_the_seed_recovers_nothing(tmp_path, monkeypatch) -> None:
    err, std = _attack(tmp_path, monkeypatch, "guarded")
    assert err > 0.9 * std  # the "denoised" model is as far from the truth as the released one (√2·std: two noises)
    # the same attack on the research mode, whose noise is the seed's: it removes the noise to float precision
    err_repro, std_repro = _attack(tmp_path, monkeypatch, "repro", dp_reproducible=True)
    assert std_repro > 0.01 and err_repro < 1e-6 * std_repro


def test_two_runs_of_one_config_and_seed_release_different_models(tmp_path) -> None:
    finals = []
    for name in ("a", "b"):
        exp = experiment(_cfg(tmp_path, name))
        exp.run()
        finals.append(torch.load(tmp_path / name / "model_final.pt", weights_only=True)["state"])
    assert all(not torch.equal(finals[0][k], finals[1][k]) for k in noised_keys(finals[0]))
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["dp_guarantee"] is True and "dp_warning" not in summary
    assert set(summary["totals"]) == {"wall_seconds", "cpu_seconds"}  # the totals that count clients are withheld too


def test_the_research_mode_repeats_and_says_it_has_no_guarantee(tmp_path) -> None:
    finals, recs = [], []
    for name in ("a", "b"):
        exp = experiment(_cfg(tmp_path, name, dp_reproducible=True, rounds=2))
        exp.run()
        finals.append(exp.algo.global_model(exp.state)[0])
        recs.append([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()])
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    assert all(r["dp_guarantee"] is False for r in recs[0])
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["dp_guarantee"] is False
    assert summary["dp_warning"].startswith("no privacy guarantee: dp_reproducible=true")


def test_the_records_withhold_what_touches_individual_clients(tmp_path) -> None:
    exp = experiment(_cfg(tmp_path, "guarded", rounds=2, dp_quantile=0.5, dp_count_noise=1.0, secagg=True))
    exp.run()
    for line in (tmp_path / "guarded" / "metrics.jsonl").open():
        rec = json.loads(line)
        assert not set(rec) & set(DP_WITHHELD), set(rec) & set(DP_WITHHELD)
        assert not any(k.startswith(DP_WITHHELD_PREFIXES) for k in rec)
        assert {"dp_epsilon", "dp_clip", "dp_unclipped_fraction", "dp_noise_std"} <= set(rec)
    exp = experiment(_cfg(tmp_path, "debug", rounds=2, dp_quantile=0.5, dp_count_noise=1.0, dp_debug_metrics=True))
    exp.run()
    recs = [json.loads(line) for line in (tmp_path / "debug" / "metrics.jsonl").open()]
    assert all({"clients", "dp_clipped", "train_loss"} <= set(r) and r["dp_guarantee"] is False for r in recs)
    summary = json.loads((tmp_path / "debug" / "summary.json").read_text())
    assert summary["dp_guarantee"] is False and "dp_debug_metrics" in summary["dp_warning"]


@pytest.mark.parametrize("change,value", [("sampling", "uniform"), ("dp_noise", 2.0), ("dp_delta", 1e-3),
                                          ("dp_reproducible", True), ("clients_per_round", 10)])
def test_a_tampered_resume_of_a_dp_run_is_refused(tmp_path, change, value) -> None:
    experiment(_cfg(tmp_path, rounds=2, checkpoint_every=1)).run()
    with pytest.raises(ConfigError, match=rf"^--resume: .* was written with {change}=.* but this run has "
                                          rf"{change}=.*privacy accounting"):
        experiment(_cfg(tmp_path, rounds=3, **{change: value})).run(resume=True)


def test_a_resumed_run_composes_the_stored_events(tmp_path) -> None:
    experiment(_cfg(tmp_path, rounds=2, sampling="uniform")).run()
    ck = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    events = ck["dp_events"]
    assert events == [round_event(1.0, 20, 5, "uniform", "rdp")] * 2
    assert all(type(v) in (int, float, str) for e in events for v in e.values())  # loadable with weights_only
    # the stored events, not today's settings, are what the resumed run composes: mark them (a fourth round
    # spent before, at a smaller noise) and the resumed ε includes it
    ck["dp_events"] = [*events, round_event(0.5, 20, 5, "uniform", "rdp")]
    torch.save(ck, tmp_path / "run" / "checkpoint.pt")
    experiment(_cfg(tmp_path, rounds=3, sampling="uniform")).run(resume=True)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["round"] for r in recs] == [1, 2, 3]
    stored = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["dp_events"]
    assert stored == [*ck["dp_events"], events[0]]
    assert recs[-1]["dp_epsilon"] == pytest.approx(events_epsilon(stored, 1e-5))
    assert recs[-1]["dp_epsilon"] > events_epsilon(events * 2, 1e-5)


def test_events_of_different_relations_do_not_compose() -> None:
    with pytest.raises(ValueError, match="do not compose"):
        events_epsilon([round_event(1.0, 20, 5, "uniform", "rdp"), round_event(1.0, 20, 5, "poisson", "rdp")], 1e-5)
    two = [round_event(1.0, 20, 5, "poisson", "rdp"), round_event(2.0, 20, 5, "poisson", "rdp")]
    assert events_epsilon(two, 1e-5) > events_epsilon(two[1:], 1e-5)  # both rounds count


def test_a_round_nobody_can_join_still_releases_noise_and_is_accounted(tmp_path) -> None:
    exp = experiment(_cfg(tmp_path, rounds=2, dp_debug_metrics=True))
    exp.executor.present = lambda: set()  # every node offline: nobody to substitute either
    start = {k: v.clone() for k, v in exp.algo.init_state()["global"].items()}
    exp.run()
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert all(r["clients"] == [] and r["replied"] == 0 and not r["round_skipped"] for r in recs)
    assert recs[1]["dp_epsilon"] > recs[0]["dp_epsilon"] > 0
    final = exp.algo.global_model(exp.state)[0]
    moved = torch.cat([(final[k].double() - start[k].double()).reshape(-1) for k in noised_keys(final)])
    assert float(moved.std()) == pytest.approx(math.sqrt(2) * recs[0]["dp_noise_std"], rel=0.1)  # two rounds of noise


def test_an_absent_client_is_not_replaced_under_poisson_sampling(tmp_path) -> None:
    present = {0, 1, 2, 3}
    exp = experiment(_cfg(tmp_path, rounds=4, dp_debug_metrics=True, clients_per_round=10))
    exp.executor.present = lambda: present
    exp.run()
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert all(set(r["clients"]) <= present for r in recs)


def test_dp_settings_that_would_break_the_analysis_are_refused() -> None:
    ok = dict(algorithm="fedavg", dp="central", sampling="poisson")
    with pytest.raises(ConfigError, match=r"^quorum: under dp=central"):
        validate(apply(RunConfig(), {**ok, "quorum": 2}))
    with pytest.raises(ConfigError, match=r"^late_replies: under dp=central"):
        validate(apply(RunConfig(), {**ok, "late_replies": "next-round", "stragglers": 0.1, "deadline": 1.0}))


def test_only_a_noised_unseeded_unpublished_run_claims_a_guarantee() -> None:
    assert DPSettings(mode="central", noise=1.0).guarantee
    for weaker in (dict(noise=0.0), dict(reproducible=True), dict(debug_metrics=True)):
        assert not DPSettings(**{"mode": "central", "noise": 1.0, **weaker}).guarantee, weaker
    assert not DPSettings(mode="none").guarantee
