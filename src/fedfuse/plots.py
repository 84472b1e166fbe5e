"""PNG plots of training curves (matplotlib, Agg backend).

:func:`plot_metric` draws one metric for several labelled groups of runs: the mean over seeds as a line and
± one standard deviation as a band.  :func:`plot_metrics` puts several metrics side by side (one panel each);
:func:`plot_curves` / :func:`plot_compare` are the per-run and per-comparison figures written after a run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from fedfuse.stats import with_bytes

PANELS = (
    ("global_accuracy", "global accuracy"),
    ("personal_accuracy", "personalised accuracy"),
    ("loss", "test loss"),
    ("val_loss", "validation loss"),
)

LABELS: dict[str, str] = {
    "global_accuracy": "global accuracy",
    "personal_accuracy": "personalised accuracy (mean over clients)",
    "personal_accuracy_weighted": "personalised accuracy (sample-weighted)",
    "val_accuracy": "validation accuracy",
    "loss": "test loss",
    "global_loss": "global test loss",
    "personal_loss": "personalised test loss",
    "val_loss": "validation loss",
    "train_loss": "training loss",
    "perplexity": "perplexity",
    "personal_perplexity": "personalised perplexity",
    "total_bytes": "MB communicated (cumulative)",
}

# Metrics whose scale spans orders of magnitude: drawn on a log axis.
LOG_SCALE = ("loss", "perplexity")


def is_log_metric(key: str) -> bool:
    return any(word in key for word in LOG_SCALE)


def _series(history: Sequence[Mapping[str, Any]], key: str, x: str = "round") -> tuple[list, list]:
    pts = [(h[x], h[key]) for h in history if h.get(key) is not None and h.get(x) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def mean_band(histories: Sequence[Sequence[Mapping[str, Any]]], key: str,
              x: str = "round") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean, std, n) of ``key`` over runs at each x where at least one run measured it (std ddof=1, 0 for
    a single run)."""
    by_x: dict[float, list[float]] = {}
    for h in histories:
        for xv, yv in zip(*_series(h, key, x)):
            if isinstance(yv, int | float) and math.isfinite(yv):
                by_x.setdefault(xv, []).append(float(yv))
    xs = np.array(sorted(by_x), dtype=float)
    vals = [by_x[v] for v in sorted(by_x)]
    mean = np.array([np.mean(v) for v in vals]) if vals else np.zeros(0)
    std = np.array([np.std(v, ddof=1) if len(v) > 1 else 0.0 for v in vals]) if vals else np.zeros(0)
    n = np.array([len(v) for v in vals]) if vals else np.zeros(0)
    return xs, mean, std, n


