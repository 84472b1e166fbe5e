"""Result records (fedfuse.records): every docs table equals what its records say; tables, stale marks and
paired comparisons computed by hand; a record re-run by ``verify`` reproduces its numbers, a changed one does
not."""

import json
import shutil

import pytest

from fedfuse import records
from fedfuse import verify as verification
from fedfuse.records import BEHAVIOUR, STALE, make_record, render_table, stale_reason
from fedfuse.stats import stability


def test_docs_tables_equal_their_records():
    """Every '<!-- results: ID -->' block in README/docs is exactly what `fedfuse results render` makes."""
    root = records.repo_root()
    assert (root / "results" / "tables").is_dir()
    assert records.documents(root), "no document holds a results block"
    assert records.render(root, check=True) == [], "run `fedfuse results render` and commit the tables"


def test_every_record_matches_its_spec_and_hashes_its_config():
    from fedfuse.config import RunConfig, apply, config_hash

    root = records.repo_root()
    for path, rec in records.all_records(root):
        spec = records.load_spec(root, rec["table"]) if (root / "results" / "tables" /
                                                          f"{rec['table']}.json").is_file() else None
        if spec is not None and spec.get("kind") == "benchmark":  # one record table, two specs (single, width)
            width = root / "results" / "tables" / f"{rec['table']}-width.json"
            methods = spec["methods"] + (records.load_spec(root, f"{rec['table']}-width")["methods"]
                                         if width.is_file() else [])
            assert rec["cell"]["regime"] in spec["regimes"] and rec["cell"]["method"] in methods, path
        else:
            assert spec is None or set(spec["rows"]) <= set(rec["cell"]), path
        assert rec["schema"] == records.SCHEMA and len(rec["commit"]) >= 7, path
        cfg = apply(RunConfig(), {**rec["config"], "out": None})  # today's code still accepts the recorded config
        assert config_hash(cfg) == rec["config_hash"], f"{path}: config and hash disagree"
        made = rec.get("made_on")  # where it was made: optional, records made before it stay valid
        assert made is None or ({"torch", "cpu_capability", "machine", "cpu", "kernel_env"} <= set(made)
                                and isinstance(made["kernel_env"], dict)), path


def test_stability_by_hand():
    hist = [{"round": r, "global_accuracy": a} for r, a in enumerate([0.1, 0.5, 0.9, 0.7, 0.3], start=1)]
    last, best = stability(hist, window=2)
    assert last == pytest.approx(0.5)  # rounds 4-5
    assert best == pytest.approx(0.8)  # rounds 3-4 (0.9 + 0.7) / 2
    last, best = stability(hist, window=10)  # shorter than the window: one window, all of it
    assert last == best == pytest.approx(0.5)
    assert stability([{"round": 1}]) == (None, None)


def _rec(method, seed, acc, last=None, best=None, behaviour=None):
    return {"schema": 1, "table": "t", "cell": {"method": method, "mu": 0.5}, "seed": seed, "algorithm": method,
            "commit": "abcdef0123", "behaviour": behaviour or {"*": BEHAVIOUR["*"], method: BEHAVIOUR.get(method, 1)},
            "config_hash": f"h{method}{seed}", "config": {}, "metrics": {"global_accuracy": acc,
                                                                          "last10_mean": last, "best10_mean": best}}


SPEC = {"id": "t", "rows": ["method", "mu"], "order": {"method": ["b", "a"]},
        "columns": [{"header": "method", "key": "method"}, {"header": "mu", "key": "mu"},
                    {"header": "acc %", "metric": "global_accuracy", "agg": "mean_std", "scale": 100, "digits": 2},
                    {"header": "per seed", "metric": "global_accuracy", "agg": "per_seed", "scale": 100,
                     "digits": 1},
                    {"header": "stable", "agg": "within", "metrics": ["best10_mean", "last10_mean"], "tol": 0.02},
                    {"header": "seeds", "agg": "seeds"}]}


def test_table_by_hand_and_stale_rows_marked():
    recs = [_rec("a", 1, 0.80, 0.79, 0.80), _rec("a", 0, 0.90, 0.90, 0.93),
            _rec("b", 0, 0.50, 0.50, 0.50), _rec("b", 1, 0.70, 0.70, 0.71)]
    text = render_table(SPEC, recs).splitlines()
    assert text[0] == "| method | mu | acc % | per seed | stable | seeds |"
    # rows in the spec's order (b first); seeds sorted; sample std: a = 0.85 ± 0.0707
    assert text[2] == "| b | 0.5 | 60.00 ± 14.14 | 50.0 / 70.0 | yes | 0,1 |"
    assert text[3] == "| a | 0.5 | 85.00 ± 7.07 | 90.0 / 80.0 | no | 0,1 |"  # seed 0 fell 3 points
    old = _rec("a", 2, 0.1, behaviour={"*": BEHAVIOUR["*"], "a": 0})
    assert stale_reason(old) == "a behaviour v0 < v1"
    row = render_table(SPEC, [*recs, old]).splitlines()[3]
    assert row.startswith(f"| a {STALE} (a behaviour v0 < v1) | 0.5 |")
    assert stale_reason(recs[0]) is None


