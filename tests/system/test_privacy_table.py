"""Every algorithm declares what its server must see and which privacy mechanisms it admits; ``fedfuse show``
prints it, docs/privacy.md holds the table generated from the declarations, and a run that requests a mechanism
the algorithm does not admit is refused before anything runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedfuse.algorithms import ALGORITHMS
from fedfuse.api import TABLE_END, TABLE_START, privacy_table, show
from fedfuse.config import ConfigError, RunConfig, apply, validate
from fedfuse.types import MECHANISMS, Privacy, ServerView, Support

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_declares_its_own_entry(name: str) -> None:
    cls = ALGORITHMS[name]
    assert "privacy" in cls.__dict__, f"{cls.__name__} inherits its privacy entry: declare its own"
    entries = cls.privacy
    assert entries and all(isinstance(e, Privacy) for e in entries)
    assert not entries[0].when, "the first entry describes the defaults"
    fields = set(cls.option_defaults())
    for e in entries:
        assert isinstance(e.view, ServerView) and e.why.strip()
        assert all(k in fields for k, _ in e.when), f"{name}: a variant names an unknown option"
        for mech in MECHANISMS:
            v = e.admits(mech)
            assert isinstance(v.support, Support) and v.why.strip() and "\n" not in v.why
    assert cls.privacy_for() is entries[0]


def test_option_variants_select_their_entry() -> None:
    fedmr, msf = ALGORITHMS["fedmr"], ALGORITHMS["msfusion"]
    assert fedmr.privacy_for({"secure": True}).when == (("secure", True),)
    assert fedmr.privacy_for({"secure": False}) is fedmr.privacy[0]
    assert msf.privacy_for({"global_model": "none"}).view is ServerView.PEER_TO_PEER
    assert msf.privacy_for(msf.Options()).view is ServerView.MODELS


def test_views_match_the_fusion_family() -> None:
    """Spot checks of the declarations against what each server step reads."""
    view = {n: c.privacy[0].view for n, c in ALGORITHMS.items()}
    for n in ("fedavg", "fedprox", "fedit", "fedem", "heterofl", "pfedmoe"):
        assert view[n] is ServerView.NOTHING_INDIVIDUAL, n
    for n in ("fedma", "oneshot-match", "simple-fedma", "fedmr", "ensemble", "fedet"):
        assert view[n] is ServerView.MODELS, n
    for n in ("fedmerge", "clusamp"):
        assert view[n] is ServerView.DELTAS, n
    for n in ("dpsgd", "dispfl"):
        assert view[n] is ServerView.PEER_TO_PEER, n
    # a mechanism that hides individual contributions never applies where the server reads them
    for n, cls in ALGORITHMS.items():
        for e in cls.privacy:
            if e.view is not ServerView.NOTHING_INDIVIDUAL:
                assert e.secagg.support is Support.NO, n


def test_docs_table_equals_the_declarations() -> None:
    text = (ROOT / "docs" / "privacy.md").read_text(encoding="utf-8")
    table = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip("\n")
    assert table == privacy_table().strip("\n"), (
        "docs/privacy.md is out of date: python3 -c \"from fedfuse.api import write_privacy_table as w; "
        "w('docs/privacy.md')\"")
    rows = [r for r in table.splitlines() if r.startswith("| `")]
    assert len(rows) == sum(len(c.privacy) for c in ALGORITHMS.values())
    assert {r.split("`")[1] for r in rows} == set(ALGORITHMS)


def test_show_prints_the_entry() -> None:
    (comp,) = show("fedma", "algorithm")
    text = comp.format()
    assert "the server must see per-client models" in text
    assert "SecAgg (secagg=true)" in text and "masked neurons" in text
    (msf,) = show("msfusion", "algorithm")
    assert "privacy (with global_model=\"none\"): the server must see peer-to-peer only" in msf.format()


def _config(**kw) -> RunConfig:
    return validate(apply(RunConfig(), kw))


def test_incompatible_requests_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match=r"^dp=central: 'fedma' does not admit central DP \(no: .*\); it works "):
        _config(algorithm="fedma", dp="central")
    with pytest.raises(ConfigError, match=r"^secagg=true: 'fedmr' does not admit secure aggregation \(no: "):
        _config(algorithm="fedmr", secagg=True, algorithm_options={"secure": True})
    with pytest.raises(ConfigError, match=r"^dp=local: 'local' does not admit local DP"):
        _config(algorithm="local", dp="local")
    for name, cls in ALGORITHMS.items():  # the verdict decides, nothing else
        for mech, req in (("central_dp", {"dp": "central"}), ("local_dp", {"dp": "local"}),
                          ("secagg", {"secagg": True})):
            if cls.privacy_for().admits(mech).ok:
                _config(algorithm=name, **req)
            else:
                with pytest.raises(ConfigError, match=f"'{name}' does not admit"):
                    _config(algorithm=name, **req)
    assert _config(algorithm="fedma").dp == "none"


def test_cli_refusal_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-m", "fedfuse", "run", "--algorithm", "simple-fedma", "--set", "secagg=true",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedfuse: error: secagg=true: 'simple-fedma' does not admit")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
