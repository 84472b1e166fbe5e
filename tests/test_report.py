"""Reports (report.py): Markdown + HTML with per-metric mean ± std figures over a tree of runs, the HTML grid, and a
headless-browser rendering."""

import json

import pytest

import fedfuse
from fedfuse.report import write_report


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
