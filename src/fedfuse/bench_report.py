"""The benchmark matrix rendered from records (docs/benchmark.md): method × regime accuracy with paired tests
against FedAvg, costs to a target, ranks with Friedman's test and a post-hoc test, figures and a guide whose
every sentence cites the cells it rests on.

A benchmark table spec (``results/tables/<id>.json``, ``"kind": "benchmark"``) names its ``window`` (the
headline: mean of the last ``window`` evaluations of a record's curve), ``baseline``, ``target`` (the fraction of
a regime's best headline a run must reach for its bytes/FLOPs-to-target), the order of ``regimes`` and ``methods``
and ``figures`` (where the PNGs go, relative to the repository).  Records carry the cell
``{"dataset", "regime", "track", "method"}`` (``fedfuse bench --record TABLE`` writes them).  Records arrive
from :func:`fedfuse.records.render_block` with ``"stale"``: the reason they no longer describe today's code, if
any (this module reads record dicts only and imports nothing of :mod:`fedfuse.records`, which imports it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedfuse.stats import friedman, mean_ranks, mean_std, paired_test, pareto_front, ranks
from fedfuse.stats import swing as stats_swing
from fedfuse.tables import markdown

Cells = dict[tuple[str, str], dict[int, dict[str, Any]]]
NO_RECORDS = "No records yet"
STALE = "⚠ stale"  # as fedfuse.records marks a row


def _points(rec: dict[str, Any]) -> list[float]:
    return [float(a) for _, a in rec.get("curve", []) if a is not None]


# ---- the cells -----------------------------------------------------------------------------------------------
def headline(rec: dict[str, Any], window: int) -> float | None:
    """A record's headline: the mean of the last ``window`` evaluations of its curve (None without one, and for
    a run that diverged: it has no end)."""
    if rec.get("diverged"):
        return None
    last = _points(rec)[-max(1, window):]
    return sum(last) / len(last) if last else None


def cells(spec: dict[str, Any], recs: Sequence[dict[str, Any]]) -> Cells:
    """(regime, method) → seed → record, for the records of the spec's track (default ``single``)."""
    out: Cells = {}
    for r in recs:
        c = r["cell"]
        if c.get("track", "single") == spec.get("track", "single"):
            out.setdefault((str(c["regime"]), str(c["method"])), {})[int(r["seed"])] = r
    return out


def _order(found: set[str], preferred: Sequence[str]) -> list[str]:
    return [x for x in preferred if x in found] + sorted(found - set(preferred))


def axes(spec: dict[str, Any], by: Cells) -> tuple[list[str], list[str]]:
    """(regimes, methods) present, in the spec's order (unknown ones after, alphabetically)."""
    return (_order({k[0] for k in by}, spec.get("regimes", [])), _order({k[1] for k in by}, spec.get("methods", [])))


def diverged(by: Cells, key: tuple[str, str]) -> int:
    """How many of a cell's runs diverged."""
    return sum(1 for r in by.get(key, {}).values() if r.get("diverged"))


def mean_of(by: Cells, key: tuple[str, str], window: int) -> float:
    """A cell's mean headline over seeds; NaN when one of its runs diverged (such a cell is not ranked, chosen
    or plotted: the mean of the runs that survived would flatter it)."""
    if diverged(by, key):
        return float("nan")
    vals = [headline(r, window) for r in by.get(key, {}).values()]
    return mean_std(vals).mean


def versus(by: Cells, regime: str, method: str, baseline: str, window: int) -> tuple[float, float, int]:
    """(mean difference, paired-t p, seeds) of ``method`` minus ``baseline`` in ``regime`` over their common
    seeds."""
    a, b = by.get((regime, method), {}), by.get((regime, baseline), {})
    seeds = sorted(s for s in set(a) & set(b) if headline(a[s], window) is not None
                   and headline(b[s], window) is not None)
    t = paired_test([headline(a[s], window) for s in seeds], [headline(b[s], window) for s in seeds])
    return t.diff, t.p_value, t.n


def mark(diff: float, p: float, alpha: float = 0.05) -> str:
    """▲ significantly better than the baseline, ▼ significantly worse, nothing otherwise."""
    if p != p or p >= alpha:
        return ""
    return " ▲" if diff > 0 else " ▼"


