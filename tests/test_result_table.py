"""The statistics table (result_table.py): mean ± std and paired tests by hand, non-significant and single-seed
marks, lower-is-better metrics."""

import math

import pytest

from fedfuse.config import ConfigError, make_config
from fedfuse.result import Result
from fedfuse.result_table import ResultTable


def _fake(label_seed_acc, rounds=4):
    """Results with hand-made histories: accuracy ``acc + 0.01 * round`` and 1 MB / 1 GFLOP per round."""
    out = {}
    for label, seed, acc in label_seed_acc:
        cfg = make_config(seed=seed)
        hist = [{"round": r, "global_accuracy": acc + 0.01 * r, "personal_accuracy": acc,
                 "total_bytes_down": 1_000_000 * r, "total_client_flops": 1e9 * r, "wall_seconds": float(r)}
                for r in range(1, rounds + 1)]
        out.setdefault(label, []).append(Result(cfg, hist, {}))
    return out


def test_table_statistics_by_hand():
    res = _fake([("a", 0, 0.50), ("a", 1, 0.52), ("a", 2, 0.54),
                 ("b", 0, 0.60), ("b", 1, 0.63), ("b", 2, 0.65)])
    t = ResultTable(res, last=2)
    assert t.metric == "global_accuracy" and t.baseline == "a"
    a, b = t.rows
    # final = mean of last two evaluations = acc + 0.035; mean over seeds 0.52 + 0.035, std 0.02
    assert a.final.mean == pytest.approx(0.555) and a.final.std == pytest.approx(0.02) and a.final.n == 3
    assert a.best.mean == pytest.approx(0.52 + 0.04)
    assert t.target == pytest.approx(0.55)  # lowest mean final, floored to a whole percent
    # seed 0 of a: 0.51, 0.52, ... reaches 0.55 at round... never within 4 rounds (0.54); seeds 1/2 do
    assert a.reached == 2 and a.rounds_to_target.mean == pytest.approx((3 + 1) / 2)
    assert a.bytes_to_target.mean == pytest.approx(2e6) and a.flops_to_target.mean == pytest.approx(2e9)
    assert b.reached == 3 and b.rounds_to_target.mean == pytest.approx(1)
    diffs = [0.10, 0.11, 0.11]
    assert b.vs_baseline.diff == pytest.approx(sum(diffs) / 3) and b.vs_baseline.significant()
    rows = t.display_rows()
    assert rows[0]["vs a"] == "baseline" and rows[1]["vs a"].startswith("+10.67 *")
    assert rows[0]["final global acc (%)"] == "55.50 ± 2.00" and rows[0]["rounds to 55%"] == "2.0 ± 1.4 (2/3)"
    frame = t.frame()
    assert frame.loc["b", "n"] == 3 and frame.loc["b", "p_value"] < 0.05
    assert frame.loc["a", "final_ci95"] == pytest.approx(4.302653 * 0.02 / math.sqrt(3), rel=1e-5)  # t(0.975, 2)
    assert frame.loc["a", "p_value"] is None or math.isnan(frame.loc["a", "p_value"])
    md = t.to_markdown()
    assert "| b | 3 |" in md and "(n.s.) not significant" in md
    assert "final = the mean of the last 2 evaluations; metric global_accuracy" in md
    assert "<table" in t._repr_html_() and "55.50 ± 2.00" in t._repr_html_()


def test_table_marks_non_significant_and_single_seed():
    res = _fake([("a", 0, 0.5), ("a", 1, 0.6), ("b", 0, 0.52), ("b", 1, 0.57)])
    t = ResultTable(res, target=0.9)
    assert "(no test)" in t.display_rows()[1]["vs a"]  # two seeds: no significance claim
    assert t.display_rows()[0]["rounds to 90%"] == "never"
    one = ResultTable(_fake([("a", 0, 0.5), ("b", 0, 0.7)]))
    assert "(no test)" in one.display_rows()[1]["vs a"]  # n = 1: no claim
    # no ± for one seed; 4 evaluations (51, 52, 53, 54 %): final = the later half, the last 2
    assert one.display_rows()[0]["final global acc (%)"] == "53.50"
    with pytest.raises(ConfigError, match="baseline 'zz' is not a label"):
        ResultTable(res, baseline="zz")
    with pytest.raises(ConfigError, match="'acuracy' was not measured by any run; did you mean global_accuracy"):
        ResultTable(res, metric="acuracy")


def test_lower_is_better_metrics_perplexity():
    from fedfuse.stats import best_value, cost_to_target, rounds_to_target

    hist = [{"round": r, "perplexity": p, "total_bytes": 10 * r} for r, p in ((1, 300.0), (2, 180.0), (3, 150.0))]
    assert best_value(hist, "perplexity") == 150.0 and best_value(hist, "perplexity", lower=False) == 300.0
    assert rounds_to_target(hist, 200.0, "perplexity") == 2 and cost_to_target(hist, 200.0, "perplexity") == 20
    res = {}
    for label, seed, scale in (("a", 0, 1.0), ("a", 1, 1.1), ("b", 0, 0.8), ("b", 1, 0.85)):
        cfg = make_config(seed=seed)
        h = [{"round": r, "perplexity": p * scale, "total_bytes_down": r} for r, p in ((1, 300.0), (2, 200.0))]
        res.setdefault(label, []).append(Result(cfg, h, {}))
    t = ResultTable(res, metric="perplexity", last=1)
    assert t.lower and t.target == pytest.approx(210.0)  # worst mean final (210), 3 significant digits
    a, b = t.rows
    assert a.best.mean == pytest.approx(210.0) and b.final.mean == pytest.approx(165.0)
    assert a.reached == 1 and b.reached == 2  # seed 1 of a ends at 220 > 210
    row = t.display_rows()[1]
    assert row["final perplexity"] == "165.00 ± 7.07" and row["vs a"].startswith("-45.00")
    assert "lower is better" in t.to_markdown()
