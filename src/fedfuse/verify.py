"""Verification by re-run: a result record's config run again with today's code, and every metric it holds
compared with what it recorded (``fedfuse results verify``).

The records themselves are stored, found and rendered by :mod:`fedfuse.records`, which runs nothing; this module
re-runs them through the composition root and, for records of a reproduction's own federation, the reproduction
that built it.

:func:`assess` gives one of five outcomes, each with its own exit status of ``fedfuse results verify``
(:data:`EXIT`):

* ``bit for bit`` (0) — every table metric equal to the last bit; ``within tolerance`` (0) — every difference at
  most a ``tol`` the caller chose above 0 (the default is 0: a re-run either repeats or it does not);
* ``differs`` (1) — a difference on the float kernels the record was made with, or other evaluated rounds on any:
  today's code computes something else; also a record that is not re-runnable whose config hash or ε no longer
  checks out;
* ``not re-runnable`` (3) — a central-DP record (``dp=central`` without ``dp_reproducible``, or one that says
  ``dp_guarantee``): its noise and client sampling come from OS randomness by design, so its metrics cannot
  repeat; what can be checked exactly is checked instead (the config hash, the ε the accountant gives for the
  config: :func:`check_not_rerunnable`);
* ``other kernels`` (4) — a difference on a record made with other float kernels than this process's (another
  torch version, CPU capability or machine: :func:`fedfuse.records.made_on`), or with unknown ones (records made
  before they stored it): floats round differently there, so the difference is reported, never passed, and
  cannot be blamed on the code.

(2 is every refusal and usage error: no matching record, a LoRA record without its base's digest.)
"""

from __future__ import annotations

import functools
import math
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfuse.errors import DivergenceError
from fedfuse.records import costs, load_spec, made_on, record_curve, repo_root, scalar_metrics, stability_metrics
from fedfuse.result import last_evaluation, load

#: exit status of ``fedfuse results verify`` per outcome of :func:`assess` (2: refused, usage error)
EXIT: dict[str, int] = {"bit for bit": 0, "within tolerance": 0, "differs": 1, "not re-runnable": 3,
                        "other kernels": 4}


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
    try:
        summary = exp.run()
    except DivergenceError:  # an outcome a record can hold: the round it stopped in, and the curve up to it
        d = load(out).diverged or {}
        return {DIVERGED_ROW: d.get("round"), "curve": record_curve(exp.history)[0], "costs": costs(exp.history)}
    return {**scalar_metrics(last_evaluation(summary)), **stability_metrics(exp.history),
            "curve": record_curve(exp.history)[0], "costs": costs(exp.history)}


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


#: The row of :func:`verify`'s comparison for a run that diverged: the round it diverged in, recorded and now
#: (now ``finished`` when the re-run did not diverge).
DIVERGED_ROW = "diverged in round"

#: The row of :func:`verify`'s comparison that covers the per-round curve (tables read points and means of it).
CURVE_DIFF = "curve (largest difference over its rounds)"


#: The row that covers the recorded costs: bytes and client FLOPs at every evaluation (the benchmark's "to target"
#: columns read them; their seconds are time, never compared).
COSTS_DIFF = "costs (bytes, FLOPs at every evaluation)"


def _costs_row(recorded: list[list[Any]], now: list[list[Any]]) -> tuple[str, Any, Any, float | None]:
    """(COSTS_DIFF, "N rounds" recorded, "N rounds" now, the largest |now − recorded| of the cumulative bytes and
    client FLOPs over the evaluated rounds, signed); None when the evaluated rounds differ."""
    a = {int(c[0]): c[1:3] for c in recorded}
    b = {int(c[0]): c[1:3] for c in now}
    if set(a) != set(b):
        return COSTS_DIFF, f"{len(a)} rounds", f"{len(b)} rounds", None
    diffs = [float(y) - float(x) for r in a for x, y in zip(a[r], b[r], strict=True)
             if x is not None and y is not None]
    if any((x is None) != (y is None) for r in a for x, y in zip(a[r], b[r], strict=True)):
        return COSTS_DIFF, f"{len(a)} rounds", f"{len(b)} rounds", None
    return COSTS_DIFF, f"{len(a)} rounds", f"{len(b)} rounds", max(diffs, key=abs, default=0.0)


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
        if isinstance(a, int | float) and isinstance(b, int | float) and not k.startswith(("wall", "seconds", "cpu")):
            rows.append((k, a, b, float(b) - float(a)))
    return rows


TABLE_METRICS = ("global_accuracy", "perplexity", "personal_accuracy", "personal_accuracy_worst10",
                 "ensemble_accuracy", "personal_perplexity",
                 "personal_rouge1")