def matrix_rows(spec: dict[str, Any], by: Cells) -> list[dict[str, Any]]:
    """The method × regime table: headline mean ± std over seeds (in %) with the paired-test mark vs the
    baseline, ᵖ for a curve of personalised accuracy (no global model), ⚠ for stale records, and the mean rank."""
    regimes, methods = axes(spec, by)
    window, base = int(spec.get("window", 5)), spec.get("baseline", "fedavg")
    complete = [m for m in methods if all((g, m) in by and not diverged(by, (g, m)) for g in regimes)]
    mr = dict(zip(complete, mean_ranks([[mean_of(by, (g, m), window) for m in complete] for g in regimes])))
    rows = []
    for m in methods:
        row: dict[str, Any] = {"method": m}
        for g in regimes:
            recs = list(by.get((g, m), {}).values())
            if not recs:
                row[g] = "—"
                continue
            text = mean_std([headline(r, window) for r in recs]).fmt(100.0, 1)
            gone = diverged(by, (g, m))
            if m != base and not gone:
                text += mark(*versus(by, g, m, base, window)[:2])
            if gone:
                text += f" ({gone} of {len(recs)} diverged)"
            if any(r.get("curve_metric") == "personal_accuracy" for r in recs if not r.get("diverged")):
                text += " ᵖ"
            if any(r.get("stale") for r in recs):
                text += f" {STALE}"
            row[g] = text
        row["mean rank"] = f"{mr[m]:.2f}" if m in mr else "—"
        rows.append(row)
    return rows


def _target_cost(rec: dict[str, Any], target: float, column: int) -> float | None:
    """The cumulative cost (``costs`` column 1 bytes, 2 client FLOPs) at the first evaluation whose curve value
    reaches ``target``; None when it never does."""
    costs = {int(c[0]): c for c in rec.get("costs", [])}
    for rnd, acc in rec.get("curve", []):
        if acc is not None and float(acc) >= target and int(rnd) in costs:
            v = costs[int(rnd)][column]
            return None if v is None else float(v)
    return None


def swing(rec: dict[str, Any], window: int) -> float | None:
    """The largest change between consecutive evaluations within a record's headline window: how far the
    evaluated model moves from one evaluation to the next (None with fewer than 2 evaluations)."""
    return None if rec.get("diverged") else stats_swing(_points(rec), window)


def best_in(by: Cells, regime: str, methods: Sequence[str], window: int) -> tuple[str, float]:
    """The method with the highest mean headline in ``regime`` and that mean."""
    scored = [(mean_of(by, (regime, m), window), m) for m in methods if (regime, m) in by]
    scored = [(v, m) for v, m in scored if not math.isnan(v)]
    v, m = max(scored) if scored else (float("nan"), "")
    return m, v


def cost_rows(spec: dict[str, Any], by: Cells) -> list[dict[str, Any]]:
    """Per (regime, method): personalised accuracy (mean over clients, worst 10 %), bytes and client FLOPs to
    reach ``target`` × the regime's best headline (runs that never reach it: "not reached k/n"), the swing within
    the headline window (:func:`swing`) and seconds per round."""
    regimes, methods = axes(spec, by)
    window, frac = int(spec.get("window", 5)), float(spec.get("target", 0.9))
    rows = []
    for g in regimes:
        target = frac * best_in(by, g, methods, window)[1]
        for m in methods:
            recs = list(by.get((g, m), {}).values())
            if not recs:
                continue
            gone = diverged(by, (g, m))
            row: dict[str, Any] = {"regime": g, "method": m + (f" ({gone} of {len(recs)} diverged)" if gone else "")}
            for key, head in (("personal_accuracy", "personalised %"), ("personal_accuracy_worst10", "worst 10 % %")):
                row[head] = mean_std([r["metrics"].get(key) for r in recs]).fmt(100.0, 1)
            for col, head, unit in ((1, "MB to target", 1e-6), (2, "GFLOPs to target", 1e-9)):
                vals = [_target_cost(r, target, col) for r in recs]
                got = [v for v in vals if v is not None]
                row[head] = (mean_std(got).fmt(unit, 1) if len(got) == len(vals)
                             else f"not reached {len(vals) - len(got)}/{len(vals)}")
            row["swing (pts)"] = mean_std([swing(r, window) for r in recs]).fmt(100.0, 1)
            row["CPU s/round"] = seconds_per_round(recs)
            rows.append(row)
    return rows


WALL = "†"  # a cell whose s/round is wall time: a record made before runs counted their CPU time