def test_curve_columns_by_hand():
    """A column with ``curve`` reads the recorded per-round curve: its value at a round, or each seed's mean of
    its last n evaluations; a seed without that point is left out of the mean."""
    spec = {"id": "t", "rows": ["method"],
            "columns": [{"header": "method", "key": "method"},
                        {"header": "r8", "curve": {"round": 8}, "agg": "mean_std", "scale": 100, "digits": 1},
                        {"header": "last 2", "curve": {"last": 2}, "agg": "per_seed", "scale": 100, "digits": 1},
                        {"header": "last 2 mean", "curve": {"last": 2}, "agg": "mean_std", "scale": 100,
                         "digits": 2}]}
    recs = [{**_rec("a", 0, 0.3), "curve": [[4, 0.1], [8, 0.2], [12, None], [16, 0.4]]},
            {**_rec("a", 1, 0.5), "curve": [[4, 0.2], [8, 0.4], [12, 0.5], [16, 0.6]]},
            {**_rec("a", 2, 0.5), "curve": [[4, 0.2]]}]
    assert records.curve_value(recs[0], {"round": 12}) is None
    assert records.curve_value(recs[0], {"last": 2}) == pytest.approx(0.3)  # rounds 8 and 16 (12 not evaluated)
    row = render_table(spec, recs).splitlines()[2]
    # r8: seeds 0, 1 (0.2, 0.4): 30.0 ± 14.1; last 2: 30.0 / 55.0 / 20.0 (seed 2: its one point), mean 35.00 ± 18.03
    assert row == "| a | 30.0 ± 14.1 | 30.0 / 55.0 / 20.0 | 35.00 ± 18.03 |"
    # swing over the last 3 evaluated points of seed 1 (0.4, 0.5, 0.6): 0.1; seed 0 (0.1, 0.2, 0.4): 0.2;
    # seed 2 has one point: no swing
    assert records.curve_value(recs[1], {"swing": 3}) == pytest.approx(0.1)
    assert records.curve_value(recs[0], {"swing": 3}) == pytest.approx(0.2)
    assert records.curve_value(recs[2], {"swing": 3}) is None


def test_paired_table_by_hand():
    spec = {"id": "t", "kind": "paired", "by": "method", "group": ["mu"], "pairs": [["a", "b"]],
            "metric": "global_accuracy", "scale": 100, "digits": 2}
    recs = [_rec("a", 0, 0.90), _rec("a", 1, 0.80), _rec("a", 2, 0.85),
            _rec("b", 0, 0.70), _rec("b", 1, 0.72), _rec("b", 2, 0.68)]
    row = render_table(spec, recs).splitlines()[2]
    # differences 0.20, 0.08, 0.17: mean 0.15, sd 0.0624, t = 4.16 on 2 df, p = 0.053
    assert row.startswith("| 0.5 | a vs b | +15.00 | 0.053")
    assert row.endswith("| yes (n.s.) |")


def test_paired_and_claims_read_a_curve_mean_when_given():
    """A paired spec or claims row with ``curve`` compares each seed's mean of its last n evaluations (FedMR's
    "final accuracy"), not the final metric."""
    curves = {("a", 0): [0.5, 0.9], ("a", 1): [0.6, 0.8], ("a", 2): [0.7, 0.9],
              ("b", 0): [0.6, 0.6], ("b", 1): [0.5, 0.7], ("b", 2): [0.6, 0.6]}
    # final metrics say the opposite of the curves' last-2 means, so the test sees which one is read
    recs = [{**_rec(m, s, 1.0 if m == "b" else 0.0), "curve": [[10, c[0]], [20, c[1]]]}
            for (m, s), c in curves.items()]
    spec = {"id": "t", "kind": "paired", "by": "method", "group": ["mu"], "pairs": [["a", "b"]],
            "curve": {"last": 2}, "scale": 100, "digits": 2}
    # last-2 means: a 0.70, 0.70, 0.80; b 0.60, 0.60, 0.60: differences 0.10, 0.10, 0.20 (mean 0.1333)
    row = render_table(spec, recs).splitlines()[2]
    assert row.startswith("| 0.5 | a vs b | +13.33 |") and "| yes" in row
    claim = {"by": "method", "pairs": [["a", "b"]], "curve": {"last": 2}, "label": "L"}
    measured, holds = records.claim_cells(claim, recs)
    assert measured.startswith("L: a 73.3 vs b 60.0 % (+13.3, p = ") and holds in ("**yes**", "yes (n.s.)")
    # at round 10 alone a trails b on seed 0 (0.5 vs 0.6) and leads on seeds 1, 2: the mean +0.033 still "yes"
    assert records.claim_cells({**claim, "curve": {"round": 10}}, recs)[0].startswith("L: a 60.0 vs b 56.7 %")


def test_paired_groups_in_numeric_order():
    """Groups are ordered by value: 2 clients before 10 (not "10" < "2" as text), numbers before text."""
    spec = {"id": "t", "kind": "paired", "by": "method", "group": ["mu"], "pairs": [["a", "b"]],
            "metric": "global_accuracy", "scale": 100, "digits": 2}
    recs = [{**_rec(m, s, acc), "cell": {"method": m, "mu": mu}} for mu in (10, 2, "x", 0.5)
            for m, acc in (("a", 0.9), ("b", 0.7)) for s in (0, 1)]
    rows = render_table(spec, recs).splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| 0.5", "| 2", "| 10", "| x"]


