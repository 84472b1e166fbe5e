"""The run directory's human-facing files, written by callbacks the composition root attaches to a run.

- :class:`PartitionFiles`: ``partition.json`` (per-client split sizes, groups and label histograms) and, with
  ``plots``, ``partition.png``;
- :class:`CurvesPlot`: ``curves.png`` (accuracy/loss against rounds and bytes), with ``plots``, when the run ends.

The round loop writes only what a run needs to resume and to be read back (``config.yaml``, ``metrics.jsonl``,
``summary.json``, checkpoints, models); it draws nothing.  Every file goes to the path the run store
(:class:`fedfuse.engine.store.RunStore`) gives it; :data:`fedfuse.runfiles.FILES` lists them all.
"""

from __future__ import annotations

from typing import Any

from fedfuse.config import RunConfig
from fedfuse.data.report import label_histograms, plot_partition
from fedfuse.engine.callbacks import Callback
from fedfuse.engine.store import RunStore
from fedfuse.plots import plot_curves
from fedfuse.runfiles import CURVES, PARTITION_JSON, PARTITION_PNG
from fedfuse.types import Federation


class PartitionFiles(Callback):
    """``partition.json`` and (with ``plots``) ``partition.png`` of ``fed`` in the run directory, at the start of
    the run.  ``fed`` is the full federation: these files are for the user and keep the ground-truth groups."""

    def __init__(self, fed: Federation) -> None:
        self.fed = fed

    def on_run_start(self, config: RunConfig) -> None:
        if not config.out:
            return
        store = RunStore(config.out)
        fed = self.fed
        info = {
            "dataset": fed.dataset,
            "partition": fed.partition,
            "clients": [{"cid": c.cid, "train": c.num_train, "val": len(c.val), "test": len(c.test), "group": c.group}
                        for c in fed.clients],
            "label_histograms": label_histograms(fed).tolist(),
        }
        store.write_json(PARTITION_JSON, info)
        if config.plots:
            plot_partition(fed, store.path(PARTITION_PNG))


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
        store = RunStore(cfg.out)
        history = store.read_metrics()
        if history:
            plot_curves(history, store.path(CURVES), title=f"{cfg.algorithm} on {cfg.dataset}")


def output_callbacks(fed: Federation) -> list[Callback]:
    """The callbacks that write a run's partition files and curves (each checks ``out`` and ``plots``)."""
    return [PartitionFiles(fed), CurvesPlot()]