def seconds_per_round(recs: Sequence[dict[str, Any]]) -> str:
    """Mean ± std over a cell's records of the run's CPU seconds per round (``cpu_seconds``: the loop process's
    CPU time, robust to what else the machine runs); a cell with a record without it shows wall seconds, marked
    :data:`WALL`."""
    def per_round(r: dict[str, Any], key: str) -> float | None:
        v = r["metrics"].get(key)
        return None if v is None else float(v) / max(1, r["metrics"].get("round") or 1)

    cpu = [per_round(r, "cpu_seconds") for r in recs]
    if all(v is not None for v in cpu):
        return mean_std(cpu).fmt(1.0, 2)
    return mean_std([per_round(r, "wall_seconds") or 0.0 for r in recs]).fmt(1.0, 2) + " " + WALL


def swing_summary(spec: dict[str, Any], by: Cells, points: float = 1.0) -> str:
    """Which methods swing: each method's largest mean swing over the regimes (mean over seeds of
    :func:`swing`), the methods at or above ``points`` percentage points first, largest first, each citing its
    cell."""
    regimes, methods = axes(spec, by)
    window = int(spec.get("window", 5))
    worst = []
    for m in methods:
        per = [(100 * sum(v) / len(v), g) for g in regimes
               if (v := [x for r in by.get((g, m), {}).values() if (x := swing(r, window)) is not None])]
        if per:
            worst.append((*max(per), m))
    worst.sort(reverse=True)
    big = [f"{m} {v:.1f} [{g}/{m}]" for v, g, m in worst if v >= points]
    small = [m for v, _, m in worst if v < points]
    text = (f"Swing, the largest mean over seeds in any regime: {'; '.join(big)}." if big
            else f"No method swings by {points:g} point or more in any regime.")
    return text + (f" Below {points:g} point in every regime: {', '.join(sorted(small))}." if small else "")


def matrix_cost(by: Cells) -> str:
    """What running the matrix cost, summed over its records: CPU hours (``cpu_seconds``) and, for records made
    before runs counted CPU time, wall hours."""
    recs = [r for seeds in by.values() for r in seeds.values()]
    cpu = [r["metrics"].get("cpu_seconds") for r in recs]
    known = [float(v) for v in cpu if v is not None]
    wall = [float(r["metrics"].get("wall_seconds") or 0.0) for r, c in zip(recs, cpu, strict=True) if c is None]
    text = f"Cost of this matrix: {len(recs)} runs"
    if known:
        text += f", {sum(known) / 3600:.2f} CPU-hours over the {len(known)} that counted their CPU time"
    if wall:
        text += f", {sum(wall) / 3600:.2f} wall-hours over the {len(wall)} made before ({WALL})"
    return text + " (each run's rounds, training and evaluation; data loading and start-up not included)."


# ---- ranks over regimes ----------------------------------------------------------------------------------------
def rank_matrix(spec: dict[str, Any], by: Cells) -> tuple[list[str], list[str], list[list[float]]]:
    """(regimes, methods present in every regime, regimes × methods mean headlines)."""
    regimes, methods = axes(spec, by)
    window = int(spec.get("window", 5))
    complete = [m for m in methods if all((g, m) in by and not diverged(by, (g, m)) for g in regimes)]
    return regimes, complete, [[mean_of(by, (g, m), window) for m in complete] for g in regimes]


def posthoc(matrix: Sequence[Sequence[float]], methods: Sequence[str]) -> Any:
    """Nemenyi's post-hoc test after Friedman's (scikit-posthocs): the methods × methods p-value DataFrame."""
    import numpy as np
    import scikit_posthocs as sp

    p = sp.posthoc_nemenyi_friedman(np.asarray(matrix, dtype=float))
    p.index, p.columns = list(methods), list(methods)
    return p


def friedman_text(spec: dict[str, Any], by: Cells) -> str:
    """Friedman's test over the regimes and the pairs the post-hoc test separates (or why it does not apply)."""
    regimes, methods, mat = rank_matrix(spec, by)
    fr = friedman(mat)
    if fr.p_value != fr.p_value:
        return (f"Friedman's test needs at least 2 regimes and 3 methods present in all of them "
                f"(here {len(regimes)} and {len(methods)}).")
    text = (f"Friedman's test over {fr.n} regimes × {fr.k} methods: χ² = {fr.statistic:.2f}, "
            f"p = {fr.p_value:.3g}.")
    try:
        p = posthoc(mat, methods)
    except ImportError:
        return text + " Post-hoc test: install the `bench` extra (scikit-posthocs)."
    pairs = [f"{a} vs {b} (p = {p.loc[a, b]:.3g})" for i, a in enumerate(methods) for b in methods[i + 1:]
             if p.loc[a, b] < 0.05]
    return text + " Nemenyi post-hoc pairs with p < 0.05: " + ("; ".join(pairs) if pairs else "none") + "."