def _tiny_run(tmp_path, seed=0, algorithm="fedavg"):
    from fedfuse.config import RunConfig, apply
    from fedfuse.runner import experiment

    cfg = apply(RunConfig(), dict(algorithm=algorithm, dataset="digits", model="mlp", clients=4, clients_per_round=2,
                                  rounds=2, eval_every=1, seed=seed, plots=False, threads=1,
                                  out=str(tmp_path / f"run{seed}")))
    experiment(cfg, progress=False).run()
    return tmp_path / f"run{seed}"


def test_record_of_a_run_without_global_model_keeps_the_personalised_curve(tmp_path):
    """FedMerge has no global model: the record's curve is the personalised accuracy per round (named by
    ``curve_metric``), and its final value is the recorded ``personal_accuracy``."""
    from fedfuse.result import load

    run = _tiny_run(tmp_path, 0, algorithm="fedmerge")
    rec = make_record(run, "tiny", {"method": "fedmerge"}, commit="0" * 40)
    hist = load(run).history
    assert rec["curve_metric"] == "personal_accuracy" and rec["metrics"]["global_accuracy"] is None
    assert rec["curve"] == [[h["round"], h["personal_accuracy"]] for h in hist]
    assert rec["curve"][-1][1] == rec["metrics"]["personal_accuracy"] is not None
    fedavg = make_record(_tiny_run(tmp_path / "b", 0), "tiny", {"method": "fedavg"}, commit="0" * 40)
    assert "curve_metric" not in fedavg and fedavg["curve"][-1][1] == fedavg["metrics"]["global_accuracy"]


def test_record_of_an_ensemble_run_keeps_its_ensemble_accuracy_and_verify_checks_it(tmp_path):
    """The ensemble has no single global model: its record has no global accuracy, its global-test accuracy is
    the final ``ensemble_accuracy`` of its history, and ``verify`` re-runs that number bit for bit."""
    from fedfuse.result import load

    run = _tiny_run(tmp_path, 0, algorithm="ensemble")
    rec = make_record(run, "tiny", {"method": "ensemble"}, commit="0" * 40)
    hist = load(run).history
    assert rec["metrics"]["global_accuracy"] is None and rec["curve_metric"] == "personal_accuracy"
    assert rec["metrics"]["ensemble_accuracy"] == hist[-1]["ensemble_accuracy"] is not None
    assert verification.is_table_metric("ensemble_accuracy")
    ok, rows = verification.verify(rec, tol=0.0)
    assert ok and dict((k, d) for k, _, _, d in rows)["ensemble_accuracy"] == 0.0
    bad = {**rec, "metrics": {**rec["metrics"], "ensemble_accuracy": rec["metrics"]["ensemble_accuracy"] - 0.25}}
    assert not verification.verify(bad)[0]


def test_metric_of_reads_each_methods_own_metric_in_claims_paired_and_columns(tmp_path):
    """``metric_of`` names the metric of one method (an ensemble's ``ensemble_accuracy``) in a claims row, a
    paired spec and a table column; every other method keeps ``metric``."""
    def ens(seed, acc):
        r = _rec("ens", seed, None)
        return {**r, "metrics": {**r["metrics"], "ensemble_accuracy": acc}}

    recs = [_rec("a", 0, 0.90), _rec("a", 1, 0.80), _rec("a", 2, 0.85), ens(0, 0.70), ens(1, 0.72), ens(2, 0.68)]
    of = {"ens": "ensemble_accuracy"}
    assert records.metric_for({"metric": "global_accuracy", "metric_of": of}, {"method": "ens"}) == "ensemble_accuracy"
    assert records.metric_for({"metric": "global_accuracy", "metric_of": of}, {"method": "a"}) == "global_accuracy"
    row = {"family": "A", "claim": "a > ens", "pairs": [["a", "ens"]], "metric": "global_accuracy", "metric_of": of}
    # the same numbers as a vs b in test_paired_table_by_hand: differences 0.20, 0.08, 0.17, p = 0.053
    assert records.claim_cells(row, recs) == ("a 85.0 vs ens 70.0 % (+15.0, p = 0.053)", "yes (n.s.)")
    no_of = records.claim_cells({**row, "metric_of": {}}, recs)[0]  # an ensemble has no global model
    assert no_of == "a 85.0 vs ens nan % (+nan, p = n/a)"
    paired = {"id": "t", "kind": "paired", "by": "method", "group": ["mu"], "pairs": [["a", "ens"]],
              "metric": "global_accuracy", "metric_of": of, "scale": 100, "digits": 2}
    assert render_table(paired, recs).splitlines()[2].startswith("| 0.5 | a vs ens | +15.00 | 0.053")
    spec = {"id": "t", "rows": ["method"], "order": {"method": ["a", "ens"]},
            "columns": [{"header": "method", "key": "method"},
                        {"header": "acc %", "metric": "global_accuracy", "metric_of": of, "agg": "mean_std",
                         "scale": 100, "digits": 2},
                        {"header": "global model %", "metric": "global_accuracy", "agg": "mean_std", "scale": 100,
                         "digits": 2}]}
    lines = render_table(spec, recs).splitlines()
    assert lines[2] == "| a | 85.00 ± 5.00 | 85.00 ± 5.00 |"
    assert lines[3] == "| ens | 70.00 ± 2.00 | — |"


