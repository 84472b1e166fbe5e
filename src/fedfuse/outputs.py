"""The run directory's human-facing files, written by callbacks the composition root attaches to a run.

- :class:`PartitionFiles`: ``partition.json`` (per-client split sizes, groups and label histograms) and, with
  ``plots``, ``partition.png``;
- :class:`CurvesPlot`: ``curves.png`` (accuracy/loss against rounds and bytes), with ``plots``, when the run ends.

The round loop writes only what a run needs to resume and to be read back (``config.yaml``, ``metrics.jsonl``,
``summary.json``, checkpoints, models); it draws nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedfuse.config import RunConfig
from fedfuse.data.report import label_histograms, plot_partition
from fedfuse.engine.callbacks import Callback
from fedfuse.plots import plot_curves
from fedfuse.types import Federation


class PartitionFiles(Callback):
    """``partition.json`` and (with ``plots``) ``partition.png`` of ``fed`` in the run directory, at the start of
    the run.  ``fed`` is the full federation: these files are for the user and keep the ground-truth groups."""

    def __init__(self, fed: Federation) -> None:
        self.fed = fed

    def on_run_start(self, config: RunConfig) -> None:
        if not config.out:
            return
        out = Path(config.out)
        out.mkdir(parents=True, exist_ok=True)
        fed = self.fed
        info = {
            "dataset": fed.dataset,
            "partition": fed.partition,
            "clients": [{"cid": c.cid, "train": c.num_train, "val": len(c.val), "test": len(c.test), "group": c.group}
                        for c in fed.clients],
            "label_histograms": label_histograms(fed).tolist(),
        }
        (out / "partition.json").write_text(json.dumps(info))
        if config.plots:
            plot_partition(fed, out / "partition.png")


class CurvesPlot(Callback):
    """``curves.png`` of the whole run (read from ``metrics.jsonl``, so a resumed run's curve starts at round 1),
    drawn when the run ends and ``plots`` is on."""

    def __init__(self) -> None:
        self.config: RunConfig | None = None

    def on_run_start(self, config: RunConfig) -> None:
        self.config = config

    def on_run_end(self, summary: dict[str, Any]) -> None:
        cfg = self.config
        if cfg is None or not cfg.out or not cfg.plots or not summary:
            return
        metrics = Path(cfg.out) / "metrics.jsonl"
        history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if history:
            plot_curves(history, Path(cfg.out) / "curves.png", title=f"{cfg.algorithm} on {cfg.dataset}")


def output_callbacks(fed: Federation) -> list[Callback]:
    """The callbacks that write a run's partition files and curves (each checks ``out`` and ``plots``)."""
    return [PartitionFiles(fed), CurvesPlot()]