# ---- the guide -------------------------------------------------------------------------------------------------
def _is_personal(by: Cells, key: tuple[str, str]) -> bool:
    return any(r.get("curve_metric") == "personal_accuracy" for r in by.get(key, {}).values())


def _mean_metric(by: Cells, key: tuple[str, str], *names: str) -> float | None:
    """The mean over a cell's records of the sum of metrics ``names`` (None when a record lacks one)."""
    vals = []
    for r in by.get(key, {}).values():
        got = [r["metrics"].get(n) for n in names]
        if any(v is None for v in got):
            return None
        vals.append(sum(float(v) for v in got))
    return sum(vals) / len(vals) if vals else None


def cost_ratio(by: Cells, cell: tuple[str, str], base: tuple[str, str]) -> str:
    """", at 1.0× fedavg's bytes and 1.3× its CPU time": what a cell's runs cost relative to the baseline's
    (total bytes down + up + peer; CPU seconds, or wall seconds when a record lacks them, marked †)."""
    parts = []
    nb, bb = (_mean_metric(by, k, "bytes_down", "bytes_up", "bytes_peer") for k in (cell, base))
    if nb is not None and bb:
        parts.append(f"{nb / bb:.1f}× {base[1]}'s bytes")
    nc, bc = (_mean_metric(by, k, "cpu_seconds") for k in (cell, base))
    mark = ""
    if nc is None or not bc:
        nc, bc, mark = (*(_mean_metric(by, k, "wall_seconds") for k in (cell, base)), f" {WALL}")
    if nc is not None and bc:
        parts.append(f"{nc / bc:.1f}× its {'wall' if mark else 'CPU'} time{mark}")
    return ", at " + " and ".join(parts) if parts else ""


def guide(spec: dict[str, Any], by: Cells) -> list[str]:
    """One sentence per regime for a deployment of one global model, "if your clients look like X, start with Y,
    because Z", each citing its cells as ``[regime/method]``: Y is the method with a global model with the best
    mean headline when its paired test against the baseline is significant, else the baseline (the methods
    without a global model are :func:`personal_guide`'s)."""
    regimes, methods = axes(spec, by)
    window, base = int(spec.get("window", 5)), spec.get("baseline", "fedavg")
    words = spec.get("regime_text", {})
    out = []
    for g in regimes:
        best, v = best_in(by, g, [m for m in methods if not _is_personal(by, (g, m))], window)
        if not best:
            continue
        what = f"{words.get(g, g)} and you deploy one global model"
        if best == base or (g, base) not in by:
            out.append(f"If your clients look like {what}, start with {best}: it has the highest mean "
                       f"({100 * v:.1f} %) [{g}/{best}].")
            continue
        diff, p, n = versus(by, g, best, base, window)
        fed = mean_of(by, (g, base), window)
        if p == p and p < 0.05 and diff > 0:
            out.append(f"If your clients look like {what}, start with {best}, because it beat {base} by "
                       f"{100 * diff:+.1f} points ({100 * v:.1f} vs {100 * fed:.1f} %, paired t over {n} "
                       f"seeds, p = {p:.2g}){cost_ratio(by, (g, best), (g, base))} [{g}/{best}, {g}/{base}].")
        else:
            why = (f"p = {p:.2g}" if p == p else
                   f"no test: {n} paired seeds" + (", the same difference on each" if n >= 3 else ""))
            out.append(f"If your clients look like {what}, start with {base}: the best mean, {best} "
                       f"({100 * v:.1f} vs {100 * fed:.1f} %), is not significantly better ({why}) "
                       f"[{g}/{best}, {g}/{base}].")
    return out


