"""``fedfuse report DIR``: one Markdown and one HTML page for a run, a sweep or any tree of runs.

The page holds the configuration (the first run's in full, and what differs between labels), the statistics
table (:class:`fedfuse.result_table.ResultTable`), one figure per metric (mean line with a ±std band over seeds; loss
and perplexity on a log scale; accuracy against cumulative communication), the partition plot and the
algorithm's own diagnostic images found in the run directories (merge heat-maps, similarity curves, ...).
Figures go to ``DIR/report/``; the pages are ``DIR/report.md`` and ``DIR/report.html``.
"""

from __future__ import annotations

import html
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from fedfuse.config import RunConfig
from fedfuse.plots import available_metrics, plot_metric
from fedfuse.result import Result
from fedfuse.result_table import ResultTable
from fedfuse.runfiles import CURVES, METRICS, PARTITION_PNG
from fedfuse.sweep import _flatten, load_sweep
from fedfuse.tables import cell

CURVE_METRICS = ("global_accuracy", "personal_accuracy", "personal_accuracy_weighted", "val_accuracy", "loss",
                 "val_loss", "train_loss", "perplexity", "personal_perplexity")
# Files every run writes; anything else that is a PNG in a run directory is the algorithm's own diagnostic.
_STANDARD_PNG = {CURVES, PARTITION_PNG}


class _Page:
    """Blocks rendered both as Markdown and as HTML."""

    def __init__(self) -> None:
        self.blocks: list[tuple[str, Any]] = []

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", (level, text)))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def code(self, text: str) -> None:
        self.blocks.append(("code", text))

    def table(self, rows: list[dict[str, Any]], note: str = "") -> None:
        self.blocks.append(("table", (rows, note)))

    def img(self, rel: str, alt: str) -> None:
        self.blocks.append(("img", (rel, alt)))

    def markdown(self) -> str:
        from fedfuse.tables import markdown

        out = []
        for kind, v in self.blocks:
            if kind == "h":
                out.append("#" * v[0] + " " + v[1])
            elif kind == "p":
                out.append(v)
            elif kind == "code":
                out.append("```yaml\n" + v.rstrip() + "\n```")
            elif kind == "table":
                out.append(markdown(v[0]) + (f"\n\n{v[1]}" if v[1] else ""))
            elif kind == "img":
                out.append(f"![{v[1]}]({v[0]})")
        return "\n\n".join(out) + "\n"

    def html(self, title: str) -> str:
        out = [_html_head(title)]
        in_grid = False
        for kind, v in self.blocks:
            if in_grid != (kind == "img"):  # consecutive figures share a responsive grid
                out.append("<div class='grid'>" if kind == "img" else "</div>")
                in_grid = kind == "img"
            out += _html_block(kind, v)
        if in_grid:
            out.append("</div>")
        out.append("</body></html>")
        return "\n".join(out)


#: A page of blocks rendered both as Markdown and as HTML (e.g. the benchmark matrix of ``fedfuse bench``).
Page = _Page


def _html_head(title: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{html.escape(title)}</title><style>"
            "body{font-family:system-ui,sans-serif;max-width:1500px;margin:2em auto;padding:0 1em}"
            "table{border-collapse:collapse;font-size:14px;display:block;overflow-x:auto;max-width:100%}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right;white-space:nowrap}"
            "td:first-child,th:first-child{text-align:left}pre{background:#f6f6f6;padding:8px;overflow:auto}"
            "code{background:#f3f3f3;padding:0 3px}img{max-width:100%;height:auto}"
            ".note{color:#555;font-size:13px}"
            ".grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,440px),1fr));gap:12px}"
            ".grid figure{margin:0}.grid figcaption{font-size:13px;color:#555;text-align:center}"
            "</style></head><body>")


def _html_block(kind: str, v: Any) -> list[str]:
    """The HTML lines of one block of a :class:`_Page`."""
    e = html.escape
    if kind == "h":
        return [f"<h{v[0]}>{e(v[1])}</h{v[0]}>"]
    if kind == "p":
        return [f"<p>{inline_html(v)}</p>"]
    if kind == "code":
        return [f"<pre>{e(v)}</pre>"]
    if kind == "table":
        return _html_table(*v)
    if kind == "img":
        return [f"<figure><img src='{e(v[0])}' alt='{e(v[1])}'><figcaption>{e(v[1])}</figcaption></figure>"]
    return []


