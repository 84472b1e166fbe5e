"""``fedfuse results verify`` tells the truth about what re-runs bit for bit (fedfuse.verify).

A central-DP record draws its noise and client sampling from OS randomness, so it is never re-run: it is
refused with one line and its own exit status, and what can be checked exactly (the config hash, the ε the
accountant gives for the config) is checked; ``--random`` skips such records and counts them.  A difference on
a record made with other (or unknown) float kernels is its own outcome, never a pass; an exact match is "bit for
bit"; a difference on the record's own kernels is "NOT reproduced".
"""

from __future__ import annotations

import json
import math

import pytest

from fedfuse import records
from fedfuse import verify as verification
from fedfuse.cli import main

TINY = dict(dataset="digits", model="mlp", clients=4, clients_per_round=2, rounds=2, eval_every=1, plots=False,
            threads=1)
DP = dict(dp="central", dp_noise=1.0, dp_clip=1.0, sampling="poisson", dp_delta=1e-5)


def _run(out, **over):
    from fedfuse.config import RunConfig, apply
    from fedfuse.runner import experiment

    cfg = apply(RunConfig(), {**TINY, "algorithm": "fedavg", "seed": 0, **over, "out": str(out)})
    experiment(cfg, progress=False).run()
    return out


@pytest.fixture(scope="module")
def recs(tmp_path_factory):
    """Records of three tiny digits runs: plain FedAvg, central DP (OS noise) and central DP clipping only."""
    base = tmp_path_factory.mktemp("verify")
    plain = records.make_record(_run(base / "plain"), "t", {"method": "fedavg"}, commit="0" * 40)
    dp = records.make_record(_run(base / "dp", **DP), "t", {"method": "dp"}, commit="0" * 40)
    clip = records.make_record(_run(base / "clip", **{**DP, "dp_noise": 0.0}), "t", {"method": "clip"},
                               commit="0" * 40)
    return {"plain": plain, "dp": dp, "clip": clip}


def test_a_new_record_stores_the_kernels_it_was_made_with(recs, monkeypatch):
    import os
    import platform

    import torch

    made = recs["plain"]["made_on"]
    assert made == records.made_on()
    assert {k: made[k] for k in ("torch", "cpu_capability", "machine")} == {
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine()}
    assert isinstance(made["cpu"], str) and made["kernel_env"] == {
        k: os.environ[k] for k in records.KERNEL_ENV if os.environ.get(k)}
    assert json.loads(json.dumps(recs["plain"]))["made_on"] == made  # plain JSON, like every record field
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")  # a kernel choice made by the environment is part of it
    assert records.made_on()["kernel_env"]["MKL_CBWR"] == "COMPATIBLE"


def test_which_records_are_rerunnable():
    def rec(metrics=None, **cfg):
        return {"config": {"dp": "none", **cfg}, "metrics": metrics or {}}

    assert verification.not_rerunnable(rec()) is None
    assert verification.not_rerunnable(rec(dp="local")) is None  # in process DP-SGD draws from the run seed
    assert verification.not_rerunnable(rec(dp="central", dp_reproducible=True)) is None  # research mode: seeded
    why = verification.not_rerunnable(rec(dp="central"))
    assert why is not None and "OS randomness" in why and "by design" in why
    assert verification.not_rerunnable(rec(dp="central", dp_noise=0.0)) == why  # clipping only: OS sampling still
    assert verification.not_rerunnable(rec({"dp_guarantee": True})) == why  # a record that claims a guarantee


