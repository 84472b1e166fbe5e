"""The statistics table over runs by label (:class:`ResultTable`).

Per label: n, final accuracy (mean of the last k evaluations) and best accuracy as mean ± std over seeds,
rounds / MB / GFLOPs to a target accuracy, total communication, and a paired test against a baseline label over
the shared seeds.  Printed by ``compare``, written to ``compare.md/.csv/.json`` and shown in reports.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfuse.config import ConfigError
from fedfuse.result import Result
from fedfuse.stats import (
    MARKS_NOTE,
    MeanStd,
    best_value,
    cost_to_target,
    evaluations,
    final_note,
    lower_is_better,
    mean_std,
    paired_test,
    rounds_to_target,
)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


@dataclass(frozen=True)
class Row:
    """The numbers of one label (accuracies as fractions, costs in bytes/FLOPs)."""

    label: str
    seeds: list[int]
    final: MeanStd
    best: MeanStd
    rounds_to_target: MeanStd  # over the seeds that reached the target
    reached: int
    bytes_to_target: MeanStd
    flops_to_target: MeanStd
    total_bytes: MeanStd
    total_flops: MeanStd
    seconds: MeanStd
    vs_baseline: Any = None  # fedfuse.stats.PairedTest, None for the baseline itself


class ResultTable:
    """Runs by label with the statistics a reviewer expects.

    ``metric``: the accuracy compared (``auto``: ``global_accuracy`` when every run has a global model, else
    ``personal_accuracy``).  ``last``: final = mean of the last ``last`` evaluations.  ``target``: accuracy for
    the rounds/bytes/FLOPs-to-target columns (default: the lowest mean final accuracy among the labels, floored
    to a whole percent, so every label is measured at an accuracy all of them reach on average).
    ``baseline``: the label every other is tested against (default: the first), with a paired ``test``
    (``t`` or ``wilcoxon``) over the seeds both have; ``(n.s.)`` marks p >= ``alpha``.
    """

    def __init__(self, results: Mapping[str, Sequence[Result]], *, metric: str = "auto", last: int = 5,
                 target: float | None = None, baseline: str | None = None, test: str = "t",
                 alpha: float = 0.05) -> None:
        self.results = {k: list(v) for k, v in results.items()}
        if not self.results:
            raise ValueError("ResultTable: no results")
        metric = _measured_metric([r for rs in self.results.values() for r in rs], metric)
        if test not in ("t", "wilcoxon"):
            raise ConfigError(f"test: choose t or wilcoxon, got {test!r}")
        self.metric, self.last, self.test, self.alpha = metric, last, test, alpha
        if baseline is not None and baseline not in self.results:
            raise ConfigError(f"baseline {baseline!r} is not a label; labels: {', '.join(self.results)}")
        self.baseline = baseline or next(iter(self.results))
        self.lower = lower_is_better(metric)
        self.is_accuracy = "accuracy" in metric
        if target is None:
            finals = [mean_std([r.final(metric, last) for r in rs]).mean for rs in self.results.values()]
            finals = [f for f in finals if f == f]
            target = _default_target(finals, self.lower, self.is_accuracy)
        self.target = target
        self.rows = [self._row(label, rs) for label, rs in self.results.items()]

    def _values(self, label: str) -> dict[int, float | None]:
        return {r.seed: r.final(self.metric, self.last) for r in self.results[label]}

    def _vs_baseline(self, label: str) -> Any:
        """The paired test of ``label`` against the baseline over the seeds both have; None for the baseline."""
        if label == self.baseline:
            return None
        a, b = self._values(label), self._values(self.baseline)
        common = sorted(set(a) & set(b))
        return paired_test([a[s] for s in common], [b[s] for s in common], self.test)

    def _cost_to_target(self, rs: list[Result], cost: str) -> MeanStd:
        """Mean ± std of the ``cost`` column when each run first reached the target."""
        t = self.target
        return mean_std([cost_to_target(r.history, t, self.metric, cost, self.lower) if t is not None else None
                         for r in rs])

    def _row(self, label: str, rs: list[Result]) -> Row:
        m, t = self.metric, self.target
        rounds = [rounds_to_target(r.history, t, m, self.lower) if t is not None else None for r in rs]
        return Row(
            label=label, seeds=[r.seed for r in rs],
            final=mean_std([r.final(m, self.last) for r in rs]),
            best=mean_std([best_value(r.history, m, self.lower) for r in rs]),
            rounds_to_target=mean_std(rounds), reached=sum(x is not None for x in rounds),
            bytes_to_target=self._cost_to_target(rs, "total_bytes"),
            flops_to_target=self._cost_to_target(rs, "total_client_flops"),
            total_bytes=_mean_last(rs, "total_bytes"),
            total_flops=_mean_last(rs, "total_client_flops"),
            seconds=_mean_last(rs, "wall_seconds"),
            vs_baseline=self._vs_baseline(label),
        )

    # -- views --
    def display_rows(self) -> list[dict[str, str]]:
        """Formatted rows (strings) as printed and written to ``compare.md``."""
        short = self.metric.replace("_accuracy", "")
        scale, digits = (100.0, 2) if self.is_accuracy else (1.0, 4 if self._small() else 2)
        name = f"{short} acc (%)" if self.is_accuracy else self.metric
        tgt = self._target_text()
        out = []
        for row in self.rows:
            n = len(row.seeds)
            reach = "" if row.reached == n else f" ({row.reached}/{n})"
            d: dict[str, str] = {
                "label": row.label,
                "n": str(n),
                f"final {name}": row.final.fmt(scale, digits),
                f"best {name}": row.best.fmt(scale, digits),
                f"rounds to {tgt}": (row.rounds_to_target.fmt(1, 1) + reach) if row.reached else "never",
                f"MB to {tgt}": (row.bytes_to_target.fmt(1e-6, 2) + reach) if row.reached else "—",
                f"GFLOPs to {tgt}": (row.flops_to_target.fmt(1e-9, 2) + reach) if row.reached else "—",
                "MB total": row.total_bytes.fmt(1e-6, 2),
                "seconds": row.seconds.fmt(1, 1),
            }
            if len(self.rows) > 1:
                if row.vs_baseline is None:
                    d[f"vs {self.baseline}"] = "baseline"
                else:
                    pt = row.vs_baseline
                    p = "" if pt.p_value != pt.p_value else f" p={pt.p_value:.3g}"
                    d[f"vs {self.baseline}"] = f"{scale * pt.diff:+.{digits}f} {pt.mark(self.alpha)}{p}"
            out.append(d)
        return out

    def _small(self) -> bool:
        return all(abs(r.final.mean) < 10 for r in self.rows if r.final.n) if hasattr(self, "rows") else False

    def _target_text(self) -> str:
        if self.target is None:
            return "target"
        return f"{100 * self.target:.0f}%" if self.is_accuracy else f"{self.target:.4g}"

    def to_markdown(self) -> str:
        from fedfuse.tables import markdown

        better = "lower is better, " if self.lower else ""
        counts = [len(evaluations(r.history, self.metric)) for rs in self.results.values() for r in rs
                  if not r.diverged]
        diverged = sum(1 for rs in self.results.values() for r in rs if r.diverged)
        gone = f" ({diverged} run{'s' if diverged != 1 else ''} diverged: no final value, —)" if diverged else ""
        note = (f"\n\n{final_note(self.last, counts)}{gone}; metric {self.metric} ({better}best = the "
                f"{'lowest' if self.lower else 'highest'} evaluation); mean ± std over seeds "
                f"(n = seeds); target = {self._target_text()}; "
                f"paired {'t-test' if self.test == 't' else 'Wilcoxon signed-rank test'} over shared seeds "
                f"against {self.baseline}: * p < {self.alpha}, (n.s.) not significant, {MARKS_NOTE}.")
        return markdown(self.display_rows()) + note

    def frame(self) -> pd.DataFrame:
        """One row per label with numeric columns (means, stds, n, p-values)."""
        import pandas as pd

        recs = []
        for r in self.rows:
            recs.append({
                "label": r.label, "n": len(r.seeds),
                "final_mean": r.final.mean, "final_std": r.final.std, "final_ci95": r.final.ci95(),
                "best_mean": r.best.mean, "best_std": r.best.std,
                "rounds_to_target": r.rounds_to_target.mean, "reached": r.reached,
                "bytes_to_target": r.bytes_to_target.mean, "flops_to_target": r.flops_to_target.mean,
                "total_bytes": r.total_bytes.mean, "total_flops": r.total_flops.mean,
                "diff_vs_baseline": None if r.vs_baseline is None else r.vs_baseline.diff,
                "p_value": None if r.vs_baseline is None else r.vs_baseline.p_value,
            })
        return pd.DataFrame.from_records(recs).set_index("label")

    def per_seed(self) -> pd.DataFrame:
        """Final and best ``metric`` of every run: one row per (label, seed)."""
        import pandas as pd

        recs = [{"label": label, "seed": r.seed, "final": r.final(self.metric, self.last),
                 "best": r.best(self.metric), "rounds": len(r.history), "dir": str(r.out) if r.out else None}
                for label, rs in self.results.items() for r in rs]
        return pd.DataFrame.from_records(recs)

    def write(self, out: str | Path, *, plots: bool = True) -> Path:
        """Write ``compare.md``, ``compare.csv``, ``compare.json`` and, with ``plots``, ``compare.png``; returns the
        Markdown table's path.  :func:`fedfuse.report.write_compare` writes these and the report."""
        import csv

        root = Path(out)
        root.mkdir(parents=True, exist_ok=True)
        rows = self.display_rows()
        with open(root / "compare.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        (root / "compare.md").write_text(self.to_markdown() + "\n")
        (root / "compare.json").write_text(json.dumps(
            {"metric": self.metric, "target": self.target, "baseline": self.baseline, "last": self.last,
             "test": self.test, "table": self.frame().reset_index().to_dict("records"),
             "runs": self.per_seed().to_dict("records")}, indent=2, default=str))
        if plots:
            import matplotlib.pyplot as plt

            from fedfuse.plots import plot_metrics

            plt.close(plot_metrics(self.histories(), path=root / "compare.png"))
        return root / "compare.md"

    def histories(self) -> dict[str, list[list[dict[str, Any]]]]:
        return {label: [r.history for r in rs] for label, rs in self.results.items()}

    def __getitem__(self, label: str) -> list[Result]:
        return self.results[label]

    def __repr__(self) -> str:
        return self.to_markdown()

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def _repr_html_(self) -> str:
        import pandas as pd

        note = self.to_markdown().split("\n\n", 1)[1]
        return pd.DataFrame(self.display_rows()).to_html(index=False) + f"<p><small>{note}</small></p>"


def _measured_metric(runs: list[Result], metric: str) -> str:
    """``metric``, ``auto`` resolved (``global_accuracy`` when every run has a global model, else
    ``personal_accuracy``); raises when no run measured it, naming the closest measured metrics.  Runs that
    diverged have no final value and decide nothing (a table of only diverged runs reads ``metric`` as given,
    ``auto`` as ``global_accuracy``)."""
    finished = [r for r in runs if not r.diverged]
    if metric == "auto":
        metric = "global_accuracy" if all(r.final("global_accuracy") is not None for r in finished) \
            else "personal_accuracy"
    if not finished or any(h.get(metric) is not None for r in runs for h in r.history):
        return metric
    from fedfuse.names import did_you_mean

    measured = sorted({k for r in runs for h in r.history for k, v in h.items()
                       if isinstance(v, int | float) and not isinstance(v, bool)})
    hint = did_you_mean(metric, measured)
    listed = f"; {hint}" if hint else (f"; measured: {', '.join(measured)}" if len(measured) <= 16 else
                                       " (the measured metrics are the columns of metrics.jsonl)")
    raise ConfigError(f"metric {metric!r} was not measured by any run{listed}")


def _mean_last(rs: list[Result], key: str) -> MeanStd:
    """Mean ± std of ``key`` in each run's last history entry (a running total or the wall time)."""
    return mean_std([r.history[-1].get(key) if r.history else None for r in rs])


def _default_target(finals: list[float], lower: bool, accuracy: bool) -> float | None:
    """The worst mean final value among the labels, rounded towards "easier" (a whole percent for accuracies,
    3 significant digits otherwise), so every label reaches it on average."""
    if not finals:
        return None
    worst = max(finals) if lower else min(finals)
    if accuracy:
        return math.floor(100 * worst) / 100
    if worst == 0:
        return 0.0
    step = 10 ** (math.floor(math.log10(abs(worst))) - 2)
    return (math.ceil(worst / step) if lower else math.floor(worst / step)) * step