def test_record_render_and_verify_a_real_run(tmp_path):
    root = tmp_path / "repo"
    (root / "results" / "tables").mkdir(parents=True)
    spec = {**SPEC, "id": "tiny", "order": {}}
    (root / "results" / "tables" / "tiny.json").write_text(json.dumps(spec))
    for seed in (0, 1):
        rec = make_record(_tiny_run(tmp_path, seed), "tiny", {"method": "fedavg", "mu": 1}, commit="0" * 40)
        records.write_record(root, rec)
    recs = records.load_records(root, "tiny")
    from fedfuse.config import config_hash
    from fedfuse.result import load

    assert recs[0]["config_hash"] == config_hash(load(tmp_path / "run0").config)
    assert [r["seed"] for r in recs] == [0, 1] and recs[0]["metrics"]["global_accuracy"] is not None
    doc = root / "docs" / "x.md"
    doc.parent.mkdir()
    doc.write_text("before\n<!-- results: tiny -->\nold table\n<!-- /results -->\nafter\n")
    assert records.render(root, check=True) == [doc] and "old table" in doc.read_text()
    assert records.render(root) == [doc] and records.render(root, check=True) == []
    text = doc.read_text()
    accs = [100 * r["metrics"]["global_accuracy"] for r in recs]
    assert "| fedavg | 1 | " in text and f"{accs[0]:.1f} / {accs[1]:.1f}" in text
    assert "from 2 records in `results/records/tiny/`" in text and text.endswith("<!-- /results -->\nafter\n")
    # verify: the same code re-runs the record bit for bit; a changed number is reported
    ok, rows = verification.verify(recs[0], tol=0.0)
    assert ok and dict((k, d) for k, _, _, d in rows)["global_accuracy"] == 0.0
    bad = {**recs[0], "metrics": {**recs[0]["metrics"], "global_accuracy": 0.01}}
    ok, rows = verification.verify(bad)
    assert not ok and dict((k, d) for k, _, _, d in rows)["global_accuracy"] > 0
    shutil.rmtree(tmp_path / "run0")


def test_verify_compares_the_recorded_curve(tmp_path):
    """``verify`` also compares the per-round curve the tables read (a curve column, a claims row's last-n mean):
    the same code gives a zero largest difference; a changed point is caught and its size reported."""
    rec = make_record(_tiny_run(tmp_path, 0), "tiny", {"method": "fedavg"}, commit="0" * 40)
    assert len(rec["curve"]) == 2
    ok, rows = verification.verify(rec, tol=0.0)
    got = {k: (a, b, d) for k, a, b, d in rows}
    assert ok and got[verification.CURVE_DIFF] == ("2 rounds", "2 rounds", 0.0)
    bad = {**rec, "curve": [rec["curve"][0], [rec["curve"][1][0], rec["curve"][1][1] + 0.125]]}
    ok, rows = verification.verify(bad, tol=1e-9)
    assert not ok and dict((k, d) for k, _, _, d in rows)[verification.CURVE_DIFF] == pytest.approx(-0.125)
    short = {**rec, "curve": rec["curve"][:1]}
    ok, rows = verification.verify(short)
    assert not ok and dict((k, d) for k, _, _, d in rows)[verification.CURVE_DIFF] is None


def test_verify_compares_the_recorded_costs_and_the_metrics_its_spec_reads(tmp_path, monkeypatch):
    """The benchmark's "to target" columns read a record's ``costs`` (cumulative bytes and FLOPs per evaluation)
    and a table may read any final metric (the learning-rate table: ``val_accuracy``): ``verify`` compares both,
    so a tampered byte count or validation accuracy is caught; the costs' seconds are time and never compared."""
    rec = make_record(_tiny_run(tmp_path, 0), "tiny", {"method": "fedavg"}, commit="0" * 40)
    ok, rows = verification.verify(rec, tol=0.0)
    assert ok and {k: d for k, _, _, d in rows}[verification.COSTS_DIFF] == 0.0
    slow = {**rec, "costs": [[r, b, f, s + 99.0] for r, b, f, s in rec["costs"]]}
    assert verification.verify(slow, tol=0.0)[0]
    more = {**rec, "costs": [[r, b + 4096, f, s] for r, b, f, s in rec["costs"]]}
    ok, rows = verification.verify(more, tol=0.0)
    assert not ok and {k: d for k, _, _, d in rows}[verification.COSTS_DIFF] == -4096
    assert verification.assess(more).outcome == "differs"
    # a metric only the table's spec reads: checked once the spec says so
    off = {**rec, "metrics": {**rec["metrics"], "val_accuracy": rec["metrics"]["val_accuracy"] + 0.5}}
    assert verification.verify(off, tol=0.0)[0]  # no spec for table "tiny": val_accuracy is not a table metric
    spec = {"id": "tiny", "rows": ["method"], "columns": [{"header": "v", "metric": "val_accuracy", "agg": "mean"}]}
    (tmp_path / "results" / "tables").mkdir(parents=True)
    (tmp_path / "results" / "tables" / "tiny.json").write_text(json.dumps(spec))
    monkeypatch.setattr(verification, "repo_root", lambda: tmp_path)
    assert verification.spec_metrics(off) == {"val_accuracy"}
    ok, rows = verification.verify(off, tol=0.0)
    assert not ok and {k: d for k, _, _, d in rows}["val_accuracy"] == pytest.approx(-0.5)


