"""Verification by re-run: a result record's config run again with today's code, and every metric it holds
compared with what it recorded (``fedfuse results verify``).

The records themselves are stored, found and rendered by :mod:`fedfuse.records`, which runs nothing; this module
re-runs them through the composition root and, for records of a reproduction's own federation, the reproduction
that built it.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterable
from typing import Any

from fedfuse.records import record_curve, scalar_metrics, stability_metrics
from fedfuse.result import last_evaluation


def rerun(rec: dict[str, Any], data_dir: str | None = None, out: str | None = None) -> dict[str, Any]:
    """Re-run ``rec``'s config with today's code; returns the metrics a record would hold and (``curve``) its
    per-round curve."""
    from fedfuse.config import RunConfig, apply, validate
    from fedfuse.runner import experiment

    check_base_digest(rec)
    out = out or tempfile.mkdtemp(prefix="fedfuse-verify-")
    cfg = validate(apply(RunConfig(), {**rec["config"], "out": out, "data_dir": data_dir, "threads": 1,
                                       "plots": False}))
    fed = None
    spec = rec.get("federation")
    if spec and spec.get("kind") == "lora":  # `reproduce fedmerge-lora`: clients built from the base's tokenizer
        from fedfuse.reproduce.fedmerge_lora import rebuild

        cfg, fed = rebuild(spec, cfg)
    elif spec:
        from fedfuse.reproduce.common import federation_for

        if spec.get("kind") != "truncated":
            raise SystemExit(f"fedfuse results verify: unknown federation {spec}")
        from fedfuse.reproduce.msfusion import truncated

        fed = truncated(federation_for(cfg), int(spec["seqs"]), int(spec["test"]))
    exp = experiment(cfg, fed=fed, progress=False)
    summary = exp.run()
    return {**scalar_metrics(last_evaluation(summary)), **stability_metrics(exp.history),
            "curve": record_curve(exp.history)[0]}


def check_base_digest(rec: dict[str, Any]) -> None:
    """Refuse (``SystemExit``) a record whose run names a LoRA base but that does not record the base's weights
    digest (``federation.base_state_sha256``): a re-run would load whatever file now sits at that path."""
    base = (rec.get("config", {}).get("algorithm_options") or {}).get("base")
    if not base:
        return
    digest = str((rec.get("federation") or {}).get("base_state_sha256") or "")
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise SystemExit(f"fedfuse results verify: the record names the LoRA base {base!r} but not its weights "
                         "digest (federation.base_state_sha256): refused to re-run it on an unchecked base")


#: The row of :func:`verify`'s comparison that covers the per-round curve (tables read points and means of it).
CURVE_DIFF = "curve (largest difference over its rounds)"


def _curve_row(recorded: list[list[Any]], now: list[list[Any]]) -> tuple[str, Any, Any, float | None]:
    """(CURVE_DIFF, "N rounds" recorded, "N rounds" now, the largest |now − recorded| over the evaluated rounds,
    signed); the difference is None when the evaluated rounds differ."""
    a = {int(r): v for r, v in recorded}
    b = {int(r): v for r, v in now}
    if set(a) != set(b) or any((a[r] is None) != (b[r] is None) for r in a):
        return CURVE_DIFF, f"{len(a)} rounds", f"{len(b)} rounds", None
    diffs = [float(b[r]) - float(a[r]) for r in a if a[r] is not None]
    return CURVE_DIFF, f"{len(a)} rounds", f"{len(b)} rounds", max(diffs, key=abs, default=0.0)


def compare(recorded: dict[str, Any], now: dict[str, Any], keys: Iterable[str] | None = None
            ) -> list[tuple[str, Any, Any, float | None]]:
    """(metric, recorded, now, now − recorded) for every numeric metric both hold (or ``keys``)."""
    rows = []
    for k in keys or sorted(recorded):
        a, b = recorded.get(k), now.get(k)
        if isinstance(a, bool) or isinstance(b, bool):
            continue
        if isinstance(a, int | float) and isinstance(b, int | float) and not k.startswith(("wall", "seconds")):
            rows.append((k, a, b, float(b) - float(a)))
    return rows


TABLE_METRICS = ("global_accuracy", "perplexity", "personal_accuracy", "personal_accuracy_worst10",
                 "ensemble_accuracy", "personal_perplexity",
                 "personal_rouge1")


def is_table_metric(name: str) -> bool:
    """Metrics the tables use: accuracies, perplexities, ROUGE-1 and the stability means."""
    return name in TABLE_METRICS or name == CURVE_DIFF or name.startswith(("global_accuracy_", "last10_mean",
                                                                          "best10_mean"))


def verify(rec: dict[str, Any], data_dir: str | None = None, tol: float = 1e-9,
           out: str | None = None) -> tuple[bool, list[tuple[str, Any, Any, float | None]]]:
    """Re-run ``rec`` and compare: (every table metric within ``tol``, the comparison rows)."""
    now = rerun(rec, data_dir, out)
    curve = now.pop("curve")
    rows = compare(rec["metrics"], now)
    if rec.get("curve"):
        rows.append(_curve_row(rec["curve"], curve))
    table = [r for r in rows if is_table_metric(r[0])]
    ok = all(d is not None and abs(d) <= tol for _, _, _, d in table)
    return ok, rows