def test_a_dp_record_is_not_rerun_but_its_hash_and_epsilon_are_checked_exactly(recs):
    dp = recs["dp"]
    assert dp["metrics"]["dp_guarantee"] is True and dp["metrics"]["dp_epsilon"] > 0
    res = verification.assess(dp)
    assert res.outcome == "not re-runnable" and res.exit_status == 3
    assert res.message.startswith("not re-runnable bit for bit:") and "OS randomness" in res.message
    (hname, hrec, hnow, hok), (ename, erec, enow, eok) = res.rows
    assert hname == "config hash" and hrec == hnow == dp["config_hash"] and hok
    # the ε the run's accountant reported after round 2 is what the accountant gives for the config, exactly
    assert ename.startswith("dp_epsilon") and "2 rounds" in ename and eok
    assert erec == enow == dp["metrics"]["dp_epsilon"]
    from fedfuse.privacy.dp import central_epsilon

    assert enow == central_epsilon(1.0, 4, 2, "poisson", 2, 1e-5, "rdp")
    # a record whose ε was edited, or whose config no longer matches its hash, is not verified
    edited = {**dp, "metrics": {**dp["metrics"], "dp_epsilon": dp["metrics"]["dp_epsilon"] * 0.5}}
    res = verification.assess(edited)
    assert res.outcome == "differs" and res.exit_status == 1 and "dp_epsilon" in res.message
    assert [ok for *_, ok in res.rows] == [True, False]
    weaker = {**dp, "config": {**dp["config"], "dp_noise": 2.0}}  # claims the ε of noise 1 with noise 2
    res = verification.assess(weaker)
    assert res.outcome == "differs" and [ok for *_, ok in res.rows] == [False, False]


def test_epsilon_is_not_recomputed_when_the_config_does_not_fix_the_federation_size(recs):
    """A ``natural`` partition of every user: the number of clients ε depends on comes from the data, so the
    check says so (unchecked) instead of comparing with a guess; the config hash is still checked."""
    from fedfuse.config import RunConfig, apply, config_hash

    cfg = {**recs["dp"]["config"], "partition": "natural", "clients": 0, "partition_options": {}}
    rec = {**recs["dp"], "config": cfg, "config_hash": config_hash(apply(RunConfig(), {**cfg, "out": None}))}
    res = verification.assess(rec)
    assert res.outcome == "not re-runnable" and res.exit_status == 3
    assert [ok for *_, ok in res.rows] == [True, None] and "not recomputed" in res.rows[1][2]
    assert res.message.endswith("checked exactly instead: config hash (equal)")


def test_a_clipping_only_record_is_not_rerunnable_and_its_infinite_epsilon_checks(recs):
    clip = recs["clip"]
    assert clip["metrics"]["dp_guarantee"] is False
    res = verification.assess(clip)
    assert res.outcome == "not re-runnable" and all(ok for *_, ok in res.rows)
    eps = [r for r in res.rows if r[0].startswith("dp_epsilon")]
    assert len(eps) == 1 and eps[0][1] is None and eps[0][2] is None  # ε = ∞ is recorded as None


def test_kernels_differ_by_hand():
    here = {"torch": "2.13.0+cpu", "cpu_capability": "AVX512", "machine": "x86_64", "cpu": "Xeon", "kernel_env": {}}
    assert verification.kernels_differ({"made_on": dict(here)}, here) is None
    other = verification.kernels_differ({"made_on": {**here, "cpu_capability": "AVX2"}}, here)
    assert other == "the record was made with other float kernels (cpu_capability AVX2 there, AVX512 here)"
    assert verification.kernels_differ({"made_on": {**here, "cpu": "EPYC"}}, here) is not None
    assert verification.kernels_differ({"made_on": {**here, "kernel_env": {"MKL_CBWR": "COMPATIBLE"}}}, here)
    assert verification.kernels_differ({"made_on": {**here, "torch": "2.5.1"}}, here) is not None
    assert verification.kernels_differ({"made_on": {**here, "machine": "arm64"}}, here) is not None
    unknown = verification.kernels_differ({}, here)
    assert unknown is not None and "does not say" in unknown


def test_exact_match_is_bit_for_bit_on_any_kernels(recs):
    plain = recs["plain"]
    res = verification.assess(plain)
    assert res.outcome == "bit for bit" and res.exit_status == 0 and res.message == "reproduced bit for bit"
    assert all(d == 0 for name, _, _, d in res.rows if verification.is_table_metric(name))
    foreign = {**plain, "made_on": {**plain["made_on"], "cpu_capability": "AVX2-elsewhere"}}
    assert verification.assess(foreign).outcome == "bit for bit"  # equal is equal, wherever it was made


