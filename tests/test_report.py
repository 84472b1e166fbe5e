"""Reports (Markdown + HTML with per-metric mean ± std figures) and the metrics-callback interface."""

import json

import pytest

import fedfuse
from fedfuse.engine.callbacks import Callback, CSVLogger, make_loggers, scalars
from fedfuse.plots import mean_band
from fedfuse.report import write_report

SMALL = dict(dataset="digits", rounds=2, clients=4, clients_per_round=2, model="mlp",
             model_options={"widths": [8]}, threads=1)


def _fake_run(d, algorithm, seed, accs, extra_png=False):
    """A run directory written by hand: config.yaml, metrics.jsonl, summary.json (no training)."""
    cfg = fedfuse.make_config(algorithm=algorithm, seed=seed, rounds=len(accs))
    d.mkdir(parents=True)
    from fedfuse.config import dump_yaml

    dump_yaml(cfg, d / "config.yaml")
    recs = [{"round": r + 1, "global_accuracy": a, "personal_accuracy": a - 0.1, "loss": 2.0 / (r + 1),
             "total_bytes_down": 1000 * (r + 1), "total_bytes_up": 1000 * (r + 1), "clients": [0, 1]}
            for r, a in enumerate(accs)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    (d / "summary.json").write_text(json.dumps({"final": recs[-1], "best": recs[-1]}))
    if extra_png:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        ax.imshow([[0, 1], [1, 0]])
        fig.savefig(d / "merge_weights_final.png")
        for r in (1, 2, 10):  # a per-round series: only the last round goes into the report
            fig.savefig(d / f"merge_weights_r{r:04d}.png")
        plt.close(fig)


def test_mean_band_by_hand():
    h1 = [{"round": 1, "x": 0.2}, {"round": 2, "x": 0.4}]
    h2 = [{"round": 1, "x": 0.4}, {"round": 2, "x": None}]
    xs, m, s, n = mean_band([h1, h2], "x")
    assert list(xs) == [1, 2] and list(n) == [2, 1]
    assert m[0] == pytest.approx(0.3) and s[0] == pytest.approx(0.1414213, rel=1e-5) and s[1] == 0.0


def test_report_of_a_tree_of_runs_groups_seeds_and_includes_diagnostics(tmp_path):
    _fake_run(tmp_path / "a0", "fedavg", 0, [0.5, 0.6, 0.7])
    _fake_run(tmp_path / "a1", "fedavg", 1, [0.5, 0.62, 0.72])
    _fake_run(tmp_path / "b0", "fedprox", 0, [0.55, 0.7, 0.8], extra_png=True)
    _fake_run(tmp_path / "b1", "fedprox", 1, [0.56, 0.71, 0.81])
    md = write_report(tmp_path, last=1).read_text()
    assert "| fedavg | 2 | 71.00 ± 1.41 |" in md and "| fedprox | 2 | 80.50 ± 0.71 |" in md
    assert "![global_accuracy](report/global_accuracy.png)" in md and "![loss](report/loss.png)" in md
    assert "fedprox_merge_weights_final.png" in md
    assert (tmp_path / "report" / "fedprox_merge_weights_final.png").exists()
    assert "merge_weights_r0010.png" in md and "merge_weights_r0002.png" not in md
    assert "Options that differ between labels" in md and "algorithm_options.mu" in md
    html = (tmp_path / "report.html").read_text()
    assert html.startswith("<!doctype html>") and "<table>" in html and "report/loss.png" in html
    for f in ("global_accuracy", "personal_accuracy", "loss", "global_accuracy_vs_bytes"):
        assert (tmp_path / "report" / f"{f}.png").stat().st_size > 0
    one = write_report(tmp_path / "a0").read_text()  # a single run directory
    assert "| fedavg | 1 |" in one and "vs fedavg" not in one


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_run_start(self, config):
        self.events.append(("start", config.algorithm))

    def on_round(self, record):
        self.events.append(("round", record["round"], record.get("global_accuracy")))

    def on_run_end(self, summary):
        self.events.append(("end", summary["rounds_completed"]))


def test_callbacks_see_every_round_and_csv_logger_writes(tmp_path):
    rec = Recorder()
    res = fedfuse.run(algorithm="fedavg", out=str(tmp_path / "r"), callbacks=[rec], log=["csv"], **SMALL)
    assert rec.events[0] == ("start", "fedavg") and rec.events[-1] == ("end", 2)
    rounds = [e for e in rec.events if e[0] == "round"]
    assert [(r, a) for _, r, a in rounds] == [(h["round"], h["global_accuracy"]) for h in res.history]
    import pandas as pd

    csv = pd.read_csv(tmp_path / "r" / "metrics.csv")
    assert list(csv["round"]) == [1, 2]
    assert csv["global_accuracy"].tolist() == pytest.approx(res.metrics["global_accuracy"].tolist())
    assert scalars({"a": 1, "b": None, "c": float("nan"), "d": [1], "e": True, "f": 2.5}) == {"a": 1.0, "f": 2.5}
    with pytest.raises(fedfuse.ConfigError, match="unknown logger 'nope'"):
        make_loggers("csv,nope")
    assert isinstance(make_loggers("csv")[0], CSVLogger)


def test_tensorboard_logger_writes_events(tmp_path):
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install -e '.[tensorboard]'")
    fedfuse.run(algorithm="fedavg", out=str(tmp_path / "r"), log=["tensorboard"], **SMALL)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    ev.Reload()
    acc = ev.Scalars("global_accuracy")
    assert [e.step for e in acc] == [1, 2] and all(0 <= e.value <= 1 for e in acc)


def test_mlflow_logger_calls(monkeypatch, tmp_path):
    """MLflow's API as the logger uses it (a recording stand-in when mlflow is not installed)."""
    import sys
    import types

    calls = []
    fake = types.SimpleNamespace(
        set_experiment=lambda name: calls.append(("experiment", name)),
        start_run=lambda run_name: calls.append(("start", run_name)),
        log_params=lambda p: calls.append(("params", p)),
        log_metrics=lambda m, step=None: calls.append(("metrics", step, m)),
        end_run=lambda: calls.append(("end",)),
    )
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    from fedfuse.engine.callbacks import MLflowLogger

    res = fedfuse.run(algorithm="fedprox", callbacks=[MLflowLogger("exp")], mu=0.1, **SMALL)
    assert calls[0] == ("experiment", "exp") and calls[1] == ("start", "fedprox-digits-seed0")
    params = calls[2][1]
    assert params["algorithm"] == "fedprox" and params["algorithm_options.mu"] == "0.1"
    steps = [c for c in calls if c[0] == "metrics" and c[1] is not None]
    assert [c[1] for c in steps] == [1, 2]
    assert steps[-1][2]["global_accuracy"] == pytest.approx(res.history[-1]["global_accuracy"])
    assert calls[-1] == ("end",) and calls[-2][0] == "metrics" and "final_global_accuracy" in calls[-2][2]


def test_report_html_grid_inline_markdown_and_missing_values(tmp_path):
    """Figures share a responsive grid, Markdown's `code` becomes <code>, a missing value is an em dash in the
    HTML as in the Markdown, no cell wraps inside a number, partition options read as key=value."""
    _fake_run(tmp_path / "a0", "fedavg", 0, [0.5, 0.6, 0.7])
    _fake_run(tmp_path / "b0", "fedprox", 0, [0.55, 0.7, 0.8])
    write_report(tmp_path, last=1)
    html = (tmp_path / "report.html").read_text()
    assert "display:grid" in html and "<div class='grid'>" in html and "white-space:nowrap" in html
    assert "<code>fedfuse run --config config.yaml</code>" in html and "`" not in html.split("<pre>")[0]
    assert ">None<" not in html and "—" in html  # fedavg has no mu: an em dash, as in report.md
    assert "partition dirichlet (alpha=0.5, min_size=10, balance=true, max_attempts=1000)" in html


def test_plots_in_percent_with_readable_log_ticks(tmp_path):
    import matplotlib.pyplot as plt

    from fedfuse.plots import draw_metric

    hist = [{"round": r, "global_accuracy": 0.5 + 0.01 * r, "loss": 0.4 + 0.05 * r} for r in range(1, 9)]
    fig, (a, b) = plt.subplots(1, 2)
    assert draw_metric(a, {"x": [hist]}, "global_accuracy") and draw_metric(b, {"x": [hist]}, "loss")
    assert a.get_ylabel().endswith("(%)") and max(a.lines[0].get_ydata()) == pytest.approx(58.0)
    fig.canvas.draw()
    lo, hi = b.get_ylim()
    labels = [t.get_text() for t in b.get_yticklabels() if t.get_text() and lo <= t.get_position()[1] <= hi]
    assert len(labels) >= 3, labels  # 0.4..0.8 spans less than a decade: 0.5, 0.6, 0.7, ... not just 0.5
    plt.close(fig)


def test_partition_plot_integer_client_ids_and_headroom(tmp_path):
    from matplotlib.image import imread

    from fedfuse.data.report import plot_partition
    from fedfuse.engine.loop import build_federation

    fed = build_federation(fedfuse.make_config(clients=7, clients_per_round=2))
    import matplotlib.figure

    captured = {}
    original = matplotlib.figure.Figure.savefig

    def keep(self, *args, **kwargs):
        captured["ax"] = self.axes[0]
        return original(self, *args, **kwargs)

    matplotlib.figure.Figure.savefig = keep
    try:
        plot_partition(fed, tmp_path / "p.png")
    finally:
        matplotlib.figure.Figure.savefig = original
    ax = captured["ax"]
    ticks = [t for t in ax.get_xticks() if -0.6 <= t <= 6.4]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert ax.get_ylim()[1] >= 1.05 * max(fed.client_sizes())
    assert imread(tmp_path / "p.png").shape[0] > 0


def test_report_renders_in_a_headless_browser(tmp_path):
    """At 1280 px the page has no horizontal overflow and the figures sit side by side (a short page)."""
    import re
    import shutil
    import subprocess

    browser = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no headless browser (chromium) installed")
    for i, acc in enumerate(([0.5, 0.6, 0.7], [0.52, 0.61, 0.72], [0.55, 0.7, 0.8], [0.56, 0.71, 0.79])):
        _fake_run(tmp_path / f"r{i}", "fedavg" if i < 2 else "fedprox", i % 2, acc)
    write_report(tmp_path, last=1)
    page = (tmp_path / "report.html").read_text()
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", "<script>document.title = document.documentElement.scrollWidth + 'x'"
                                            " + document.documentElement.scrollHeight</script></body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'chromium-profile'}"]
    dom = subprocess.run([browser, *flags, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=180).stdout
    width, height = map(int, re.search(r"<title>(\d+)x(\d+)</title>", dom).groups())
    assert width <= 1280 and height < 4500, (width, height)  # one ~500-px column of 6 figures would be taller
    shot = tmp_path / "shot.png"
    subprocess.run([browser, *flags, f"--screenshot={shot}", (tmp_path / "report.html").as_uri()],
                   capture_output=True, timeout=180)
    assert shot.stat().st_size > 10_000