def personal_guide(spec: dict[str, Any], by: Cells) -> list[str]:
    """The guide on the personalised footing, one sentence per regime: when each client keeps the model it is
    served, the method with the best mean per-client accuracy on the clients' own test data
    (``personal_accuracy``, every method has one) if its paired test against the baseline's is significant, else
    the baseline; each sentence cites its cells."""
    regimes, methods = axes(spec, by)
    base = spec.get("baseline", "fedavg")
    words = spec.get("regime_text", {})
    out = []
    for g in regimes:
        per = {m: {s: float(v) for s, r in by.get((g, m), {}).items()
                   if (v := r["metrics"].get("personal_accuracy")) is not None}
               for m in methods if not diverged(by, (g, m))}
        per = {m: v for m, v in per.items() if v}
        if not per:
            continue
        best = max(per, key=lambda m: sum(per[m].values()) / len(per[m]))
        v = sum(per[best].values()) / len(per[best])
        lead = f"If your clients look like {words.get(g, g)} and each keeps the model it is served"
        if best == base or base not in per:
            out.append(f"{lead}, start with {best}: it has the highest per-client accuracy ({100 * v:.1f} %) "
                       f"[{g}/{best}].")
            continue
        seeds = sorted(set(per[best]) & set(per[base]))
        t = paired_test([per[best][s] for s in seeds], [per[base][s] for s in seeds])
        fed = sum(per[base].values()) / len(per[base])
        if t.p_value == t.p_value and t.p_value < 0.05 and t.diff > 0:
            out.append(f"{lead}, start with {best}, because its per-client accuracy beat {base}'s by "
                       f"{100 * t.diff:+.1f} points ({100 * v:.1f} vs {100 * fed:.1f} %, paired t over {t.n} seeds, "
                       f"p = {t.p_value:.2g}){cost_ratio(by, (g, best), (g, base))} [{g}/{best}, {g}/{base}].")
        else:
            out.append(f"{lead}, start with {base}: the best per-client mean, {best} ({100 * v:.1f} vs "
                       f"{100 * fed:.1f} %), is not significantly better (p = {t.p_value:.2g}) "
                       f"[{g}/{best}, {g}/{base}].")
    return out


# ---- figures ---------------------------------------------------------------------------------------------------
def figure_names(spec: dict[str, Any], by: Cells) -> dict[str, str]:
    """Figure key → file name (below ``spec["figures"]``) of the figures :func:`write_figures` draws from these
    cells: the rank heat-map (a method present in every regime), the critical-difference diagram (2+ regimes,
    3+ such methods; drawn with the ``bench`` extra) and one Pareto plot per regime."""
    regimes, methods, _ = rank_matrix(spec, by)
    out = {"heatmap": f"{spec['id']}-ranks.png"} if methods else {}
    if len(regimes) >= 2 and len(methods) >= 3:
        out["cd"] = f"{spec['id']}-cd.png"
    out.update({f"pareto-{g}": f"{spec['id']}-pareto-{g}.png" for g in regimes})
    return out