def test_cli_results_render_check_and_list(tmp_path, capsys):
    from fedfuse.cli import main

    root = tmp_path / "repo"
    (root / "results" / "tables").mkdir(parents=True)
    (root / "results" / "tables" / "t.json").write_text(json.dumps(SPEC))
    for r in (_rec("a", 0, 0.9, 0.9, 0.9), _rec("b", 0, 0.5, 0.5, 0.5)):
        records.write_record(root, r)
    (root / "README.md").write_text("<!-- results: t -->\n<!-- /results -->\n")
    assert main(["results", "--root", str(root), "render", "--check"]) == 1
    assert main(["results", "--root", str(root), "render"]) == 0
    assert main(["results", "--root", str(root), "render", "--check"]) == 0
    assert main(["results", "--root", str(root), "list"]) == 0
    assert "t: 2 records, 0 stale" in capsys.readouterr().out
    # the store's own answers, without the command line
    records.write_record(root, _rec("c", 0, 0.7, behaviour={"*": 0, "c": 1}))  # made on older engine code
    assert records.table_counts(root) == [("t", 3, 1)]
    assert records.rendered_blocks(root) == (1, 1, 2)  # README.md: one table of rows a, b (rendered before c)


def test_claims_rows_computed_from_records_and_typed_rows_marked(tmp_path):
    root = tmp_path / "repo"
    (root / "results" / "tables").mkdir(parents=True)
    for r in (_rec("a", 0, 0.90), _rec("a", 1, 0.80), _rec("a", 2, 0.85),
              _rec("b", 0, 0.70), _rec("b", 1, 0.72), _rec("b", 2, 0.68)):
        records.write_record(root, r)
    spec = {"id": "claims", "kind": "claims", "rows": [
        {"family": "A", "claim": "a > b", "table": "t", "pairs": [["a", "b"]], "metric": "global_accuracy",
         "group": {"mu": 0.5}, "label": "toy", "where": "here"},
        {"family": "A", "claim": "b > a", "table": "t", "pairs": [["b", "a"]], "metric": "global_accuracy"},
        {"family": "B", "claim": "typed", "measured": "1 > 0", "holds": "**yes**", "where": "there"}]}
    (root / "results" / "tables" / "claims.json").write_text(json.dumps(spec))
    lines = records.render_claims(spec, root).splitlines()
    assert lines[2] == "| A | a > b | toy: a 85.0 vs b 70.0 % (+15.0, p = 0.053) | yes (n.s.) | here |"
    assert lines[3].endswith("| no (n.s.) |  |")  # b is below a on every seed, p = 0.053 (no link given)
    assert lines[4] == f"| B | typed | 1 > 0 {records.TYPED} | **yes** | there |"
    block = records.render_block(root, "claims")
    assert "2 rows computed from 6 records (`t`); the 1 rows marked ✎ are typed by hand" in block
    computed = {**spec, "rows": spec["rows"][:2]}
    (root / "results" / "tables" / "claims.json").write_text(json.dumps(computed))
    assert "2 rows computed from 6 records (`t`); every row is computed, none typed by hand." in \
        records.render_block(root, "claims")


def test_claims_row_with_parts_over_two_tables(tmp_path):
    """A row with ``parts`` joins each part's comparison (its own table and group) and its verdict covers every
    pair: better in both parts but one not significant → yes (n.s.); worse in one part → partly."""
    root = tmp_path / "repo"
    (root / "results" / "tables").mkdir(parents=True)
    for r in (_rec("a", 0, 0.90), _rec("a", 1, 0.80), _rec("a", 2, 0.85),
              _rec("b", 0, 0.70), _rec("b", 1, 0.72), _rec("b", 2, 0.68)):
        records.write_record(root, r)
    for r in (_rec("a", 0, 0.50), _rec("a", 1, 0.60), _rec("a", 2, 0.55),
              _rec("b", 0, 0.40), _rec("b", 1, 0.50), _rec("b", 2, 0.45)):
        records.write_record(root, {**r, "table": "u"})
    row = {"family": "A", "claim": "a > b", "metric": "global_accuracy", "pairs": [["a", "b"]],
           "parts": [{"table": "t", "label": "T"}, {"table": "u", "label": "U"}]}
    measured, holds = records.claim_cells(row, root=root)
    # u: a − b = +0.10 on every seed: no variance, so no test (p n/a, not significant)
    assert measured == "T: a 85.0 vs b 70.0 % (+15.0, p = 0.053); U: a 55.0 vs b 45.0 % (+10.0, p = n/a)"
    assert holds == "yes (n.s.)"
    flipped = {**row, "parts": [{"table": "t", "label": "T"}, {"table": "u", "label": "U", "pairs": [["b", "a"]]}]}
    assert records.claim_cells(flipped, root=root)[1] == "partly"
    assert records.claim_cells({**row, "parts": [{"table": "none"}]}, root=root) == ("no records", "—")
    spec = {"id": "claims", "kind": "claims", "rows": [{**row, "family": "A", "claim": "a > b", "where": ""}]}
    (root / "results" / "tables" / "claims.json").write_text(json.dumps(spec))
    assert "1 rows computed from 12 records (`t`, `u`)" in records.render_block(root, "claims")
    assert records.claim_verdict([True, True], [True, True]) == "**yes**"
    assert records.claim_verdict([False, False], [True, False]) == "no (n.s.)"


