"""The run store: a finished (or interrupted) run directory read back as a :class:`Result`.

A run directory holds ``config.yaml``, ``metrics.jsonl`` (one record per round) and, once the run finished,
``summary.json``; the engine writes them, this module reads them.  The API, sweeps and reports all hand
results around as :class:`Result`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfuse.config import RunConfig, apply, load_yaml
from fedfuse.runfiles import (
    CHECKPOINT,
    CONFIG,
    CURVES,
    DIVERGED,
    METRICS,
    MODEL_BEST_VAL_LOSS,
    MODEL_FINAL,
    PARTITION_JSON,
    PARTITION_PNG,
    SUMMARY,
)
from fedfuse.stats import FINAL_WINDOW, best_value, final_mean, with_bytes

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure

# Records carry these as lists/dicts; the per-round DataFrame keeps scalar columns only.
_NON_SCALAR = ("clients", "client_test_accuracy")


def last_evaluation(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary.json``'s block of the last evaluated round: ``last`` (in summaries written by fedfuse 0.1.0, which
    have no ``last``, ``final`` was that block)."""
    return summary.get("last") or summary.get("final", {})


@dataclass
class Result:
    """One finished run: its resolved config, per-round history, summary and (when written) output files."""

    config: RunConfig
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    out: Path | None = None
    cached: bool = field(default=False, compare=False)
    #: a run that diverged: ``{"round", "why", "lr"}`` (``diverged.json``); its history ends the round before, it
    #: has no summary and no final value
    diverged: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.history = with_bytes(self.history)

    # -- metrics --
    @property
    def metrics(self) -> pd.DataFrame:
        """Per-round metrics as a DataFrame (one row per round, scalar columns: accuracies, losses, bytes, FLOPs,
        parameter counts, timings and any scalar diagnostic of the algorithm); rounds without an evaluation hold
        NaN in the evaluation columns."""
        import pandas as pd

        rows = [{k: v for k, v in h.items() if k not in _NON_SCALAR and not isinstance(v, list | dict)}
                for h in self.history]
        return pd.DataFrame.from_records(rows)

    @property
    def client_accuracy(self) -> pd.DataFrame:
        """Personalised test accuracy of every client (columns) at every evaluated round (index)."""
        import pandas as pd

        rows = {h["round"]: {int(c): v for c, v in h["client_test_accuracy"].items()}
                for h in self.history if h.get("client_test_accuracy")}
        frame = pd.DataFrame.from_dict(rows, orient="index")
        frame.index.name = "round"
        return frame.sort_index(axis=1)

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def algorithm(self) -> str:
        return self.config.algorithm

    def final(self, key: str = "global_accuracy", last: int = FINAL_WINDOW) -> float | None:
        """The final value of ``key``: its mean over the last ``last`` evaluations, or over the later half of a
        shorter run's (:func:`fedfuse.stats.final_window`); None for a run that diverged (it has no end)."""
        return None if self.diverged else final_mean(self.history, key, last)

    def best(self, key: str = "global_accuracy") -> float | None:
        """Best value of ``key`` over all evaluations (highest; lowest for a loss or perplexity)."""
        return best_value(self.history, key)

    @property
    def last(self) -> dict[str, Any]:
        """The summary's block of the last evaluated round (:func:`last_evaluation`)."""
        return last_evaluation(self.summary)

    # -- files --
    @property
    def artefacts(self) -> dict[str, Path]:
        """Output files that exist, by name (``config``, ``metrics``, ``summary``, ``curves``, ``partition``,
        ``checkpoint``, ``model_final``, ``model_best_val_loss`` and the algorithm's own files such as heat-maps)."""
        if self.out is None or not self.out.is_dir():
            return {}
        known = {"config": CONFIG, "metrics": METRICS, "summary": SUMMARY, "curves": CURVES,
                 "partition": PARTITION_PNG, "partition_json": PARTITION_JSON, "checkpoint": CHECKPOINT,
                 "model_final": MODEL_FINAL, "model_best_val_loss": MODEL_BEST_VAL_LOSS}
        out = {name: self.out / f for name, f in known.items() if (self.out / f).exists()}
        taken = set(known.values())
        for p in sorted(self.out.iterdir()):
            if p.is_file() and p.name not in taken:
                out.setdefault(p.stem, p)
        return out

    def plot(self, metrics: Sequence[str] | str | None = None, path: str | Path | None = None) -> Figure:
        """A figure with one panel per metric (default: the accuracies and losses this run measured) against
        rounds; saved to ``path`` when given.  Loss-like metrics use a log scale."""
        from fedfuse.plots import plot_metrics

        return plot_metrics({self.config.algorithm: [self.history]}, metrics, path)

    def __repr__(self) -> str:
        acc = self.final("global_accuracy")
        pers = self.final("personal_accuracy")
        parts = [f"{self.config.algorithm} on {self.config.dataset}", f"seed {self.config.seed}",
                 f"{len(self.history)} rounds"]
        if acc is not None:
            parts.append(f"final global acc {100 * acc:.2f}%")
        if pers is not None:
            parts.append(f"final personal acc {100 * pers:.2f}%")
        if self.diverged:
            parts.append(f"diverged in round {self.diverged['round']}")
        if self.out:
            parts.append(f"in {self.out}")
        return f"Result({', '.join(parts)})"


def load(run_dir: str | Path) -> Result:
    """The :class:`Result` of a run directory written by ``fedfuse run`` or :func:`run` (``config.yaml`` and
    ``metrics.jsonl``; ``summary.json`` when the run finished, ``diverged.json`` when it diverged)."""
    d = Path(run_dir)
    if not (d / CONFIG).exists() or not (d / METRICS).exists():
        raise FileNotFoundError(f"{d}: not a run directory (needs config.yaml and metrics.jsonl)")
    cfg = apply(RunConfig(), load_yaml(d / CONFIG))
    history = []
    lines = [line for line in (d / METRICS).read_text().splitlines() if line.strip()]
    for i, line in enumerate(lines):
        try:
            history.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a run killed while writing its last record
                break
            raise
    summary = json.loads((d / SUMMARY).read_text()) if (d / SUMMARY).exists() else {}
    diverged = json.loads((d / DIVERGED).read_text()) if not summary and (d / DIVERGED).exists() else None
    return Result(cfg, history, summary, d, diverged=diverged)


def is_run_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / CONFIG).exists() and (p / METRICS).exists()
