"""A reproduction as data: tables of labelled run configurations, run by :class:`fedfuse.sweep.Sweep` and
summarised by :class:`fedfuse.result_table.ResultTable`, the machinery of ``fedfuse compare``.

A family module (``fedmerge.py`` → ``fedfuse reproduce fedmerge``) defines ``FAMILY``, a :class:`Family`: its
description, its flags and ``tables(args) -> list[Table]``, the preset its flags select, built without running
anything.  :func:`run` executes every table's runs into one run store below ``--out`` (directories named by
config hash, so ``--reuse`` keeps finished runs and resumes interrupted ones) and writes, per table,
``compare.md/csv/json/png`` and, for all tables, ``tables.md`` and ``results.json``.  A family may add
``extra(args, out, done) -> str``: work that is not a grid of runs (a plot over the runs, a model-merging
study), its Markdown appended to ``tables.md``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfuse.cached_runs import Progress, run_cached, run_dir_name
from fedfuse.config import RunConfig, apply, check_extras, validate
from fedfuse.extras import require_extra
from fedfuse.result import Result
from fedfuse.result_table import ResultTable
from fedfuse.stats import paired_test, stability
from fedfuse.sweep import Point, Sweep
from fedfuse.tables import markdown
from fedfuse.types import Federation


@dataclass(frozen=True)
class Table:
    """One table of a reproduction: every row is ``base`` updated by the row's overrides, run once per seed.

    ``metric``/``last``: the compared value, the mean of the last ``last`` evaluations of ``metric``.  The first
    row is the baseline of the table's paired tests.  ``pairs``: the paper's ordering, ``(a, b)`` = row ``a``
    is expected better than row ``b`` (tested on the same seeds).  ``paper``: the paper's number per row.
    ``columns``: further metrics shown per seed (their last recorded value).  ``federation``: builds the
    federation of a run whose config does not describe it (e.g. a truncated corpus); ``None``: the config's.
    """

    id: str
    title: str
    base: Mapping[str, Any]
    rows: Mapping[str, Mapping[str, Any]]
    metric: str = "global_accuracy"
    last: int = 1
    pairs: tuple[tuple[str, str], ...] = ()
    paper: Mapping[str, str] = field(default_factory=dict)
    columns: tuple[str, ...] = ()
    federation: Callable[[RunConfig], Federation] | None = None

    def config(self, label: str) -> RunConfig:
        """The validated configuration of row ``label`` (without its seed)."""
        return validate(apply(RunConfig(), {**self.base, **self.rows[label]}))

    def plan(self, seeds: Sequence[int]) -> Sweep:
        """The table's runs as a :class:`Sweep` (every configuration validated before anything runs)."""
        if not self.rows:
            raise ValueError(f"table {self.id}: no rows")
        missing = [p for pair in self.pairs for p in pair if p not in self.rows]
        if missing:
            raise ValueError(f"table {self.id}: pairs name rows it does not have: {missing}")
        return Sweep([Point(label, self.config(label)) for label in self.rows], list(seeds))


def pick(rows: Mapping[str, Any], wanted: str | Sequence[str], flag: str = "--methods") -> dict[str, Any]:
    """The rows named in a comma list (all when empty), in the preset's order; an unknown name is an error."""
    names = [w.strip() for w in (wanted.split(",") if isinstance(wanted, str) else wanted) if w.strip()]
    unknown = [n for n in names if n not in rows]
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown}; choose from {', '.join(rows)}")
    return {k: v for k, v in rows.items() if not names or k in names}


