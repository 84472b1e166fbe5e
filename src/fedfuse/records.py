"""Result records: every published number traceable to the runs that produced it.

A **record** is one run of one table cell (one seed): a small JSON file under ``results/records/<table>/`` with
the resolved config, its hash (:func:`fedfuse.config.config_hash`), the fedfuse commit it ran on, the *behaviour
versions* of the code it ran on (:data:`BEHAVIOUR`), the final metrics, the per-round global accuracy (the
personalised accuracy for methods without a global model: ``curve_metric``) and the stability statistics
(last-10 mean, best 10-round mean), and where it was made (``made_on``: :func:`made_on`, the float kernels a
bit-for-bit re-run needs; records made before it was stored lack it).  A **table spec**
(``results/tables/<table>.json``) says which records form which rows and columns.  The Markdown tables in
``README.md`` and ``docs/`` that are delimited by ``<!-- results: <table> -->`` … ``<!-- /results -->`` are
generated from the records by ``fedfuse results render`` (``--check``: report, do
not write; ``tests/test_records.py`` runs it).

**Stale records.**  A commit that changes what an algorithm (or the engine, ``"*"``) computes bumps its entry
in :data:`BEHAVIOUR` and says so in its message.  A record made on older code (a lower version for its
algorithm or for ``"*"``) is *stale*: its rows render with a visible ⚠ mark until re-run and re-recorded.

``fedfuse results verify`` re-runs a chosen (:func:`choose`, or random) record at its recorded config with
today's code and reports the difference of every metric the record holds: that is :mod:`fedfuse.verify`, which
sits above the reproductions it re-runs; this module only stores, finds and renders numbers.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import random
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedfuse.result import last_evaluation
from fedfuse.stats import mean_std, paired_test, stability, swing

#: Behaviour versions: bumped by every commit that changes what an algorithm ("*": the engine, data, models)
#: computes.  The history: msfusion 2 = the assembled full model from the current round's sub-models only
#: (Algorithm 1; before: every element kept its last combined value).
BEHAVIOUR: dict[str, int] = {"*": 1, "msfusion": 2, "heterofl": 1, "fedrolex": 1}

SCHEMA = 1
MARK = re.compile(r"(<!-- results: (?P<id>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)
STALE = "⚠ stale"


def repo_root() -> Path:
    """The repository holding ``results/`` (the working directory's, else the one above this package)."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (base / "results" / "tables").is_dir():
            return base
    return Path.cwd()


def current_commit(where: Path | None = None) -> str:
    """``git rev-parse HEAD`` of the checkout holding this package ("unknown" outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where or Path(__file__).resolve().parent,
                             capture_output=True, text=True, check=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


#: environment variables that choose the float kernels torch runs (ATen's dispatch, MKL's code path, oneDNN's ISA)
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def made_on() -> dict[str, Any]:
    """Where this process computes: the torch version, the CPU capability torch dispatches its kernels for
    (``torch.backends.cpu.get_cpu_capability()``, e.g. ``AVX512``), the machine (``platform.machine()``), the CPU
    model (Linux's ``/proc/cpuinfo``, else ``platform.processor()``; MKL picks its code path by it) and those of
    :data:`KERNEL_ENV` that are set.  Float results repeat bit for bit only on the same kernels: the same seed on
    another CPU or torch version may round differently."""
    import os

    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"torch": str(torch.__version__), "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
            "machine": platform.machine(), "cpu": cpu,
            "kernel_env": {k: os.environ[k] for k in KERNEL_ENV if os.environ.get(k)}}


# ---- records -------------------------------------------------------------------------------------------------
def scalar_metrics(block: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in block.items() if isinstance(v, int | float | str | bool) or v is None}


def stability_metrics(hist: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """``last10_mean`` / ``best10_mean`` of the global accuracy, and ``…_<name>`` of every other evaluated
    ``global_accuracy_<name>`` (e.g. MSfusion's ``compare_assemblies``)."""
    out: dict[str, float | None] = {}
    names = sorted({k for h in hist for k in h if k.startswith("global_accuracy_")})
    for metric in ("global_accuracy", *names):
        suffix = metric[len("global_accuracy"):]
        out[f"last10_mean{suffix}"], out[f"best10_mean{suffix}"] = stability(hist, metric)
    worst = worst_clients(hist)
    if worst is not None:
        out["personal_accuracy_worst10"] = worst
    return out


def worst_clients(hist: Sequence[dict[str, Any]], fraction: float = 0.1) -> float | None:
    """The mean test accuracy of the worst ``fraction`` of clients (at least one) at the last evaluation that
    reports per-client accuracies (``client_test_accuracy``); None when none does."""
    per = next((h["client_test_accuracy"] for h in reversed(hist) if h.get("client_test_accuracy")), None)
    if not per:
        return None
    accs = sorted(float(a) for a in per.values() if a is not None)
    k = max(1, math.ceil(fraction * len(accs)))
    return sum(accs[:k]) / k if accs else None


def costs(hist: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """[round, cumulative bytes (down + up + peer), cumulative client FLOPs, cumulative seconds] at every
    evaluated round: what reaching an accuracy cost."""
    out, seconds = [], 0.0
    for h in hist:
        seconds += float(h.get("seconds") or 0.0)
        if "personal_accuracy" in h:
            total = sum(float(h.get(k) or 0) for k in ("total_bytes_down", "total_bytes_up", "total_bytes_peer"))
            out.append([int(h["round"]), total, h.get("total_client_flops"), round(seconds, 3)])
    return out


def make_record(run_dir: str | Path, table: str, cell: dict[str, Any], commit: str | None = None,
                federation: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record of one finished run directory for ``cell`` of ``table``.

    ``federation`` describes a federation the config alone does not rebuild (e.g. PTB truncated by a
    reproduction: ``{"kind": "truncated", "seqs": 100, "test": 400}``); :func:`verify` rebuilds it."""
    from fedfuse.config import config_hash
    from fedfuse.result import load

    res = load(run_dir)
    cfg = res.config
    hist = res.history
    if not res.summary and not res.diverged:
        raise ValueError(f"{run_dir}: the run has not finished (no summary.json)")
    algo = cfg.algorithm
    curve, curve_metric = record_curve(hist)
    d = cfg.to_dict()
    for k in ("out", "data_dir", "threads"):
        d.pop(k, None)
    return {
        "schema": SCHEMA,
        "table": table,
        "cell": cell,
        "seed": int(cfg.seed),
        "algorithm": algo,
        "commit": commit or current_commit(),
        "behaviour": {"*": BEHAVIOUR["*"], algo: BEHAVIOUR.get(algo, 1)},
        "config_hash": config_hash(cfg),
        "config": d,
        "federation": federation,
        # a diverged run has no end: no final metrics (what it spent only), its curve up to the round before
        "metrics": _spent(hist) if res.diverged else {**scalar_metrics(last_evaluation(res.summary)),
                                                       **stability_metrics(hist)},
        "curve": curve,
        "costs": costs(hist),
        "made_on": made_on(),
        **({} if curve_metric == "global_accuracy" else {"curve_metric": curve_metric}),
        **({"diverged": {k: res.diverged.get(k) for k in ("round", "why", "lr")}} if res.diverged else {}),
    }


def _spent(hist: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What a run that diverged spent before it stopped: its rounds done and their CPU and wall seconds."""
    last = hist[-1] if hist else {}
    return {"round": last.get("round", 0), **{k: last[k] for k in ("cpu_seconds", "wall_seconds") if k in last}}


def record_curve(hist: Sequence[dict[str, Any]]) -> tuple[list[list[Any]], str]:
    """([round, accuracy] of every evaluated round, the metric): the global model's accuracy, or (methods
    without one, e.g. FedMerge) the personalised one."""
    has_global = any(h.get("global_accuracy") is not None for h in hist)
    metric = "global_accuracy" if has_global else "personal_accuracy"
    return [[int(h["round"]), h.get(metric)] for h in hist if "personal_accuracy" in h], metric


def record_path(root: Path, rec: dict[str, Any]) -> Path:
    slug = "-".join(f"{k}{v}" for k, v in rec["cell"].items()).replace("/", "_").replace(" ", "")
    return root / "results" / "records" / rec["table"] / f"{slug}-seed{rec['seed']}.json"


def write_record(root: Path, rec: dict[str, Any]) -> Path:
    p = record_path(root, rec)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(rec, indent=1, sort_keys=False, default=str) + "\n")
    return p


def load_records(root: Path, table: str) -> list[dict[str, Any]]:
    d = root / "results" / "records" / table
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.is_dir() else []


def stale_reason(rec: dict[str, Any]) -> str | None:
    """Why ``rec`` no longer describes today's code (None if current): a behaviour version it ran below."""
    ran = rec.get("behaviour", {})
    for key in ("*", rec.get("algorithm", "")):
        now = BEHAVIOUR.get(key, 1)
        if int(ran.get(key, 1)) < now:
            return f"{key} behaviour v{ran.get(key, 1)} < v{now}"
    return None


# ---- tables --------------------------------------------------------------------------------------------------
def load_spec(root: Path, table: str) -> dict[str, Any]:
    p = root / "results" / "tables" / f"{table}.json"
    if not p.is_file():
        raise FileNotFoundError(f"no table spec {p}")
    return json.loads(p.read_text())


def metric_for(spec: dict[str, Any], cell: dict[str, Any]) -> str:
    """The metric a table column, paired spec or claims row reads from a record of ``cell``: ``spec["metric"]``,
    or ``spec["metric_of"][value]`` for the cell's value of ``spec["by"]`` (default ``method``) when given — e.g.
    ``{"ensemble": "ensemble_accuracy"}``: an ensemble has no single global model, so its global-test accuracy is
    its ``ensemble_accuracy``."""
    return spec.get("metric_of", {}).get(cell.get(spec.get("by", "method")), spec["metric"])


def _num(v: Any, scale: float, digits: int) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{scale * float(v):.{digits}f}"


def _groups(spec: dict[str, Any], recs: list[dict[str, Any]]) -> list[tuple[tuple, list[dict[str, Any]]]]:
    keys = spec["rows"]
    by: dict[tuple, list[dict[str, Any]]] = {}
    for r in recs:
        by.setdefault(tuple(r["cell"].get(k) for k in keys), []).append(r)
    order = spec.get("order", {})

    def rank(key: tuple) -> tuple:
        return tuple((order[k].index(v) if k in order and v in order[k] else 999, str(v)) for k, v in zip(keys, key))

    return [(k, sorted(by[k], key=lambda r: r["seed"])) for k in sorted(by, key=rank)]


def curve_value(rec: dict[str, Any], at: dict[str, Any]) -> float | None:
    """A value of a record's per-round curve (``rec["curve"]``: [round, accuracy] of every evaluation): at
    ``{"round": r}`` its value at round r, at ``{"last": n}`` the mean of its last n evaluations, at
    ``{"swing": n}`` the largest change between consecutive evaluations among its last n (:func:`stats.swing`);
    None when the curve has no such point (a diverged run has no last points: it has no end)."""
    pts = [(int(r), float(a)) for r, a in rec.get("curve", []) if a is not None]
    if "round" in at:
        return next((a for r, a in pts if r == int(at["round"])), None)
    if rec.get("diverged"):
        return None  # its curve stops before its end: its last points do not stand for the run
    if "swing" in at:
        return swing([a for _, a in pts], int(at["swing"]))
    last = pts[-int(at["last"]):]
    return sum(a for _, a in last) / len(last) if last else None


def record_value(spec: dict[str, Any], rec: dict[str, Any]) -> float | None:
    """The value a table column, paired spec or claims row reads from one record: a point of the recorded curve
    when ``spec`` has ``curve`` (:func:`curve_value`, e.g. ``{"last": 5}``: FedMR's "final accuracy", the mean
    of the last 5 evaluations), else the final metric :func:`metric_for` names."""
    if "curve" in spec:
        return curve_value(rec, spec["curve"])
    return rec["metrics"].get(metric_for(spec, rec["cell"]))


def _column_values(col: dict[str, Any], recs: list[dict[str, Any]]) -> list[float | None]:
    """The per-record values a column aggregates (:func:`record_value`); none for a column without ``curve``
    or ``metric``."""
    return [record_value(col, r) for r in recs] if "curve" in col or "metric" in col else []


def _within(col: dict[str, Any], recs: list[dict[str, Any]]) -> str:
    """``yes`` when every seed's best minus last (``metrics`` [best, last]) is at most ``tol``."""
    best, last = col["metrics"]
    ok = all(r["metrics"].get(best) is not None and r["metrics"].get(last) is not None
             and r["metrics"][best] - r["metrics"][last] <= float(col["tol"]) + 1e-12 for r in recs)
    return "yes" if ok else "no"


def _cell_text(col: dict[str, Any], key: tuple, spec: dict[str, Any], recs: list[dict[str, Any]]) -> str:
    agg = col.get("agg", "key")
    scale, digits = float(col.get("scale", 1.0)), int(col.get("digits", 2))
    vals = _column_values(col, recs)
    if agg == "key":
        v = key[spec["rows"].index(col["key"])]
        return "—" if v is None else str(v)
    diverged = [r for r in recs if r.get("diverged")] if vals else []
    note = f" ({len(diverged)} of {len(recs)} diverged)" if diverged else ""
    if agg == "mean_std":
        return mean_std(vals).fmt(scale, digits) + note
    if agg == "per_seed":
        return " / ".join(f"diverged r{r['diverged']['round']}" if v is None and r.get("diverged")
                          else _num(v, scale, digits) for v, r in zip(vals, recs, strict=True))
    if agg == "mean":
        ms = mean_std(vals)
        return ("—" if ms.n == 0 else (f"{ms.mean * scale:,.0f}" if digits == 0 else f"{ms.mean * scale:.{digits}f}")
                ) + note
    if agg == "seeds":
        return ",".join(str(r["seed"]) for r in recs)
    if agg == "within":
        return _within(col, recs)
    if agg == "commit":
        return ", ".join(sorted({r["commit"][:7] for r in recs}))
    raise ValueError(f"table {spec['id']}: unknown column aggregate {agg!r}")


def render_table(spec: dict[str, Any], recs: list[dict[str, Any]], root: Path | None = None) -> str:
    """The Markdown table of ``spec`` over its records (a row per cell; stale rows marked)."""
    if spec.get("kind") == "paired":
        return render_paired(spec, recs)
    if spec.get("kind") == "claims":
        return render_claims(spec, root or repo_root())
    cols = spec["columns"]
    lines = ["| " + " | ".join(c["header"] for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    groups = _groups(spec, recs)
    best = {i: _best_keys(c, spec, groups) for i, c in enumerate(cols) if "best_within" in c}
    for key, rs in groups:
        cells = [_cell_text(c, key, spec, rs) for c in cols]
        cells = [f"**{t}**" if key in best.get(i, ()) else t for i, t in enumerate(cells)]
        reasons = sorted({s for r in rs if (s := stale_reason(r))})
        if reasons:
            cells[0] = f"{cells[0]} {STALE} ({'; '.join(reasons)})"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _best_keys(col: dict[str, Any], spec: dict[str, Any],
               groups: list[tuple[tuple, list[dict[str, Any]]]]) -> set[tuple]:
    """The rows whose mean value of ``col`` is the best among the rows that share their values of the row keys
    ``col["best_within"]`` (e.g. ``["scale"]``: the best learning rate of each scale); highest unless
    ``col["higher_is_better"]`` is false; ties all count; a row with a diverged run is never the best. Rendered
    bold."""
    at = [spec["rows"].index(k) for k in col["best_within"]]
    sign = 1.0 if col.get("higher_is_better", True) else -1.0
    means: dict[tuple, dict[tuple, float]] = {}
    for key, rs in groups:
        if any(r.get("diverged") for r in rs):
            continue  # the runs that survived would flatter the row
        ms = mean_std(_column_values(col, rs))
        if ms.n:
            means.setdefault(tuple(key[i] for i in at), {})[key] = sign * ms.mean
    return {k for part in means.values() for k, v in part.items() if v == max(part.values())}


def _natural(key: tuple) -> tuple:
    """Sort key of a group: numbers by value (2 before 10), before text, text alphabetically."""
    return tuple((0, v, "") if isinstance(v, int | float) and not isinstance(v, bool) else (1, 0, str(v))
                 for v in key)


def render_paired(spec: dict[str, Any], recs: list[dict[str, Any]]) -> str:
    """Paired comparisons over the same seeds: for each group of ``spec["group"]`` and each (a, b) in
    ``spec["pairs"]`` (values of ``spec["by"]``), the mean difference of ``metric`` (per method:
    :func:`metric_for`), the paired t-test's p and whether "a better than b" holds (``higher_is_better``)."""
    group = spec.get("group", [])
    out = ["| " + " | ".join([*group, "comparison", "difference", "p (paired t)", "holds"]) + " |",
           "|" + "|".join("---" for _ in range(len(group) + 4)) + "|"]
    by: dict[tuple, dict[Any, dict[int, dict]]] = {}
    for r in recs:
        by.setdefault(tuple(r["cell"].get(g) for g in group), {}).setdefault(r["cell"][spec["by"]], {})[
            r["seed"]] = r
    for gkey in sorted(by, key=_natural):
        methods = by[gkey]
        for a, b in spec["pairs"]:
            if a in methods and b in methods:
                out.append("| " + " | ".join([*map(str, gkey), *_paired_cells(spec, methods[a], methods[b], a, b)])
                           + " |")
    return "\n".join(out)


def _paired_cells(spec: dict[str, Any], ra: dict[int, dict[str, Any]], rb: dict[int, dict[str, Any]], a: Any,
                  b: Any) -> list[str]:
    """(comparison, difference, p, holds) of ``a`` vs ``b`` over the seeds both ran and neither diverged."""
    scale, digits = float(spec.get("scale", 1.0)), int(spec.get("digits", 2))
    sign = 1.0 if spec.get("higher_is_better", True) else -1.0
    common = sorted(set(ra) & set(rb))
    gone = sum(1 for s in common for r in (ra, rb) if r[s].get("diverged"))
    seeds = [s for s in common if not (ra[s].get("diverged") or rb[s].get("diverged"))]
    t = paired_test([record_value(spec, ra[s]) for s in seeds], [record_value(spec, rb[s]) for s in seeds])
    holds = ("yes" if sign * t.diff > 0 else "no") + ("" if t.significant() else " (n.s.)") if t.n else "—"
    stale = any(stale_reason(r[s]) for r in (ra, rb) for s in common)
    label = (f"{a} vs {b}" + (f" {STALE}" if stale else "")
             + (f" ({gone} of {2 * len(common)} runs diverged: paired over the rest)" if gone else ""))
    p = "—" if t.p_value != t.p_value else f"{t.p_value:.3g}"
    return [label, f"{scale * t.diff:+.{digits}f}" if t.n else "—", p, holds]


TYPED = "✎"


def _claim_part(row: dict[str, Any], recs: list[dict[str, Any]]) -> tuple[str, list[bool], list[bool], bool] | None:
    """One part of a claims row over ``recs``: (text, holds per pair, significant per pair, stale); None when a
    pair has no records."""
    scale, digits = float(row.get("scale", 100.0)), int(row.get("digits", 1))
    sign = 1.0 if row.get("higher_is_better", True) else -1.0
    unit = row.get("unit", " %")
    sel = [r for r in recs if all(str(r["cell"].get(k)) == str(v) for k, v in row.get("group", {}).items())]
    by: dict[Any, dict[int, dict[str, Any]]] = {}
    for r in sel:
        by.setdefault(r["cell"][row.get("by", "method")], {})[r["seed"]] = r
    parts, holds, sig, stale = [], [], [], False
    for a, b in row["pairs"]:
        if a not in by or b not in by:
            return None
        seeds = sorted(set(by[a]) & set(by[b]))
        va = [record_value(row, by[a][x]) for x in seeds]
        vb = [record_value(row, by[b][x]) for x in seeds]
        t = paired_test(va, vb)
        ma, mb = mean_std(va).mean, mean_std(vb).mean
        p = "n/a" if t.p_value != t.p_value else f"{t.p_value:.2g}"
        parts.append(f"{a} {scale * ma:.{digits}f} vs {b} {scale * mb:.{digits}f}{unit} "
                     f"({scale * t.diff:+.{digits}f}, p = {p})")
        holds.append(sign * t.diff > 0)
        sig.append(t.significant())
        stale = stale or any(stale_reason(by[m][x]) for m in (a, b) for x in seeds)
    text = f"{row.get('label', '')}: " + "; ".join(parts) if row.get("label") else "; ".join(parts)
    return text, holds, sig, stale


def claim_verdict(holds: list[bool], sig: list[bool]) -> str:
    """**yes** when every pair is better and significant, yes (n.s.) when every pair is better, no / no (n.s.)
    when none is, partly otherwise."""
    if all(holds):
        return "**yes**" if all(sig) else "yes (n.s.)"
    if not any(holds):
        return "no" if all(sig) else "no (n.s.)"
    return "partly"


def claim_cells(row: dict[str, Any], recs: list[dict[str, Any]] | None = None,
                root: Path | None = None) -> tuple[str, str]:
    """("measured here", "holds?") of a claims row from its records: each (a, b) of ``row["pairs"]`` over the
    same seeds within ``row["group"]`` (each method's metric: :func:`metric_for`) — means, difference, paired-t
    p; holds = every pair better, **yes** when every pair is also significant.  A row with ``parts`` (each a
    ``table``/``group``/``pairs``/``label`` of its own, inheriting the row's other keys) joins its parts with "; "
    and its verdict covers every pair of every part (``root`` finds their records)."""
    texts, holds, sig, stale = [], [], [], False
    for part in row.get("parts") or [row]:
        sub = {**{k: v for k, v in row.items() if k != "parts"}, **part}
        got = _claim_part(sub, recs if "parts" not in row else load_records(root or repo_root(), sub["table"]))
        if got is None:
            return "no records", "—"
        texts.append(got[0])
        holds += got[1]
        sig += got[2]
        stale = stale or got[3]
    return "; ".join(texts) + (f" {STALE}" if stale else ""), claim_verdict(holds, sig)


def _claim_tables(row: dict[str, Any]) -> list[str]:
    return [p["table"] for p in row.get("parts") or [row] if "table" in p]


def render_claims(spec: dict[str, Any], root: Path) -> str:
    """A claims table: rows with ``table``/``pairs`` (or ``parts``) are computed from records
    (:func:`claim_cells`); rows with ``measured``/``holds`` text are typed by hand and marked ✎."""
    cols = spec.get("columns", ["family", "paper's claim", "measured here", "holds?", "where"])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in spec["rows"]:
        if _claim_tables(row):
            recs = load_records(root, row["table"]) if "table" in row else None
            measured, holds = claim_cells(row, recs, root)
            note = row.get("note")
            if note:
                measured = f"{measured}; {note}"
        else:
            measured, holds = f"{row['measured']} {TYPED}", row["holds"]
        lines.append("| " + " | ".join([row["family"], row["claim"], measured, holds, row.get("where", "")]) + " |")
    return "\n".join(lines)


def provenance_line(spec: dict[str, Any], recs: list[dict[str, Any]]) -> str:
    commits = sorted({r["commit"][:7] for r in recs})
    digest = hashlib.sha256("".join(sorted(r["config_hash"] for r in recs)).encode()).hexdigest()[:12]
    dirs = ", ".join(f"`results/records/{t}/`" for t in (spec.get("records") or [spec["id"]]))
    return (f"<sub>Rendered by `fedfuse results render` from {len(recs)} records in {dirs} "
            f"(commit {', '.join(commits) or '—'}; config hashes {digest}).</sub>")


def render_block(root: Path, table: str) -> str:
    spec = load_spec(root, table)
    if spec.get("kind") == "claims":
        tables = sorted({t for r in spec["rows"] for t in _claim_tables(r)})
        recs = [r for t in tables for r in load_records(root, t)]
        typed = sum(1 for r in spec["rows"] if not _claim_tables(r))
        rest = (f"the {typed} rows marked {TYPED} are typed by hand (no records yet)" if typed
                else "every row is computed, none typed by hand")
        return (f"\n{render_claims(spec, root)}\n\n<sub>Rendered by `fedfuse results render` from "
                f"`results/tables/{table}.json`: {len(spec['rows']) - typed} rows computed from {len(recs)} records "
                f"({', '.join(f'`{t}`' for t in tables) or '—'}); {rest}.</sub>\n\n")
    recs = load_records(root, table)
    if spec.get("records"):
        recs = [r for t in spec["records"] for r in load_records(root, t)]
    if spec.get("kind") == "benchmark":  # the matrix of `fedfuse bench` (docs/benchmark.md)
        from fedfuse.bench_report import render_benchmark

        prov = f"\n\n{provenance_line(spec, recs)}" if recs else ""
        marked = [{**r, "stale": stale_reason(r)} for r in recs]
        return f"\n{render_benchmark(spec, marked)}{prov}\n\n"
    return f"\n{render_table(spec, recs, root)}\n\n{provenance_line(spec, recs)}\n\n"


def render_text(root: Path, text: str) -> str:
    """``text`` with every ``<!-- results: ID -->`` … ``<!-- /results -->`` block regenerated."""
    return MARK.sub(lambda m: m.group(1) + render_block(root, m.group("id")) + m.group(4), text)


def documents(root: Path) -> list[Path]:
    """Markdown files of the repository that hold results blocks."""
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return [p for p in docs if p.is_file() and MARK.search(p.read_text())]


def render(root: Path | None = None, check: bool = False) -> list[Path]:
    """Regenerate every results block (``check``: write nothing); returns the files whose text differs."""
    root = root or repo_root()
    changed = []
    for p in documents(root):
        old = p.read_text()
        new = render_text(root, old)
        if new != old:
            changed.append(p)
            if not check:
                p.write_text(new)
        if not check:
            _write_figures(root, old)
    return changed


def _write_figures(root: Path, text: str) -> None:
    """The figures of the benchmark blocks of ``text`` (PNGs are not compared by ``--check``)."""
    for m in MARK.finditer(text):
        spec = load_spec(root, m.group("id"))
        if spec.get("kind") == "benchmark" and spec.get("figures"):
            from fedfuse.bench_report import write_figures

            tables = spec.get("records") or [spec["id"]]  # the width track's spec reads the matrix's records
            recs = [{**r, "stale": stale_reason(r)} for t in tables for r in load_records(root, t)]
            write_figures(spec, recs, root / spec["figures"])


# ---- finding and counting records ----------------------------------------------------------------------------
def table_counts(root: Path) -> list[tuple[str, int, int]]:
    """(table, records, stale records) of every table spec below ``root``, by table id."""
    out = []
    for p in sorted((root / "results" / "tables").glob("*.json")):
        recs = load_records(root, p.stem)
        out.append((p.stem, len(recs), sum(1 for r in recs if stale_reason(r))))
    return out


def rendered_blocks(root: Path) -> tuple[int, int, int]:
    """(documents, results tables, table rows) rendered from result records below ``root``."""
    docs = documents(root)
    tables = rows = 0
    for p in docs:
        for m in MARK.finditer(p.read_text()):
            tables += 1
            lines = [line for line in m.group("body").splitlines() if line.startswith("|")]
            separators = sum(1 for line in lines if set(line) <= set("|-: "))
            rows += len(lines) - 2 * separators  # each Markdown table: a header and a separator line, then rows
    return len(docs), tables, rows


def all_records(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    base = root / "results" / "records"
    return [(p, json.loads(p.read_text())) for p in sorted(base.glob("*/*.json"))] if base.is_dir() else []


def matching(root: Path, table: str | None = None, cell: dict[str, str] | None = None,
             seed: int | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """Every record of ``table`` whose cell has the values ``cell`` and whose seed is ``seed`` (None: any), by
    path; ``SystemExit`` when none does."""
    found = [(p, r) for p, r in all_records(root)
             if (table is None or r["table"] == table) and (seed is None or r["seed"] == seed)
             and all(str(r["cell"].get(k)) == v for k, v in (cell or {}).items())]
    if not found:
        raise SystemExit(f"fedfuse results: no record matches table={table} cell={cell} seed={seed}")
    return found


def choose(root: Path, table: str | None = None, cell: dict[str, str] | None = None, seed: int | None = None,
           pick: int | None = None) -> tuple[Path, dict[str, Any]]:
    """One record: filtered by table / cell values / seed (:func:`matching`); the first match, or a random one
    with ``pick`` (its seed)."""
    found = matching(root, table, cell, seed)
    return random.Random(pick).choice(found) if pick is not None else found[0]


__all__ = ["BEHAVIOUR", "choose", "made_on", "make_record", "matching", "render", "render_table", "stability",
           "stale_reason"]