def spec_metrics(rec: dict[str, Any]) -> frozenset[str]:
    """The final metrics ``rec``'s own table spec reads (a column's or paired spec's ``metric``, ``metric_of``
    and ``metrics``: e.g. the validation accuracy of the learning-rate table); none when the repository holds no
    spec for its table.  Read once per (repository, table): every compared row asks."""
    return _spec_metrics(str(repo_root()), str(rec.get("table")))


@functools.lru_cache(maxsize=64)
def _spec_metrics(root: str, table: str) -> frozenset[str]:
    try:
        spec = load_spec(Path(root), table)
    except FileNotFoundError:
        return frozenset()
    names: set[str] = set()
    for part in (spec, *spec.get("columns", [])):
        names.update(n for n in (part.get("metric"), *part.get("metric_of", {}).values(), *part.get("metrics", []))
                     if isinstance(n, str))
    return frozenset(names)


def is_table_metric(name: str, rec: dict[str, Any] | None = None) -> bool:
    """Metrics the tables use: accuracies, perplexities, ROUGE-1 and the stability means, and every metric the
    table spec of ``rec`` reads (:func:`spec_metrics`)."""
    return (name in TABLE_METRICS or name in (CURVE_DIFF, COSTS_DIFF, DIVERGED_ROW)
            or name.startswith(("global_accuracy_", "last10_mean", "best10_mean"))
            or (rec is not None and name in spec_metrics(rec)))


def verify(rec: dict[str, Any], data_dir: str | None = None, tol: float = 0.0,
           out: str | None = None) -> tuple[bool, list[tuple[str, Any, Any, float | None]]]:
    """Re-run ``rec`` and compare: (every table metric within ``tol``, the comparison rows)."""
    now = rerun(rec, data_dir, out)
    curve, spent = now.pop("curve"), now.pop("costs")
    rows = compare(rec["metrics"], now)
    if rec.get("diverged") or DIVERGED_ROW in now:
        was, got = (rec.get("diverged") or {}).get("round"), now.get(DIVERGED_ROW)
        same = was is not None and got is not None
        rows.append((DIVERGED_ROW, was if was is not None else "finished", got if got is not None else "finished",
                     float(got) - float(was) if same else None))
    if rec.get("curve"):
        rows.append(_curve_row(rec["curve"], curve))
    if rec.get("costs"):
        rows.append(_costs_row(rec["costs"], spent))
    table = [r for r in rows if is_table_metric(r[0], rec)]
    ok = all(d is not None and abs(d) <= tol for _, _, _, d in table)
    return ok, rows


def not_rerunnable(rec: dict[str, Any]) -> str | None:
    """Why ``rec``'s metrics cannot repeat on a re-run (None when they can): central DP draws its noise and its
    client sampling from OS randomness, never from the seed, unless the run chose the research mode
    ``dp_reproducible`` (docs/privacy.md); a record that claims ``dp_guarantee`` ran so by definition."""
    cfg = rec.get("config") or {}
    central = cfg.get("dp") == "central" and not cfg.get("dp_reproducible", False)
    if central or (rec.get("metrics") or {}).get("dp_guarantee") is True:
        return ("central DP draws its noise and client sampling from OS randomness by design (never seeded, "
                "docs/privacy.md), so its metrics cannot repeat")
    return None


def check_not_rerunnable(rec: dict[str, Any]) -> list[tuple[str, Any, Any, bool | None]]:
    """What can be checked exactly of a record that cannot be re-run (:func:`not_rerunnable`), without training:
    (check, recorded, now, equal) for the config hash (today's code hashes the recorded config the same) and,
    when the record reports one, ε at its δ after its rounds as the accountant computes it from the config
    (:func:`fedfuse.privacy.dp.central_epsilon`: noise multiplier, clients, clients per round, sampling, δ,
    accountant).  When the config does not fix the federation's size (a ``natural`` partition of every user, a
    federation the record describes) ε is not recomputed: its row says why, and ``equal`` is None."""
    from fedfuse.config import RunConfig, apply, config_hash
    from fedfuse.privacy.dp import central_epsilon

    cfg = apply(RunConfig(), {**rec["config"], "out": None})
    rows: list[tuple[str, Any, Any, bool | None]] = [
        ("config hash", rec["config_hash"], config_hash(cfg), rec["config_hash"] == config_hash(cfg))]
    metrics = rec.get("metrics") or {}
    if "dp_epsilon" not in metrics or cfg.dp != "central":
        return rows
    rounds = int(metrics.get("round") or cfg.rounds)
    delta = float(metrics.get("dp_delta") or cfg.dp_delta)
    name = f"dp_epsilon (δ = {delta:g}, {rounds} rounds)"
    if rec.get("federation") or (cfg.partition == "natural" and not cfg.clients):
        return [*rows, (name, metrics["dp_epsilon"], "not recomputed: the config does not fix the number of "
                        "clients (it depends on the data)", None)]
    eps = central_epsilon(float(cfg.dp_noise), int(cfg.clients), int(cfg.clients_per_round), str(cfg.sampling),
                          rounds, delta, str(cfg.dp_accountant))
    now = eps if math.isfinite(eps) else None  # the run records an infinite ε (no noise) as None
    return [*rows, (name, metrics["dp_epsilon"], now, metrics["dp_epsilon"] == now)]