def pairs_within(rows: Mapping[str, Any], pairs: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The pairs whose both rows are present (a row left out by ``--methods`` takes its pairs with it)."""
    return tuple((a, b) for a, b in pairs if a in rows and b in rows)


@dataclass(frozen=True)
class Family:
    """A ``fedfuse reproduce NAME``: its one-line description, its flags, its preset and optional extra work."""

    description: str
    tables: Callable[[Any], list[Table]]
    add_arguments: Callable[[Any], None] | None = None
    extra: Callable[[Any, Path, dict[str, ResultTable]], str] | None = None
    docs: str = ""  # the docs page of the family (default: the name's first word)
    seeds: str = "3"  # the default --seeds of the full preset
    quick_seeds: str = "1"  # ... and of --quick
    #: optional extras every run of the family needs (:mod:`fedfuse.extras`), checked before its tables are built
    #: (building them may read corpora; running them may pretrain a base first)
    extras: tuple[str, ...] = ()
    #: a run that diverges is one of the family's outcomes (the benchmark matrix shows it in its cell) rather than
    #: an error that ends the command
    diverged_ok: bool = False


# ---- running ---------------------------------------------------------------------------------------------------
def execute(table: Table, seeds: Sequence[int], store: Path, *, reuse: bool, fresh: set[str], progress: bool = False,
            jobs: int = 1, out: Path | None = None, diverged_ok: bool = False) -> Sweep:
    """Run ``table``'s runs into ``store``.  Without ``reuse`` a run directory left by an earlier invocation is
    deleted first (``fresh`` holds the ones this invocation made: tables may share runs).  ``diverged_ok``: a run
    that diverges is a result (:meth:`Sweep.execute`)."""
    sweep = table.plan(seeds)
    for _, cfg in sweep.configs():
        name = run_dir_name(cfg)
        if not reuse and name not in fresh and (store / name).exists():
            shutil.rmtree(store / name)
        fresh.add(name)
    if table.federation is None:
        return sweep.execute(out=out, store=store, jobs=jobs, progress=progress, verbose=True,
                             diverged_ok=diverged_ok)
    # Sweep.execute builds each run's federation from its config; these runs bring their own (same store)
    sweep.results = {p.label: [] for p in sweep.points}
    plan = sweep.configs()
    counter = Progress(len(plan))
    for label, cfg in plan:
        cfg.out = str(store / run_dir_name(cfg))
        sweep.results[label].append(run_cached(cfg, progress=progress, fed=table.federation(cfg)))
        print(counter.line(label, cfg.seed), file=sys.stderr)
    return sweep


#: Columns computed from a run's history rather than recorded: the stability means of the global accuracy.
DERIVED: dict[str, Callable[[list[dict[str, Any]]], Any]] = {
    "last10_mean": lambda h: stability(h)[0],  # the mean over the last 10 rounds
    "best10_mean": lambda h: stability(h)[1],  # the best mean over 10 consecutive rounds
}


def last_value(r: Result, key: str) -> Any:
    """The last recorded value of ``key`` in a run's history (else its summary's last evaluated round), or a
    :data:`DERIVED` column."""
    if key in DERIVED:
        return DERIVED[key](r.history)
    found = next((h[key] for h in reversed(r.history) if h.get(key) is not None), None)
    return found if found is not None else r.last.get(key)


def _fmt(v: Any, scale: float) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return "-".join(map(str, v)) if isinstance(v, list) else str(v)
    return f"{scale * v:.1f}" if scale != 1 else f"{v:.4g}"


def details(table: Table, rt: ResultTable) -> list[dict[str, Any]]:
    """Per row: the compared value per seed, the paper's number and the extra columns per seed."""
    scale = 100.0 if "accuracy" in table.metric else 1.0
    out = []
    for label, runs in rt.results.items():
        row: dict[str, Any] = {"label": label,
                               f"{table.metric} per seed": " / ".join(_fmt(r.final(table.metric, table.last), scale)
                                                                      for r in runs),
                               "seeds": ",".join(str(r.seed) for r in runs)}
        if table.paper:
            row["paper"] = table.paper.get(label, "—")
        for c in table.columns:
            scale_c = 100.0 if "accuracy" in c or c in DERIVED else 1.0  # accuracies in %
            row[c] = " / ".join(_fmt(last_value(r, c), scale_c) for r in runs)
        out.append(row)
    return out