def test_claims_row_and_paired_table_where_lower_is_better(tmp_path):
    """Perplexity: with ``higher_is_better: false`` "a better than b" means a below b; the text keeps the signed
    difference a − b, in the row's own unit and scale."""
    root = tmp_path / "repo"
    (root / "results" / "tables").mkdir(parents=True)
    ppl = {"a": [800.0, 810.0, 815.0], "b": [830.0, 829.0, 850.0]}
    for m, vals in ppl.items():
        for seed, v in enumerate(vals):
            records.write_record(root, {**_rec(m, seed, None), "metrics": {"perplexity": v}})
    row = {"family": "A", "claim": "lowest perplexity", "table": "t", "pairs": [["a", "b"], ["b", "a"]],
           "metric": "perplexity", "scale": 1, "digits": 0, "unit": "", "higher_is_better": False}
    recs = records.load_records(root, "t")
    measured, holds = records.claim_cells(row, recs)
    # a − b = −30, −19, −35: mean −28, sd 8.19, t = −5.92 on 2 df, p = 1 − |t| / √(t² + 2) = 0.0273
    assert measured == "a 808 vs b 836 (-28, p = 0.027); b 836 vs a 808 (+28, p = 0.027)"
    assert holds == "partly"  # a below b holds; b below a does not
    assert records.claim_cells({**row, "pairs": [["a", "b"]]}, recs)[1] == "**yes**"
    assert records.claim_cells({**row, "pairs": [["b", "a"]]}, recs)[1] == "no"
    assert records.claim_cells({**row, "pairs": [["a", "b"]], "higher_is_better": True}, recs)[1] == "no"
    spec = {"id": "t", "kind": "paired", "by": "method", "group": ["mu"], "pairs": [["a", "b"], ["b", "a"]],
            "metric": "perplexity", "scale": 1, "digits": 1, "higher_is_better": False}
    lines = render_table(spec, recs).splitlines()
    assert lines[2] == "| 0.5 | a vs b | -28.0 | 0.0273 | yes |"
    assert lines[3] == "| 0.5 | b vs a | +28.0 | 0.0273 | no |"


def test_verify_rebuilds_a_lora_reproduction_run_on_its_recorded_base(tmp_path):
    """A `reproduce fedmerge-lora` run builds its clients from the base's tokenizer (the config names a plain
    Shakespeare run): the record's ``lora`` federation lets ``verify`` rebuild them and re-run bit for bit; a
    base whose weights differ from the recorded ones or a missing base of another name stops the re-run."""
    import os
    from pathlib import Path

    from fedfuse.cli import main
    from fedfuse.reproduce.fedmerge_lora import base_state_sha256, record_federation
    from support import SHARED_DATA, lora_tiny_base, needs_extra

    needs_extra("lora")
    roots = [SHARED_DATA, Path(os.environ.get("FEDFUSE_DATA", "-"))]
    data = next((r for r in roots if (r / "shakespeare-leaf").is_dir()), None)
    if data is None:
        pytest.skip("LEAF Shakespeare raw roles not available")
    base = lora_tiny_base(tmp_path)
    out = tmp_path / "out"
    assert main(["reproduce", "fedmerge-lora", "--quick", "--base", base, "--rounds", "1", "--clients", "3",
                 "--methods", "fedit", "--seeds", "0,", "--data-dir", str(data), "--out", str(out),
                 "--no-progress", "--no-report"]) in (0, None)
    run = json.loads((out / "results.json").read_text())["lora-roles"]["runs"]["fedit"][0]["dir"]
    sha = base_state_sha256(base.removeprefix("fedfuse:"))
    fed = record_federation("roles", quick=True, clients=3, base_sha=sha)
    rec = make_record(run, "t", {"split": "roles", "method": "fedit"}, commit="0" * 40, federation=fed)
    assert rec["metrics"]["personal_perplexity"] > 1 and rec["federation"]["kind"] == "lora"
    ok, rows = verification.verify(rec, data_dir=str(data), tol=0.0)
    assert ok and dict((k, d) for k, _, _, d in rows)["personal_perplexity"] == 0.0
    with pytest.raises(SystemExit, match="not the recorded one"):
        verification.verify({**rec, "federation": {**fed, "base_state_sha256": "0" * 64}}, data_dir=str(data))
    gone = {**rec["config"], "algorithm_options": {**rec["config"]["algorithm_options"],
                                                   "base": f"fedfuse:{tmp_path / 'gone.pt'}"}}
    with pytest.raises(SystemExit, match="missing"):
        verification.verify({**rec, "config": gone}, data_dir=str(data))