def kernels_differ(rec: dict[str, Any], here: dict[str, Any] | None = None) -> str | None:
    """How the float kernels ``rec`` was made with (its ``made_on``) differ from ``here`` (default: this
    process's, :func:`fedfuse.records.made_on`); None when they are the same.  A record made before records stored
    them has unknown kernels."""
    here = here if here is not None else made_on()
    there = rec.get("made_on")
    if not there:
        return ("the record does not say which float kernels made it (recorded before records stored them; here: "
                f"torch {here.get('torch')}, {here.get('cpu_capability')}, {here.get('machine')})")
    first = ("torch", "cpu_capability", "machine", "cpu", "kernel_env")
    keys = [*first, *sorted((set(there) | set(here)) - set(first))]
    differ = [f"{k} {there.get(k)!s} there, {here.get(k)!s} here" for k in keys if there.get(k) != here.get(k)]
    return f"the record was made with other float kernels ({'; '.join(differ)})" if differ else None


def _fate(v: Any) -> str:
    return "finished" if v == "finished" else f"diverged in round {v}"


@dataclass
class Outcome:
    """What :func:`assess` found: the outcome (a key of :data:`EXIT`), its one-line explanation and the rows it
    compared ((metric, recorded, now, now − recorded) of a re-run; (check, recorded, now, equal) otherwise)."""

    outcome: str
    message: str
    rows: list[tuple[str, Any, Any, Any]] = field(default_factory=list)

    @property
    def exit_status(self) -> int:
        return EXIT[self.outcome]


def assess(rec: dict[str, Any], data_dir: str | None = None, tol: float = 0.0, out: str | None = None,
           here: dict[str, Any] | None = None) -> Outcome:
    """Verify ``rec``: a record that cannot repeat (:func:`not_rerunnable`) gets its exact checks
    (:func:`check_not_rerunnable`), every other one is re-run and compared (:func:`verify`); a difference is
    ``other kernels`` when the record's float kernels differ from ``here``'s or are unknown
    (:func:`kernels_differ`), else (and whenever the evaluated rounds differ) ``differs``."""
    why = not_rerunnable(rec)
    if why is not None:
        checks = check_not_rerunnable(rec)
        if all(ok is not False for *_, ok in checks):
            equal = ", ".join(c for c, _, _, ok in checks if ok)
            return Outcome("not re-runnable", f"not re-runnable bit for bit: {why}; checked exactly instead: "
                           f"{equal} (equal)", checks)
        bad = ", ".join(c for c, _, _, ok in checks if ok is False)
        return Outcome("differs", f"NOT verified: {why}, and what can be checked differs: {bad}", checks)
    ok, rows = verify(rec, data_dir, tol, out)
    diffs = [d for name, _, _, d in rows if is_table_metric(name, rec)]
    largest = max((d for d in diffs if d is not None), key=abs, default=0.0)  # signed: now − recorded
    if all(d == 0 for d in diffs):
        return Outcome("bit for bit", "reproduced bit for bit", rows)
    if ok:
        return Outcome("within tolerance", f"reproduced within tolerance {tol:g}, not bit for bit (largest "
                       f"difference {largest:+.3g})", rows)
    fate = next((r for r in rows if r[0] == DIVERGED_ROW and r[3] is None), None)
    if fate is not None:  # one diverged, the other did not
        return Outcome("differs", f"NOT reproduced: recorded {_fate(fate[1])}, re-run {_fate(fate[2])}", rows)
    if any(d is None for d in diffs):  # which rounds are evaluated does not depend on how floats round
        return Outcome("differs", "NOT reproduced: the evaluated rounds differ", rows)
    what = f"largest table-metric difference {largest:+.3g}"
    kernels = kernels_differ(rec, here)
    if kernels is not None:
        return Outcome("other kernels", f"differs ({what}), and {kernels}: exact re-runs need the same kernels, so "
                       "this is neither reproduced nor blamed on the code", rows)
    return Outcome("differs", f"NOT reproduced ({what}, tolerance {tol:g}) on the kernels the record was made "
                   "with", rows)