def ordering(table: Table, rt: ResultTable) -> list[dict[str, Any]]:
    """Each pair of the paper's ordering on the seeds both rows ran: difference, paired t-test, verdict."""
    sign = -1.0 if rt.lower else 1.0
    scale = 100.0 if rt.is_accuracy else 1.0
    out = []
    for a, b in table.pairs:
        va = {r.seed: r.final(table.metric, table.last) for r in rt.results[a]}
        vb = {r.seed: r.final(table.metric, table.last) for r in rt.results[b]}
        common = sorted(set(va) & set(vb))
        t = paired_test([va[s] for s in common], [vb[s] for s in common])
        out.append({"comparison": f"{a} vs {b}", "difference": round(scale * t.diff, 2) if t.n else None,
                    "p (paired t)": None if t.p_value != t.p_value else round(t.p_value, 4),
                    "paper ordering holds": ("yes" if sign * t.diff > 0 else "no") + ("" if t.significant()
                                                                                       else " (n.s.)")})
    return out


def section(table: Table, rt: ResultTable) -> str:
    """A table's Markdown: the statistics table, the per-seed details and the paper's ordering."""
    text = f"## {table.title}\n\n{rt.to_markdown()}\n\n{markdown(details(table, rt))}"
    if table.pairs:
        text += f"\n\nPaper ordering (same seeds):\n\n{markdown(ordering(table, rt))}"
    return text


def run(family: Family, args: Any, *, reuse: bool, default_out: str, name: str = "") -> int:
    """Run the preset ``family.tables(args)`` selects; write every table and ``tables.md`` below ``--out``
    (default ``default_out``).  ``reuse``: keep finished runs of the same config, resume interrupted ones.
    ``name``: the family's command name (``fedfuse reproduce NAME``), for messages."""
    from fedfuse.reproduce.common import seeds as seeds_of

    for extra in family.extras:
        require_extra(extra, f"reproduce {name}".strip())
    tables = family.tables(args)
    check_extras(*(table.config(label) for table in tables for label in table.rows))  # before any run
    seeds = seeds_of(args)
    out = Path(args.out or default_out)
    out.mkdir(parents=True, exist_ok=True)
    progress, jobs = not getattr(args, "no_progress", False), int(getattr(args, "jobs", 1) or 1)
    done: dict[str, ResultTable] = {}
    fresh: set[str] = set()
    t0, blocks = time.perf_counter(), []
    for table in tables:
        sweep = execute(table, seeds, out / "runs", reuse=reuse, fresh=fresh, progress=progress, jobs=jobs,
                        out=out / table.id, diverged_ok=family.diverged_ok)
        rt = sweep.table(metric=table.metric, last=table.last)
        rt.write(out / table.id, plots=bool(getattr(args, "plots", True)))
        done[table.id] = rt
        blocks.append(section(table, rt))
        print(blocks[-1] + "\n", flush=True)
    if family.extra is not None:
        blocks.append(family.extra(args, out, done))
    text = (f"Seeds {','.join(map(str, seeds))}\n\n" + "\n\n".join(b for b in blocks if b)
            + f"\n\nTotal wall time: {time.perf_counter() - t0:.0f} s\n")
    (out / "tables.md").write_text(text)
    (out / "results.json").write_text(json.dumps(
        {tid: {"metric": rt.metric, "last": rt.last, "runs": {label: [{"seed": r.seed, "final": r.final(rt.metric,
                                                                                                         rt.last),
                                                                        "dir": str(r.out) if r.out else None,
                                                                        **({"diverged": r.diverged["round"]}
                                                                           if r.diverged else {})}
                                                                       for r in rs]
                                                              for label, rs in rt.results.items()}}
         for tid, rt in done.items()}, indent=2, default=str))
    print(f"wrote {out / 'tables.md'}")
    return 0