def test_base_state_hash_reads_the_weights_not_the_file(tmp_path):
    """A re-pretrained base differs in its file (the wall time in ``info``) but not in its weights: same hash;
    one changed weight changes it."""
    from pathlib import Path

    import torch

    from fedfuse.reproduce.fedmerge_lora import base_state_sha256
    from support import lora_tiny_base

    path = lora_tiny_base(tmp_path).removeprefix("fedfuse:")
    ck = torch.load(path, weights_only=True)
    torch.save({**ck, "info": {"seconds": 12.5}}, tmp_path / "again.pt")
    assert (tmp_path / "again.pt").read_bytes() != Path(path).read_bytes()
    assert base_state_sha256(tmp_path / "again.pt") == base_state_sha256(path)
    name = sorted(ck["state"])[0]
    state = {**ck["state"], name: ck["state"][name].clone()}
    state[name].view(-1)[0] += 1e-6
    torch.save({**ck, "state": state}, tmp_path / "changed.pt")
    assert base_state_sha256(tmp_path / "changed.pt") != base_state_sha256(path)


class _Payload:
    """A pickled payload: unpickling it with ``weights_only=False`` runs ``touch MARKER``."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _lora_record(base: str, federation: dict | None) -> dict:
    rec = {"table": "t", "cell": {"method": "fedit"}, "seed": 0, "commit": "0" * 40, "metrics": {},
           "config": {"algorithm": "fedit", "dataset": "tiny-shakespeare", "seed": 0,
                      "algorithm_options": {"base": base}}}
    return {**rec, "federation": federation} if federation is not None else rec


def test_verify_refuses_a_lora_record_without_its_base_digest(tmp_path):
    """Adversary: whoever edits a results record (a pull request, a shared results folder).  A record naming a
    LoRA base but not its weights digest would re-run on whatever file sits at that path: refused."""
    from fedfuse.reproduce.fedmerge_lora import record_federation

    base = f"fedfuse:{tmp_path / 'base.pt'}"
    for fed in (None, record_federation("roles", base_sha=""), {"kind": "lora", "base_state_sha256": "xyz"}):
        with pytest.raises(SystemExit, match="not its weights digest"):
            verification.verify(_lora_record(base, fed))


def test_a_tampered_lora_base_runs_no_code_during_verify(tmp_path, capsys):
    """The base a LoRA record names is replaced by a file whose pickle runs a payload: ``fedfuse results
    verify`` refuses it with one line, and the payload never runs (its base is read with ``weights_only``)."""
    from support import needs_extra

    needs_extra("lora")  # verify checks the extra first, before it reads any base
    import torch

    from fedfuse.adapters.lora import load_base
    from fedfuse.cli import main
    from fedfuse.config import ConfigError
    from fedfuse.reproduce.fedmerge_lora import record_federation
    from support import lora_tiny_base

    good = lora_tiny_base(tmp_path).removeprefix("fedfuse:")
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pt"
    torch.save({**torch.load(good, weights_only=True), "info": _Payload(marker)}, evil)
    root = tmp_path / "repo"
    rec = _lora_record(f"fedfuse:{evil}", record_federation("roles", quick=True, clients=3, base_sha="a" * 64))
    records.write_record(root, {**rec, "config_hash": "0"})
    capsys.readouterr()
    assert main(["results", "--root", str(root), "verify", "--table", "t", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedfuse: error:") and len(err.splitlines()) == 1 and "posix.system" in err, err
    with pytest.raises(ConfigError, match="refused"):  # the LoRA algorithms' own loader refuses it too
        load_base(f"fedfuse:{evil}")
    assert not marker.exists()


def test_cli_results_render_says_what_it_checked(tmp_path, capsys):
    """`results render --check` names what it compared when everything matches (it printed nothing)."""
    from fedfuse.cli import main

    root = tmp_path / "repo"
    (root / "results" / "tables").mkdir(parents=True)
    (root / "results" / "tables" / "t.json").write_text(json.dumps(SPEC))
    for r in (_rec("a", 0, 0.9, 0.9, 0.9), _rec("b", 0, 0.5, 0.5, 0.5)):
        records.write_record(root, r)
    (root / "README.md").write_text("<!-- results: t -->\n<!-- /results -->\n")
    assert main(["results", "--root", str(root), "render"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ("1 table (2 rows) in 1 document, from 2 records: "
                                                         "1 document rewritten")
    assert main(["results", "--root", str(root), "render", "--check"]) == 0
    assert capsys.readouterr().out.strip() == "checked 1 table (2 rows) in 1 document, from 2 records: all match"


def test_best_within_bolds_the_best_row_of_each_group():
    """``best_within`` bolds, per group of rows sharing those row keys, the row with the best mean (highest, or
    lowest with ``higher_is_better: false``); ties are all bold; a row without values is never bold."""
    col = {"header": "acc", "metric": "global_accuracy", "agg": "mean_std", "scale": 100, "digits": 1,
           "best_within": ["method"]}
    spec = {"id": "t", "rows": ["method", "mu"], "order": {"method": ["a", "b"]},
            "columns": [{"header": "method", "key": "method"}, {"header": "mu", "key": "mu"}, col]}

    def rec(method, seed, acc, mu):
        return {**_rec(method, seed, acc), "cell": {"method": method, "mu": mu}}

    recs = [rec("a", 0, 0.6, 0.1), rec("a", 1, 0.8, 0.1),      # a, 0.1: 70.0 ± 14.1
            rec("a", 0, 0.75, 0.2),                            # a, 0.2: 75.0, a's best
            rec("b", 0, 0.5, 0.1), rec("b", 0, 0.5, 0.2),      # b: a tie, both bold
            {**rec("b", 0, 0.9, 0.3), "metrics": {}}]          # b, 0.3: no value
    rows = render_table(spec, recs).splitlines()[2:]
    assert rows == ["| a | 0.1 | 70.0 ± 14.1 |", "| a | 0.2 | **75.0** |",
                    "| b | 0.1 | **50.0** |", "| b | 0.2 | **50.0** |", "| b | 0.3 | — |"]
    low = {**spec, "columns": [*spec["columns"][:2], {**col, "higher_is_better": False}]}
    assert render_table(low, recs[:3]).splitlines()[2] == "| a | 0.1 | **70.0 ± 14.1** |"


def _diverged_run(tmp_path):
    """A run that diverges in round 1 (every client's reply NaN, no update checks): its directory holds
    diverged.json and no summary."""
    from fedfuse.config import RunConfig, apply
    from fedfuse.errors import DivergenceError
    from fedfuse.runner import experiment

    cfg = apply(RunConfig(), dict(algorithm="fedavg", dataset="digits", model="mlp", clients=4, clients_per_round=2,
                                  rounds=3, eval_every=1, seed=0, plots=False, threads=1, check_updates=False,
                                  corrupt="nan", corrupt_clients=[0, 1, 2, 3], out=str(tmp_path / "bad")))
    with pytest.raises(DivergenceError):
        experiment(cfg, progress=False).run()
    return tmp_path / "bad"


def test_a_diverged_run_is_recorded_rendered_and_verified_as_an_outcome(tmp_path):
    """A diverged run's record holds the round and why, no final metrics; a table shows the seed as diverged
    and leaves it out of the mean; verify re-runs it to the same divergence, and catches a record that claims
    another fate (another round, or a finish)."""
    rec = make_record(_diverged_run(tmp_path), "tiny", {"method": "fedavg"}, commit="0" * 40)
    assert rec["diverged"]["round"] == 1 and "non-finite" in rec["diverged"]["why"]
    assert rec["metrics"] == {"round": 0}  # no final metrics: what it spent (no round finished here)
    assert records.curve_value(rec, {"last": 5}) is None
    good = {**_rec("fedavg", 0, 0.5), "curve": [[1, 0.5]]}
    spec = {"id": "t", "rows": ["method"],
            "columns": [{"header": "m", "key": "method"},
                        {"header": "acc", "curve": {"last": 1}, "agg": "mean_std", "scale": 100, "digits": 1},
                        {"header": "per seed", "curve": {"last": 1}, "agg": "per_seed", "scale": 100, "digits": 1}]}
    row = render_table(spec, [good, {**rec, "seed": 1}]).splitlines()[2]
    assert row == "| fedavg | 50.0 (1 of 2 diverged) | 50.0 / diverged r1 |"
    res = verification.assess(rec)
    assert res.outcome == "bit for bit", res.message
    assert {k: d for k, _, _, d in res.rows}[verification.DIVERGED_ROW] == 0.0
    later = {**rec, "diverged": {**rec["diverged"], "round": 2}}
    assert verification.assess(later).outcome == "differs"
    finished = {k: v for k, v in rec.items() if k != "diverged"}
    out = verification.assess(finished)
    assert out.outcome == "differs" and out.message == "NOT reproduced: recorded finished, re-run diverged in round 1"


def test_paired_and_best_rows_leave_diverged_runs_out():
    """A paired comparison pairs only the seeds where neither run diverged (and says how many did); a row with a
    diverged run is never bolded as the best, even when its surviving runs lead."""
    def rec(method, seed, acc, gone=False):
        r = {**_rec(method, seed, acc), "cell": {"method": method, "mu": 0.5}}
        return {**r, "metrics": {}, "diverged": {"round": 3, "why": "x", "lr": 0.2}} if gone else r

    recs = [rec("a", 0, 0.9), rec("a", 1, 0.8), rec("a", 2, 0.7, gone=True),
            rec("b", 0, 0.5), rec("b", 1, 0.6), rec("b", 2, 0.55)]
    paired = {"id": "p", "kind": "paired", "by": "method", "group": ["mu"], "pairs": [["a", "b"]],
              "metric": "global_accuracy", "scale": 100, "digits": 1}
    row = render_table(paired, recs).splitlines()[2]
    # seeds 0 and 1: differences 0.4 and 0.2, mean +30.0
    assert row.startswith("| 0.5 | a vs b (1 of 6 runs diverged: paired over the rest) | +30.0 |")
    spec = {"id": "t", "rows": ["method"], "columns": [
        {"header": "m", "key": "method"},
        {"header": "acc", "metric": "global_accuracy", "agg": "mean_std", "scale": 100, "digits": 1,
         "best_within": []}]}
    rows = render_table(spec, recs).splitlines()[2:]
    assert rows == ["| a | 85.0 ± 7.1 (1 of 3 diverged) |", "| b | **55.0 ± 5.0** |"]