def _plain_log_ticks(axis: Any, lo: float | None = None, hi: float | None = None) -> None:
    """Log-axis ticks written as plain numbers: at 1, 2, 5 × 10^k (0.2, 0.5, 1, 2, 5, 10, ...) over a wide
    range, at every 1..9 × 10^k when the data ``lo..hi`` spans less than a decade (0.3, 0.4, 0.5, ..., so a
    narrow range still gets several labelled ticks)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    narrow = lo is not None and hi is not None and lo > 0 and hi / lo < 10
    subs = tuple(float(i) for i in range(1, 10)) if narrow else (1.0, 2.0, 5.0)
    axis.set_major_locator(LogLocator(base=10, subs=subs, numticks=12))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    axis.set_minor_formatter(NullFormatter())


def is_percent(key: str) -> bool:
    """Accuracies are drawn in %, as every table shows them."""
    return "accuracy" in key


MARKERS = "os^Dv<>PX*"
LINESTYLES = ("-", "--", "-.", ":")


def curve_style(i: int, points: int) -> dict[str, Any]:
    """How the ``i``-th curve of a figure is drawn so that it stays visible where it meets or covers another:
    its own marker shape (open, so a marker under it shows through) and line style, and markers at about 8
    points per curve, each curve's shifted along the x axis by its index (two equal curves show both marker
    sets side by side)."""
    every = max(1, points // 8)
    return {"marker": MARKERS[i % len(MARKERS)], "markevery": (i % every, every), "markersize": 5,
            "markerfacecolor": "none", "linestyle": LINESTYLES[i % len(LINESTYLES)], "lw": 1.6}


def _legend_style(i: int) -> dict[str, Any]:
    """The legend entry of the ``i``-th curve: its marker and line style (:func:`curve_style`)."""
    return {k: v for k, v in curve_style(i, 8).items() if k != "markevery"}


def draw_metric(ax: Any, groups: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], key: str,
                x: str = "round", colors: Mapping[str, str] | None = None) -> bool:
    """Mean line and ±std band per group on ``ax`` (accuracies in %); False when no group measured ``key``."""
    drawn = False
    lo_hi: list[float] = []
    for i, (label, hists) in enumerate(groups.items()):
        xs, m, s, _ = mean_band(hists, key, x)
        if not len(xs):
            continue
        if x == "total_bytes":  # log axis: a run that communicates nothing (local training) has no curve here
            keep = xs > 0
            xs, m, s = xs[keep] / 1e6, m[keep], s[keep]
            if not len(xs):
                continue
        if is_percent(key):
            m, s = 100 * m, 100 * s
        lo_hi.extend([float(np.min(m - s)), float(np.max(m + s))])
        c = (colors or {}).get(label, f"C{i % 10}")
        ax.plot(xs, m, color=c, label=label or None, **curve_style(i, len(xs)))
        if (s > 0).any():
            ax.fill_between(xs, m - s, m + s, color=c, alpha=0.2, lw=0)
        drawn = True
    if drawn:
        ax.set_xlabel(LABELS.get(x, x))
        ax.set_ylabel(LABELS.get(key, key) + (" (%)" if is_percent(key) else ""))
        if is_log_metric(key):
            ax.set_yscale("log")
            positive = [v for v in lo_hi if v > 0]
            _plain_log_ticks(ax.yaxis, min(positive, default=None), max(positive, default=None))
        if x == "total_bytes":
            ax.set_xscale("log")
            _plain_log_ticks(ax.xaxis)
        else:
            from matplotlib.ticker import MaxNLocator

            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3, which="both")
    return drawn


def plot_metric(groups: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], key: str, path: str | Path,
                x: str = "round", title: str = "") -> Path | None:
    """One readable figure of ``key`` against ``x`` (``round`` or ``total_bytes``); None if nothing to draw."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if not draw_metric(ax, groups, key, x):
        plt.close(fig)
        return None
    nseeds = max((len(h) for h in groups.values()), default=1)
    if len(groups) > 1 or any(groups):
        ax.legend(frameon=False, fontsize=9)
    band = " (mean ± std over seeds)" if nseeds > 1 else ""
    ax.set_title((title + "\n" if title else "") + LABELS.get(key, key) + band, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def available_metrics(histories: Sequence[Sequence[Mapping[str, Any]]],
                      candidates: Sequence[str] = tuple(LABELS)) -> list[str]:
    """The candidate metrics measured (not None) in at least one record of the histories."""
    found = []
    for k in candidates:
        if k == "total_bytes":
            continue
        if any(h.get(k) is not None for hist in histories for h in hist):
            found.append(k)
    return found


def plot_metrics(groups: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]],
                 metrics: Sequence[str] | str | None = None, path: str | Path | None = None) -> Any:
    """A figure with one panel per metric (default: accuracies and losses that were measured)."""
    if isinstance(metrics, str):
        metrics = [metrics]
    if metrics is None:
        every = [h for hs in groups.values() for h in hs]
        metrics = available_metrics(every, ("global_accuracy", "personal_accuracy", "loss", "val_loss",
                                            "perplexity"))
    metrics = list(metrics) or ["train_loss"]
    cols = min(2, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 4.0 * rows), squeeze=False)
    for ax, key in zip(axes.flat, metrics):
        draw_metric(ax, groups, key)
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    labels = [k for k in groups if k]
    if len(labels) > 1:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=f"C{i % 10}", **_legend_style(i)) for i, _ in enumerate(groups)]
        fig.legend(handles, list(groups), loc="lower center", ncol=min(len(labels), 6), frameon=False)
    fig.tight_layout(rect=(0, 0.06 if len(labels) > 1 else 0, 1, 1))
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def plot_curves(history: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Accuracy/loss against rounds, and personalised accuracy against cumulative bytes."""
    return plot_compare({"": history}, path, title=title)


def plot_compare(histories: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, title: str = "") -> Path:
    """Overlaid curves of several runs (one line per label): a 2 × 3 grid of readable panels — accuracies and
    losses (log scale) against rounds, accuracy against cumulative communication."""
    groups = {name: [with_bytes(list(h))] for name, h in histories.items()}
    every = [h for hs in groups.values() for h in hs]
    keys = [k for k, _ in PANELS if available_metrics(every, (k,))] or ["train_loss"]
    panels = [(k, "round") for k in keys]
    acc = "personal_accuracy" if available_metrics(every, ("personal_accuracy",)) else "global_accuracy"
    panels.append((acc, "total_bytes"))
    cols = 3 if len(panels) > 4 else 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.8 * rows), squeeze=False)
    colors = {name: f"C{i % 10}" for i, name in enumerate(histories)}  # one colour per run in every panel
    for ax, (key, x) in zip(axes.flat, panels):
        draw_metric(ax, groups, key, x, colors)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    labels = [name for name in histories if name]
    if labels:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=colors[n], **_legend_style(i)) for i, n in enumerate(histories) if n]
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06 if len(histories) > 1 else 0, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
