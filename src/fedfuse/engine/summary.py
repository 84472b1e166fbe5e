"""What a run reports: ``summary.json`` (:func:`run_summary`) and its blocks (:func:`final_block`), the round
records' clean-up (:func:`clean`, :func:`strip_timing`) and the choice of the best-validation-loss round
(:func:`improves_val_loss`).  Pure functions of the run's history: the run store writes what they return."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from fedfuse.config import RunConfig
from fedfuse.engine.round import Totals
from fedfuse.stats import best_round, final_mean, final_window, is_evaluation_metric, primary_metric

TIMING_KEYS = ("seconds", "wall_seconds", "cpu_seconds")


def run_summary(cfg: RunConfig, task: str, clients: int, history: Sequence[dict[str, Any]],
                best: dict[str, Any] | None, totals: Totals, /, **extra: Any) -> dict[str, Any]:
    """``summary.json`` of the run of ``cfg`` (``task`` and ``clients``: its federation's) after ``history``:
    its ``final`` (:func:`final_block`), ``last`` (the last evaluated round), ``best`` (the evaluated round with
    the highest accuracy, :func:`fedfuse.stats.primary_metric`) and ``best_val_loss`` (``best``, the round with
    the lowest validation loss, whose model is ``model_best_val_loss.pt``) blocks, the ``totals``, then ``extra``
    (the executor, precision and threads, and the privacy account's entries, which may replace ``totals``)."""
    evaluated = [h for h in history if "personal_accuracy" in h]
    last = evaluated[-1] if evaluated else (history[-1] if history else {})
    metric = primary_metric(evaluated)
    return {
        "algorithm": cfg.algorithm,
        "dataset": cfg.dataset,
        "partition": cfg.partition,
        "model": cfg.model,
        "task": task,
        "clients": clients,
        "rounds_completed": len(history),
        "final": final_block(history, last),
        "last": _block(last),
        "best": {"metric": metric, **_block(best_round(evaluated, metric) or last)},
        "best_val_loss": _block(best or last),
        "totals": clean(dataclasses.asdict(totals)),
        "wall_seconds": totals.wall_seconds,
        **extra,
    }


def improves_val_loss(best: dict[str, Any] | None, rec: dict[str, Any]) -> bool:
    """Whether round record ``rec`` has a lower validation loss than the ``best`` so far (a record without one,
    or with NaN, never does): the model a run selects without looking at the test sets."""
    v = rec.get("val_loss")
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return False
    return best is None or v < best["val_loss"]


def final_block(history: Sequence[dict[str, Any]], last: dict[str, Any]) -> dict[str, Any]:
    """``summary.json``'s ``final``: every evaluation metric (:func:`fedfuse.stats.is_evaluation_metric`) as its
    final value (:func:`fedfuse.stats.final_mean`: the mean of the last 5 evaluations, or of the later half of a
    shorter run's), everything else (totals, parameter counts, diagnostics, wall time) as at the ``last``
    evaluated round; ``window`` = how many evaluations the accuracies average (of the primary metric)."""
    block = _block(last)
    for key, v in block.items():
        if is_evaluation_metric(key) and isinstance(v, int | float) and not isinstance(v, bool):
            block[key] = final_mean(history, key)
    metric = primary_metric(history)
    block["window"] = final_window(sum(1 for h in history if h.get(metric) is not None))
    return block


def _block(rec: dict[str, Any]) -> dict[str, Any]:
    """A summary block: the record's scalar metrics (diagnostics included) with totals as cumulative bytes/FLOPs."""
    b = {k: v for k, v in rec.items() if isinstance(v, int | float | str | bool) or v is None}
    for k in ("bytes_down", "bytes_up", "bytes_peer", "client_flops", "seconds"):
        b.pop(k, None)  # per-round values; the block reports totals
    b["bytes_down"] = b.pop("total_bytes_down", None)
    b["bytes_up"] = b.pop("total_bytes_up", None)
    b["bytes_peer"] = b.pop("total_bytes_peer", None)
    b["client_flops"] = b.pop("total_client_flops", None)
    return b


def clean(obj: Any) -> Any:
    """NaN/inf → None so metrics stay strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean(v) for v in obj]
    return obj


def strip_timing(rec: dict[str, Any]) -> dict[str, Any]:
    """A metrics record without wall-clock fields (for bit-identity comparisons)."""
    return {k: v for k, v in rec.items() if k not in TIMING_KEYS}
