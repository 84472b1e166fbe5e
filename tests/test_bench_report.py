"""The benchmark matrix rendered from hand-made records: marks, costs to target, ranks, post-hoc test, guide,
figures and the docs block with its ``--check``."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedfuse import bench_report as br
from fedfuse.records import render, render_text

SPEC = {"id": "bench-toy", "kind": "benchmark", "track": "single", "window": 2, "baseline": "fedavg",
        "target": 0.9, "regimes": ["iid", "dir0.1"], "methods": ["fedavg", "fedprox", "local"],
        "regime_text": {"iid": "IID data", "dir0.1": "strong label skew"}}


def rec(regime: str, method: str, seed: int, accs: list[float], mb_per_eval: float = 1.0,
        personal: bool = False, track: str = "single") -> dict:
    """A record with evaluations at rounds 1, 2, ... and ``mb_per_eval`` MB communicated between them."""
    curve = [[i + 1, a] for i, a in enumerate(accs)]
    costs = [[i + 1, (i + 1) * mb_per_eval * 1e6, (i + 1) * 1e9, float(i + 1)] for i in range(len(accs))]
    r = {"table": "bench-toy", "cell": {"dataset": "toy", "regime": regime, "track": track, "method": method},
         "seed": seed, "algorithm": method, "commit": "0" * 40, "config_hash": f"{regime}{method}{seed}",
         "behaviour": {"*": 1}, "curve": curve, "costs": costs,
         "metrics": {"personal_accuracy": accs[-1], "personal_accuracy_worst10": accs[-1] / 2,
                     "wall_seconds": 2.0 * len(accs), "cpu_seconds": 1.5 * len(accs), "round": len(accs),
                     "bytes_down": mb_per_eval * 1e6 * len(accs), "bytes_up": mb_per_eval * 1e6 * len(accs),
                     "bytes_peer": 0}}
    if personal:
        r["curve_metric"] = "personal_accuracy"
    return r


def toy() -> list[dict]:
    """iid: fedavg ≈ fedprox (differences of mixed sign); dir0.1: fedprox better by 0.10, 0.12, 0.11 points on
    seeds 0-2 (significant), local (personalised) worse on every seed by varying margins."""
    out = []
    for s in range(3):
        out.append(rec("iid", "fedavg", s, [0.5, 0.8, 0.9 + 0.01 * s]))
        out.append(rec("iid", "fedprox", s, [0.5, 0.8, 0.9 + 0.01 * (2 - s)]))
        out.append(rec("iid", "local", s, [0.3, 0.4, 0.5], mb_per_eval=0.0, personal=True))
        out.append(rec("dir0.1", "fedavg", s, [0.3, 0.5, 0.6 + 0.02 * s]))
        out.append(rec("dir0.1", "fedprox", s, [0.3, 0.5 + [0.10, 0.12, 0.11][s] * 2, 0.6 + 0.02 * s]))
        out.append(rec("dir0.1", "local", s, [0.2, 0.3 - 0.01 * s, 0.4 - 0.05 * s], mb_per_eval=0.0, personal=True))
    return out


def test_headline_is_the_mean_of_the_last_window_evaluations():
    assert br.headline(rec("iid", "fedavg", 0, [0.2, 0.4, 0.8]), 2) == pytest.approx(0.6)
    assert br.headline(rec("iid", "fedavg", 0, [0.2, 0.4, 0.8]), 10) == pytest.approx(1.4 / 3)
    assert br.headline({"curve": []}, 2) is None


def test_matrix_marks_significant_differences_and_personalised_curves():
    rows = {r["method"]: r for r in br.matrix_rows(SPEC, br.cells(SPEC, toy()))}
    # dir0.1 fedprox: headline diffs vs fedavg = 0.10, 0.12, 0.11 (half of the round-2 gain over 2 evaluations)
    assert rows["fedprox"]["dir0.1"].endswith("▲")
    assert "▲" not in rows["fedprox"]["iid"] and "▼" not in rows["fedprox"]["iid"]  # mixed signs: n.s.
    assert rows["local"]["dir0.1"].endswith("▼ ᵖ")
    assert rows["fedavg"]["iid"] == "85.5 ± 0.5"  # (0.8 + 0.90/0.91/0.92) / 2 over seeds
    # ranks: iid fedavg = fedprox (1.5 each), local 3; dir0.1 fedprox 1, fedavg 2, local 3
    assert [rows[m]["mean rank"] for m in ("fedavg", "fedprox", "local")] == ["1.75", "1.25", "3.00"]


def test_a_cell_with_a_diverged_run_says_so_and_is_not_ranked_chosen_or_flattered():
    """dir0.1 fedprox seed 1 diverged: its cell shows the mean of the two runs that finished with "(1 of 3
    diverged)", no significance mark, no rank (a method is ranked where every run finished), and the guides
    do not choose it, though its surviving runs would lead."""
    recs = toy()
    for r in recs:
        if r["cell"]["regime"] == "dir0.1" and r["cell"]["method"] == "fedprox":
            r["curve"] = [[i, 0.99] for i, _ in r["curve"]]
            r["metrics"]["personal_accuracy"] = 0.99
            if r["seed"] == 1:
                r["diverged"] = {"round": 3, "why": "8 of 10 client updates were non-finite", "lr": 0.2}
                r["curve"], r["metrics"] = r["curve"][:2], {"round": 2, "cpu_seconds": 3.0}
    by = br.cells(SPEC, recs)
    assert br.diverged(by, ("dir0.1", "fedprox")) == 1 and math.isnan(br.mean_of(by, ("dir0.1", "fedprox"), 2))
    rows = {r["method"]: r for r in br.matrix_rows(SPEC, by)}
    assert rows["fedprox"]["dir0.1"] == "99.0 ± 0.0 (1 of 3 diverged)"
    assert rows["fedprox"]["mean rank"] == "—" and rows["fedavg"]["mean rank"] != "—"
    assert all("fedprox" not in line for line in br.guide(SPEC, by)[1:])
    assert all("start with fedprox" not in line for line in br.personal_guide(SPEC, by))
    assert "fedprox" not in br.rank_matrix(SPEC, by)[1]
    assert br.swing(next(r for r in recs if r.get("diverged")), 2) is None
    costs = {(r["regime"], r["method"]) for r in br.cost_rows(SPEC, by)}
    assert ("dir0.1", "fedprox (1 of 3 diverged)") in costs and ("iid", "fedprox") in costs
    assert "19 runs" not in br.matrix_cost(by) and "over the 18 that counted" in br.matrix_cost(by)


def test_cost_to_target_reads_the_cost_at_the_first_evaluation_reaching_it():
    rows = {(r["regime"], r["method"]): r for r in br.cost_rows(SPEC, br.cells(SPEC, toy()))}
    # iid best headline: fedavg/fedprox 0.855 → target 0.7695, first reached at round 2 = 2 MB on every seed
    assert rows[("iid", "fedavg")]["MB to target"] == "2.0 ± 0.0"
    assert rows[("iid", "fedavg")]["GFLOPs to target"] == "2.0 ± 0.0"
    assert rows[("iid", "local")]["MB to target"] == "not reached 3/3"
    assert rows[("iid", "fedavg")]["worst 10 % %"] == "45.5 ± 0.5"
    assert rows[("iid", "fedavg")]["CPU s/round"] == "1.50 ± 0.00"
    # the last 2 evaluations of iid fedavg: 0.8 → 0.90/0.91/0.92
    assert rows[("iid", "fedavg")]["swing (pts)"] == "11.0 ± 1.0"


def test_seconds_per_round_is_cpu_time_and_marks_wall_time_of_older_records():
    recs = [rec("iid", "fedavg", s, [0.5, 0.8, 0.9]) for s in range(2)]
    assert br.seconds_per_round(recs) == "1.50 ± 0.00"  # 4.5 CPU-s over 3 rounds
    del recs[1]["metrics"]["cpu_seconds"]  # a record made before runs counted CPU time: the cell falls back
    assert br.seconds_per_round(recs) == f"2.00 ± 0.00 {br.WALL}"
    recs[0]["metrics"]["cpu_seconds"] = None  # a resume from a checkpoint without it: unknown, not partial
    assert br.seconds_per_round(recs[:1]) == f"2.00 {br.WALL}"  # one record: no std


def test_swing_summary_names_the_methods_that_swing_with_their_cell():
    # the last two evaluations: dir0.1 fedavg 0.5 -> 0.60/0.62/0.64 (12 points on average, its larger regime),
    # iid fedprox 0.8 -> 0.92/0.91/0.90 (11), iid local 0.4 -> 0.5 (10)
    text = br.swing_summary(SPEC, br.cells(SPEC, toy()))
    assert "fedavg 12.0 [dir0.1/fedavg]; fedprox 11.0 [iid/fedprox]; local 10.0 [iid/local]." in text
    rows = {(r["regime"], r["method"]): r["swing (pts)"] for r in br.cost_rows(SPEC, br.cells(SPEC, toy()))}
    for m in ("fedavg", "fedprox", "local"):
        best = max((float(rows[(g, m)].split(" ± ")[0]), g) for g in ("iid", "dir0.1"))
        assert f"{m} {best[0]:.1f} [{best[1]}/{m}]" in text
    assert text.startswith("Swing, the largest mean over seeds in any regime: ")
    assert "Below" not in text  # every toy method swings by more than a point
    assert "Below 20 point in every regime: fedavg, fedprox, local." in br.swing_summary(
        SPEC, br.cells(SPEC, toy()), points=20)


def test_matrix_cost_sums_cpu_hours_and_keeps_wall_hours_apart():
    recs = toy()  # 18 records of 3 rounds: 4.5 CPU-s and 6 wall-s each
    del recs[0]["metrics"]["cpu_seconds"]
    text = br.matrix_cost(br.cells(SPEC, recs))
    assert text.startswith("Cost of this matrix: 18 runs, 0.02 CPU-hours over the 17 that counted")
    assert f"0.00 wall-hours over the 1 made before ({br.WALL})" in text  # 6 s


def test_friedman_and_posthoc_match_the_hand_computation():
    pytest.importorskip("scikit_posthocs")
    from scipy.stats import studentized_range

    regimes, methods, mat = br.rank_matrix(SPEC, br.cells(SPEC, toy()))
    assert (regimes, methods) == (["iid", "dir0.1"], ["fedavg", "fedprox", "local"])
    p = br.posthoc(mat, methods)
    # Nemenyi: |mean rank difference| / sqrt(k (k+1) / (6 n)), times sqrt 2, against the studentized range (k, ∞)
    q = abs(1.25 - 3.0) / math.sqrt(3 * 4 / (6 * 2)) * math.sqrt(2)
    assert p.loc["fedprox", "local"] == pytest.approx(studentized_range.sf(q, 3, np.inf), rel=1e-4)
    text = br.friedman_text(SPEC, br.cells(SPEC, toy()))
    # rank sums 3.5, 2.5, 6 → χ² = 12/(n k (k+1)) Σ R² − 3n(k+1) = 27.25 − 24 = 3.25, divided by scipy's tie
    # correction 1 − Σ(t³ − t) / (n k (k² − 1)) = 1 − 6/48 (iid ties fedavg with fedprox): 3.714
    assert text.startswith("Friedman's test over 2 regimes × 3 methods: χ² = 3.71")


def test_guide_names_the_significant_winner_else_the_baseline_and_cites_cells():
    lines = br.guide(SPEC, br.cells(SPEC, toy()))
    assert lines[0].startswith("If your clients look like IID data and you deploy one global model, start with "
                               "fedavg: the best mean, ")
    assert lines[0].endswith("[iid/fedprox, iid/fedavg].") or lines[0].endswith("[iid/fedavg].")
    assert lines[1].startswith("If your clients look like strong label skew and you deploy one global model, start "
                               "with fedprox, because it beat fedavg by +11.0 points")
    assert not any("local" in x for x in lines)  # no global model: the personalised guide's
    assert lines[1].endswith(", at 1.0× fedavg's bytes and 1.0× its CPU time [dir0.1/fedprox, dir0.1/fedavg].")


def test_the_global_guide_leaves_out_methods_without_a_global_model():
    recs = [r for r in toy() if r["cell"]["regime"] == "dir0.1"]
    for r in recs:  # local far ahead, on its own clients' data: not a candidate for one global model
        if r["cell"]["method"] == "local":
            r["curve"] = [[i, 0.99] for i, _ in r["curve"]]
    (line,) = br.guide(SPEC, br.cells(SPEC, recs))
    assert "start with fedprox" in line and "local" not in line


def test_the_personalised_guide_compares_per_client_accuracy_with_the_baseline_s():
    recs = toy()
    for r in recs:  # local's per-client accuracy beats fedavg's in dir0.1 by 0.20, 0.25, 0.30 points
        if (r["cell"]["regime"], r["cell"]["method"]) == ("dir0.1", "local"):
            r["metrics"]["personal_accuracy"] = 0.8 + 0.07 * r["seed"]
    lines = br.personal_guide(SPEC, br.cells(SPEC, recs))
    # iid: fedavg 0.90/0.91/0.92 = fedprox 0.92/0.91/0.90 on the mean; fedavg comes first in the spec's order
    assert lines[0] == ("If your clients look like IID data and each keeps the model it is served, start with "
                        "fedavg: it has the highest per-client accuracy (91.0 %) [iid/fedavg].")
    assert lines[1].startswith("If your clients look like strong label skew and each keeps the model it is served, "
                               "start with local, because its per-client accuracy beat fedavg's by +25.0 points "
                               "(87.0 vs 62.0 %, paired t over 3 seeds, p = ")
    assert lines[1].endswith("[dir0.1/local, dir0.1/fedavg].")
    for r in recs:  # one seed against: no longer significant
        if (r["cell"]["regime"], r["cell"]["method"], r["seed"]) == ("dir0.1", "local", 0):
            r["metrics"]["personal_accuracy"] = 0.1
    assert "start with fedavg: the best per-client mean" in br.personal_guide(SPEC, br.cells(SPEC, recs))[1]


def test_cost_ratio_compares_bytes_and_cpu_time_with_the_baseline():
    recs = toy()
    for r in recs:
        if r["cell"]["method"] == "fedprox":
            r["metrics"].update(bytes_down=6e6, cpu_seconds=9.0)  # fedavg: 3 MB down + 3 up, 4.5 CPU-s
    by = br.cells(SPEC, recs)
    assert br.cost_ratio(by, ("iid", "fedprox"), ("iid", "fedavg")) == ", at 1.5× fedavg's bytes and 2.0× its CPU time"
    del recs[0]["metrics"]["cpu_seconds"]  # iid fedavg seed 0: wall time for the pair, marked
    by = br.cells(SPEC, recs)
    assert br.cost_ratio(by, ("iid", "fedprox"), ("iid", "fedavg")).endswith(f"1.0× its wall time {br.WALL}")


def test_figures_are_written_only_from_records(tmp_path):
    assert br.write_figures(SPEC, [], tmp_path / "none") == []
    written = br.write_figures(SPEC, toy(), tmp_path / "img")
    names = {p.name for p in written}
    assert {"bench-toy-ranks.png", "bench-toy-pareto-iid.png", "bench-toy-pareto-dir0.1.png"} <= names
    assert all(p.stat().st_size > 1000 for p in written)
    if importlib.util.find_spec("scikit_posthocs"):  # every figure the Markdown links is drawn
        assert names == set(br.figure_names(SPEC, br.cells(SPEC, toy())).values())
    one = [r for r in toy() if r["cell"]["regime"] == "iid"]  # one regime: no critical-difference diagram
    assert "cd" not in br.figure_names(SPEC, br.cells(SPEC, one))
    assert "-cd.png" not in br.render_benchmark({**SPEC, "figures": "docs/img"}, one)


def _repo(tmp: Path, recs: list[dict]) -> Path:
    (tmp / "results" / "tables").mkdir(parents=True)
    (tmp / "results" / "tables" / "bench-toy.json").write_text(json.dumps(SPEC))
    d = tmp / "results" / "records" / "bench-toy"
    d.mkdir(parents=True)
    for i, r in enumerate(recs):
        (d / f"{i:03d}.json").write_text(json.dumps(r))
    (tmp / "docs").mkdir()
    (tmp / "docs" / "benchmark.md").write_text("# B\n\n<!-- results: bench-toy -->\n<!-- /results -->\n")
    return tmp


def test_without_records_the_block_says_so_and_shows_no_number(tmp_path):
    root = _repo(tmp_path, [])
    text = render_text(root, (root / "docs" / "benchmark.md").read_text())
    assert br.NO_RECORDS in text and "%" not in text and "|" not in text


def test_the_docs_block_renders_from_records_and_check_catches_drift(tmp_path):
    root = _repo(tmp_path, toy())
    assert render(root, check=True) == [root / "docs" / "benchmark.md"]  # empty block: differs
    render(root)
    text = (root / "docs" / "benchmark.md").read_text()
    assert "| fedprox |" in text and "start with fedprox" in text and "Rendered by `fedfuse results render`" in text
    assert render(root, check=True) == []
    stale = toy()
    stale[0]["behaviour"] = {"*": 0}
    (root / "results" / "records" / "bench-toy" / "000.json").write_text(json.dumps(stale[0]))
    assert render(root, check=True) == [root / "docs" / "benchmark.md"]  # a stale record changes the block
    render(root)
    assert "⚠ stale" in (root / "docs" / "benchmark.md").read_text()
