"""The table ``fedfuse run`` prints when a run ends: each metric's final value (the mean of the last evaluations,
as compare, reports and ``Result.final()`` compute it), its value at the last evaluation and at the best one,
and what ran (precision, threads, the executor and why a request was re-routed)."""

from __future__ import annotations

from typing import Any

from fedfuse.stats import FINAL_WINDOW


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{100 * v:.2f}" if pct else (f"{v:.4g}")
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


#: rows of the ``fedfuse run`` table whose "final" is the mean of the last evaluations (the others are totals)
EVALUATED = ("global_accuracy", "personal_accuracy", "personal_accuracy_weighted", "loss", "val_loss", "perplexity")


#: the rows of the ``fedfuse run`` table: (label, summary key, shown in %)
RESULT_ROWS = (
    ("global accuracy (%)", "global_accuracy", True),
    ("personalised accuracy, mean over clients (%)", "personal_accuracy", True),
    ("personalised accuracy, sample-weighted (%)", "personal_accuracy_weighted", True),
    ("test loss", "loss", False),
    ("validation loss", "val_loss", False),
    ("perplexity", "perplexity", False),
    ("MB down (total)", "bytes_down", False),
    ("MB up (total)", "bytes_up", False),
    ("client GFLOPs (total)", "client_flops", False),
    ("server parameters", "server_parameters", False),
    ("clients without test data (not in the means)", "clients_without_test", False),
    ("updates quarantined (total)", "total_quarantined", False),
    ("replies lost to dropout (total)", "total_dropped", False),
    ("replies after the deadline (total)", "total_late", False),
)


def results_table(summary: dict[str, Any], history: list[dict[str, Any]] | None = None,
                  last: int = FINAL_WINDOW) -> str:
    """The table ``fedfuse run`` prints: ``final`` (the same statistic as compare, the API and reports:
    :func:`fedfuse.stats.final_window`), the last evaluation and the best one (the highest accuracy)."""
    from fedfuse.result import last_evaluation
    from fedfuse.stats import evaluations, final_note

    history = history or []
    final, latest, best = summary["final"], last_evaluation(summary), summary["best"]
    at, best_at = latest.get("round"), best.get("round")
    last_head = f"round {at}" if at is not None else "last"
    best_head = f"best (round {best_at})" if best_at is not None else "best"
    lines = [f"{'metric':<46} {'final':>10} {last_head:>12} {best_head:>16}", "-" * 87]
    for label, key, pct in RESULT_ROWS:
        line = _results_line(final, latest, best, label, key, pct)
        if line is not None:
            lines.append(line)
    n = summary["rounds_completed"]
    lines.append(f"wall time: {summary['wall_seconds']:.1f} s over {n} round{'s' if n != 1 else ''}")
    metric = best.get("metric", "global_accuracy")
    count = len(evaluations(history, metric))
    if count:
        lines.append(f"{final_note(last, [count], 'this run')}; the same final as compare, reports and "
                     "Result.final()")
        chosen = summary.get("best_val_loss", {}).get("round")
        lines.append(f"best = the evaluation with the highest {metric.replace('_', ' ')}"
                     + (f"; the lowest validation loss was at round {chosen} (model_best_val_loss.pt)"
                        if chosen is not None else ""))
    if "precision" in summary:
        threads = summary.get("threads")
        lines.append(f"precision: {summary['precision']}" + (f", torch threads: {threads}" if threads else ""))
    from fedfuse.engine.routing import executor_line

    executor = executor_line(summary.get("executor"))  # what ran, and why when it is not what was asked for
    if executor:
        lines.append(executor)
    return "\n".join(lines)


def _results_line(final: dict[str, Any], latest: dict[str, Any], best: dict[str, Any], label: str, key: str,
                  pct: bool) -> str | None:
    """One row of :func:`results_table` (None when the run has no such value, or a zero count)."""
    f, b = latest.get(key), best.get(key)
    if (f is None and b is None) or (key.startswith(("total_", "clients_without")) and not f):
        return None
    scale = 1e6 if key.startswith("bytes") else 1e9 if key == "client_flops" else None
    if scale is not None:
        f, b = (None if x is None else x / scale for x in (f, b))
    shown = _fmt(final.get(key), pct) if key in EVALUATED else ""
    return f"{label:<46} {shown:>10} {_fmt(f, pct):>12} {_fmt(b, pct):>16}"