def _nudged(rec, by=1e-4):
    m = rec["metrics"]
    return {**rec, "metrics": {**m, "global_accuracy": m["global_accuracy"] + by}}


def test_a_difference_on_foreign_or_unknown_kernels_is_its_own_outcome(recs):
    plain = recs["plain"]
    foreign = _nudged({**plain, "made_on": {**plain["made_on"], "cpu_capability": "AVX2-elsewhere"}})
    res = verification.assess(foreign)
    assert res.outcome == "other kernels" and res.exit_status == 4
    assert "-0.0001" in res.message and "other float kernels" in res.message and "AVX2-elsewhere" in res.message
    assert "exact re-runs need the same kernels" in res.message
    old = _nudged({k: v for k, v in plain.items() if k != "made_on"})  # made before records stored kernels
    res = verification.assess(old)
    assert res.outcome == "other kernels" and "does not say which float kernels" in res.message
    # the same difference on the kernels the record was made with: today's code computes something else
    res = verification.assess(_nudged(plain))
    assert res.outcome == "differs" and res.exit_status == 1 and res.message.startswith("NOT reproduced")
    # other evaluated rounds are no rounding effect: NOT reproduced, whatever the kernels
    res = verification.assess({**foreign, "curve": plain["curve"][:1]})
    assert res.outcome == "differs" and res.message == "NOT reproduced: the evaluated rounds differ"
    # a tolerance the caller chose accepts it, and says it is not bit for bit
    res = verification.assess(_nudged(plain), tol=1e-3)
    assert res.outcome == "within tolerance" and res.exit_status == 0 and "not bit for bit" in res.message


def _root(tmp_path, *recs):
    root = tmp_path / "repo"
    for r in recs:
        records.write_record(root, r)
    return root


def test_cli_refuses_a_dp_record_with_one_line_and_status_3(recs, tmp_path, capsys):
    root = _root(tmp_path, recs["dp"], recs["plain"])
    assert main(["results", "--root", str(root), "verify", "--table", "t", "--cell", "method=dp"]) == 3
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "OS randomness" in line] == [out[-1]]
    assert out[-1].startswith("not re-runnable bit for bit") and "NOT reproduced" not in "\n".join(out)
    assert any(line.strip().startswith("config hash") and line.endswith("equal") for line in out)


def test_cli_random_picks_only_rerunnable_records_and_counts_the_rest(recs, tmp_path, capsys):
    root = _root(tmp_path, recs["dp"], recs["clip"], recs["plain"])
    for pick in (0, 1, 2):
        assert main(["results", "--root", str(root), "verify", "--table", "t", "--random", str(pick)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("picking at random among 1 re-runnable record of 3 matching; 2 not eligible: "
                                 "central DP")
        assert "method': 'fedavg'" in out[1] and out[-1] == "reproduced bit for bit"
    only_dp = _root(tmp_path / "dp", recs["dp"])
    assert main(["results", "--root", str(only_dp), "verify", "--random", "0"]) == 3
    out = capsys.readouterr().out
    assert "among 0 re-runnable records of 1 matching; 1 not eligible" in out and "nothing to re-run" in out


def test_cli_reports_foreign_kernels_with_status_4_and_documents_the_statuses(recs, tmp_path, capsys):
    plain = recs["plain"]
    root = _root(tmp_path, _nudged({**plain, "made_on": {**plain["made_on"], "cpu_capability": "NEON"}}))
    assert main(["results", "--root", str(root), "verify", "--table", "t"]) == 4
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("differs (largest table-metric difference -0.0001)") and "NEON" in out[-1]
    assert main(["results", "--root", str(root), "verify", "--table", "nope"]) == 2
    assert capsys.readouterr().err.strip() == ("fedfuse: error: no record matches table=nope cell={} seed=None")
    with pytest.raises(SystemExit):
        main(["results", "verify", "--help"])
    text = capsys.readouterr().out
    for status in ("0  reproduced bit for bit", "1  NOT reproduced", "2  refused", "3  not re-runnable",
                   "4  differs, on a record made with other float kernels"):
        assert status in text, status
    assert math.isfinite(recs["dp"]["metrics"]["dp_epsilon"])
