"""PNG plots of training curves (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PANELS = (
    ("global_accuracy", "global accuracy"),
    ("personal_accuracy", "personalised accuracy"),
    ("loss", "test loss"),
    ("val_loss", "validation loss"),
)


def _series(history: Sequence[Mapping[str, Any]], key: str, x: str = "round") -> tuple[list, list]:
    pts = [(h[x], h[key]) for h in history if h.get(key) is not None and h.get(x) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_curves(history: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Accuracy/loss against rounds, and personalised accuracy against cumulative bytes."""
    return plot_compare({"": history}, path, title=title)


def plot_compare(histories: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, title: str = "") -> Path:
    """Overlaid curves of several runs (one line per label)."""
    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(4.2 * (len(PANELS) + 1), 3.4))
    colors = {name: f"C{i % 10}" for i, name in enumerate(histories)}  # one colour per run in every panel
    for ax, (key, label) in zip(axes, PANELS):
        for name, hist in histories.items():
            xs, ys = _series(hist, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, color=colors[name], label=name or None)
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for name, hist in histories.items():
        pts = [
            ((h.get("total_bytes_down") or 0) + (h.get("total_bytes_up") or 0) + (h.get("total_bytes_peer") or 0),
             h.get("personal_accuracy"))
            for h in hist
            if h.get("personal_accuracy") is not None
        ]
        if pts:
            ax.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], color=colors[name], label=name or None)
    ax.set_xlabel("MiB communicated (total)")
    ax.set_ylabel("personalised accuracy")
    ax.grid(alpha=0.3)
    labels = [name for name in histories if name]
    if labels:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=colors[n]) for n in labels]
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08 if len(histories) > 1 else 0, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