def write_figures(spec: dict[str, Any], recs: Sequence[dict[str, Any]], where: Path) -> list[Path]:
    """The rank heat-map, the critical-difference diagram and one accuracy-vs-bytes plot per regime; nothing
    without records.  Returns the files written."""
    by = cells(spec, recs)
    if not by:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    where.mkdir(parents=True, exist_ok=True)
    regimes, methods, mat = rank_matrix(spec, by)
    names = figure_names(spec, by)
    written = []
    if methods:
        rk = ranks(mat)
        fig, ax = plt.subplots(figsize=(max(4.0, 1.5 + 0.6 * len(methods)), max(2.5, 1.5 + 0.4 * len(regimes))))
        im = ax.imshow(rk, cmap="viridis_r", aspect="auto")
        ax.set_xticks(range(len(methods)), methods, rotation=60, ha="right")
        ax.set_yticks(range(len(regimes)), regimes)
        for i, row in enumerate(rk):
            for j, r in enumerate(row):
                dark = r > (1 + len(methods)) / 2  # the dark half of viridis_r: white text
                ax.text(j, i, f"{r:g}", ha="center", va="center", fontsize=7, color="w" if dark else "k")
        fig.colorbar(im, ax=ax, label="rank (1 = best)")
        fig.tight_layout()
        written.append(where / names["heatmap"])
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
        if "cd" in names:
            written += _cd_figure(mat, methods, where / names["cd"], plt)
    window = int(spec.get("window", 5))
    for g in axes(spec, by)[0]:
        pts, labels = [], []
        for m in axes(spec, by)[1]:
            recs_m = list(by.get((g, m), {}).values())
            if recs_m and not diverged(by, (g, m)):
                total = mean_std([(r.get("costs") or [[0, 0]])[-1][1] for r in recs_m]).mean
                pts.append((total / 1e6, mean_of(by, (g, m), window) * 100))
                labels.append(m)
        front = pareto_front(pts)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="0.6")
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "o-", color="C3", label="Pareto front")
        for (x, y), lab in zip(pts, labels):
            ax.annotate(lab, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("MB communicated (down + up + peer, whole run)")
        ax.set_ylabel(f"headline accuracy % (last {window} evals)")
        ax.set_title(g)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(where / names[f"pareto-{g}"])
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def _cd_figure(mat: list[list[float]], methods: list[str], path: Path, plt: Any) -> list[Path]:
    """The critical-difference diagram (scikit-posthocs) of mean ranks with Nemenyi's p-values; nothing without
    the ``bench`` extra."""
    try:
        import pandas as pd
        import scikit_posthocs as sp
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(6, 1 + 0.25 * len(methods)))
    sp.critical_difference_diagram(pd.Series(dict(zip(methods, mean_ranks(mat)))), posthoc(mat, methods), ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# ---- the rendered block ----------------------------------------------------------------------------------------
def blocks(spec: dict[str, Any], recs: Sequence[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The matrix as page blocks (``("p", text)``, ``("table", rows)``, ``("img", (path, alt))``): tables,
    statistics, figure links and the guide; or, without records, one paragraph saying so (no number is shown
    that no record holds)."""
    by = cells(spec, recs)
    if not by:
        where = (spec.get("records") or [spec["id"]])[0]
        return [("p", f"{NO_RECORDS} in `results/records/{where}/`: this matrix has not been run at this scale. "
                      f"`fedfuse bench {spec.get('command', '')}` runs it (see the protocol above).")]
    window = int(spec.get("window", 5))
    out: list[tuple[str, Any]] = [
        ("p", f"Headline accuracy (%), mean ± std over seeds of the mean of the last {window} evaluations; ▲/▼: "
              f"significantly better/worse than {spec.get('baseline', 'fedavg')} (paired t over the same seeds, "
              "p < 0.05); ᵖ: personalised accuracy (the method has no global model)."),
        ("table", matrix_rows(spec, by)),
        ("p", f"Costs: bytes and client FLOPs until a run's curve first reaches {spec.get('target', 0.9):g} × the "
              "regime's best headline; swing: the largest change between consecutive evaluations in the headline "
              f"window; CPU s/round: the run's CPU time per round (one thread); {WALL}: wall time, from records "
              "made before runs counted CPU time."),
        ("table", cost_rows(spec, by)), ("p", swing_summary(spec, by)), ("p", matrix_cost(by)),
        ("p", friedman_text(spec, by))]
    fig = spec.get("figures")
    if fig:
        rel = Path(fig).relative_to("docs") if fig.startswith("docs/") else Path(fig)
        out += [("img", (str(rel / v), k)) for k, v in figure_names(spec, by).items()]
    out += [("li", s) for s in guide(spec, by)] + [("li", s) for s in personal_guide(spec, by)]
    return out


def _markdown_block(kind: str, v: Any) -> str:
    if kind == "table":
        return markdown(v)
    if kind == "img":
        return f"![{v[1]}]({v[0]})"
    return f"- {v}" if kind == "li" else str(v)


def render_benchmark(spec: dict[str, Any], recs: Sequence[dict[str, Any]]) -> str:
    """The Markdown of a benchmark block (:func:`blocks`): consecutive figures share a paragraph, the guide is
    one list."""
    parts: list[tuple[str, str]] = []
    for kind, v in blocks(spec, recs):
        text = _markdown_block(kind, v)
        if parts and kind in ("img", "li") and parts[-1][0] == kind:
            parts[-1] = (kind, parts[-1][1] + (" " if kind == "img" else "\n") + text)
        else:
            parts.append((kind, text))
    return "\n\n".join(t for _, t in parts)


def write_html(sections: Sequence[tuple[str, Sequence[tuple[str, Any]]]], path: Path, title: str) -> Path:
    """An HTML page of titled sections of :func:`blocks` (``fedfuse bench``'s ``matrix.html``)."""
    from fedfuse.report import Page

    page = Page()
    page.h(1, title)
    for heading, bl in sections:
        page.h(2, heading)
        for kind, v in bl:
            if kind == "table":
                page.table(v)
            elif kind == "img":
                page.img(*v)
            else:
                page.p(f"• {v}" if kind == "li" else v)
    path.write_text(page.html(title))
    return path