def _html_table(rows: list[dict[str, Any]], note: str) -> list[str]:
    """A table's HTML lines (the columns of every row, in first-seen order) and its note."""
    e = html.escape
    out = []
    if rows:
        cols: list[str] = []
        for r in rows:
            cols += [c for c in r if c not in cols]
        out.append("<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in cols) + "</tr>")
        for r in rows:
            out.append("<tr>" + "".join(f"<td>{e(cell(r.get(c)))}</td>" for c in cols) + "</tr>")
        out.append("</table>")
    if note:
        out.append(f"<p class='note'>{inline_html(note)}</p>")
    return out


def inline_html(text: str) -> str:
    """Markdown's inline marks as HTML (``code``, **bold**, *emphasis*); everything else escaped."""
    import re

    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"(?<![*\w])\*([^*\s][^*]*)\*(?![*\w])", r"<em>\1</em>", out)


def _config_diffs(results: dict[str, list[Result]]) -> list[dict[str, Any]]:
    """Per label, the config keys (flattened) whose value differs between labels."""
    flat = {label: _flatten({**rs[0].config.to_dict(), "seed": None, "out": None})
            for label, rs in results.items() if rs}
    keys = sorted({k for f in flat.values() for k in f})
    varying = [k for k in keys if len({json.dumps(f.get(k), default=str) for f in flat.values()}) > 1]
    return [{"label": label, **{k: json.dumps(f.get(k)) if isinstance(f.get(k), list | dict) else f.get(k)
                                for k in varying}} for label, f in flat.items()] if varying else []


def options_text(options: dict[str, Any]) -> str:
    """``alpha=0.5, min_size=10`` (``none`` for None, lists as ``[2,3]``), or ``defaults`` when empty."""
    def show(v: Any) -> str:
        if v is None:
            return "none"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list | tuple):
            return "[" + ",".join(show(x) for x in v) + "]"
        return cell(v)

    return ", ".join(f"{k}={show(v)}" for k, v in options.items()) or "defaults"


def _diagnostic_pngs(run_dir: Path) -> list[Path]:
    """The algorithm's own PNGs in a run directory; of a per-round series (``name_r0010.png``) only the last."""
    import re

    series: dict[str, Path] = {}
    for f in sorted(run_dir.glob("*.png")):
        if f.name in _STANDARD_PNG:
            continue
        m = re.match(r"(.*?)_?r\d+$", f.stem)
        series[m.group(1) + "_r" if m else f.stem] = f  # sorted: the last round wins
    return sorted(series.values())


def write_compare(table: ResultTable, out: str | Path, *, plots: bool = True) -> Path:
    """The table's files (:meth:`ResultTable.write`: ``compare.md/.csv/.json``, with ``plots`` ``compare.png``)
    and, with ``plots``, the report when ``out`` holds the runs (``sweep.json`` from
    :meth:`~fedfuse.sweep.Sweep.execute` or run directories below it).  Returns the Markdown table's path."""
    md = table.write(out, plots=plots)
    root = Path(out)
    if plots and ((root / "sweep.json").exists() or any(root.rglob(METRICS))):
        write_report(root, metric=table.metric, last=table.last, target=table.target, baseline=table.baseline,
                     test=table.test)
    return md


def write_report(path: str | Path, *, metric: str = "auto", last: int = 5, target: float | None = None,
                 baseline: str | None = None, test: str = "t", title: str | None = None,
                 metrics: Sequence[str] | None = None) -> Path:
    """Write ``report.md``, ``report.html`` and ``report/*.png`` into ``path`` (a run directory, a sweep
    directory with ``sweep.json`` or any directory with run directories below it); returns the Markdown path."""
    root = Path(path)
    results = {k: v for k, v in load_sweep(root).items() if v}
    table = ResultTable(results, metric=metric, last=last, target=target, baseline=baseline, test=test)
    first = next(iter(results.values()))[0]
    figdir = root / "report"
    if figdir.exists():
        shutil.rmtree(figdir)
    figdir.mkdir(parents=True)
    page = _Page()
    head = title or f"{', '.join(results)} on {first.config.dataset}"
    page.h(1, head)
    page.p(_setup_line(first.config, results))
    _results_section(page, table)
    _curves_section(page, table, figdir, metrics)
    _partition_section(page, results, figdir, first.seed)
    _diagnostics_section(page, results, figdir)
    _configuration_section(page, results, first)
    _runs_section(page, table)
    (root / "report.md").write_text(page.markdown())
    (root / "report.html").write_text(page.html(head))
    return root / "report.md"


def _setup_line(cfg: RunConfig, results: dict[str, list[Result]]) -> str:
    """Dataset, partition, model, clients, rounds and seeds per label, in one line."""
    nseeds = sorted({len(v) for v in results.values()})
    return (f"{cfg.dataset} · partition {cfg.partition} ({options_text(cfg.partition_options)}) · model "
            f"{cfg.model} · {cfg.clients} clients, {cfg.clients_per_round} per round · {cfg.rounds} rounds · "
            f"seeds per label: {'/'.join(map(str, nseeds))}.")


def _results_section(page: _Page, table: ResultTable) -> None:
    page.h(2, "Results")
    md = table.to_markdown()
    page.table(table.display_rows(), md.split("\n\n", 1)[1] if "\n\n" in md else "")


def _curves_section(page: _Page, table: ResultTable, figdir: Path, metrics: Sequence[str] | None) -> None:
    """One figure per metric (``metrics``, or every curve metric the runs measured), then the table's metric
    against communication."""
    histories = table.histories()
    every = [h for hs in histories.values() for h in hs]
    keys = list(metrics) if metrics else available_metrics(every, CURVE_METRICS)
    page.h(2, "Curves")
    for key in keys:
        p = plot_metric(histories, key, figdir / f"{key}.png")
        if p is not None:
            page.img(f"report/{p.name}", key)
    acc = table.metric
    p = plot_metric(histories, acc, figdir / f"{acc}_vs_bytes.png", x="total_bytes")
    if p is not None:
        page.img(f"report/{p.name}", f"{acc} against communication")


def _partition_section(page: _Page, results: dict[str, list[Result]], figdir: Path, seed: int) -> None:
    """The first run's partition plot, when a run wrote one."""
    part = [r.out / PARTITION_PNG for rs in results.values() for r in rs if r.out]
    part = [p for p in part if p.exists()]
    if not part:
        return
    page.h(2, "Partition")
    shutil.copy(part[0], figdir / PARTITION_PNG)
    page.p(f"Per-client label histograms of seed {seed}'s partition (every label shares it for that seed).")
    page.img(f"report/{PARTITION_PNG}", "partition")


def _diagnostics_section(page: _Page, results: dict[str, list[Result]], figdir: Path) -> None:
    """The algorithms' own PNGs from each label's first run, copied under a name that says whose."""
    diag: list[tuple[str, Path]] = []
    for label, rs in results.items():
        r = rs[0]
        if r.out and r.out.is_dir():
            diag += [(label, f) for f in _diagnostic_pngs(r.out)]
    if not diag:
        return
    page.h(2, "Diagnostics")
    page.p("The algorithms' own figures, from each label's first seed.")
    for label, f in diag:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{label}_{f.name}")
        shutil.copy(f, figdir / safe)
        page.img(f"report/{safe}", f"{label}: {f.stem}")


def _configuration_section(page: _Page, results: dict[str, list[Result]], first: Result) -> None:
    """What differs between labels, and the first run's resolved configuration."""
    page.h(2, "Configuration")
    diffs = _config_diffs(results)
    if diffs:
        page.p("Options that differ between labels:")
        page.table(diffs)
    page.p(f"Resolved configuration of {next(iter(results))} (seed {first.seed}); rerun with "
           "`fedfuse run --config config.yaml`:")
    page.code(yaml.safe_dump({**first.config.to_dict(), "out": None}, sort_keys=False))


def _runs_section(page: _Page, table: ResultTable) -> None:
    """Final and best value of every run."""
    seeds_rows = table.per_seed().to_dict("records")
    page.h(2, "Runs")
    page.table([{k: (f"{100 * v:.2f}" if k in ("final", "best") and v is not None else v) for k, v in r.items()}
                for r in seeds_rows], f"final / best {table.metric} (%) of every run.")
