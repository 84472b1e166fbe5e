"""Seeds, grids and cached, optionally parallel, execution of many runs; the statistics table over them.

A :class:`Sweep` is a list of labelled points (an algorithm and option overrides) times a list of seeds.
:meth:`Sweep.execute` runs what is missing from a *store*: one directory per run named by the hash of its
full resolved config (:func:`fedfuse.config.config_hash`).  A finished run there is loaded, an interrupted one
resumes from its checkpoint, so rerunning a sweep with more seeds or more grid values runs only the new runs.
With ``jobs > 1`` runs execute in separate processes; every random draw depends only on the seed, so the
metrics are the same as a serial run's.

:class:`ResultTable` holds the runs by label and reports, per label: n, final accuracy (mean of the last k
evaluations) and best accuracy as mean ± std over seeds, rounds / MB / GFLOPs to a target accuracy, total
communication, and a paired test against a baseline label over the shared seeds.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfuse.config import ConfigError, ConfigLike, RunConfig, apply, config_hash, make_config, parse_value, validate
from fedfuse.result import Result, is_run_dir, load
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
    parse_seeds,
    rounds_to_target,
)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from fedfuse.engine.callbacks import Callback


# ---- grids ---------------------------------------------------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: ``"[1,2],[3]"`` → ``["[1,2]", "[3]"]``."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["lr=0.01,0.05", "mu=0.1,0.25"]`` → ``{"lr": [0.01, 0.05], "mu": [0.1, 0.25]}`` (YAML values; lists
    such as ``widths=[64],[128]`` keep their brackets)."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--grid expects KEY=V1,V2,..., got {item!r}")
        k, v = item.split("=", 1)
        values = [parse_value(x) for x in _split_top(v)]
        if not values:
            raise ConfigError(f"--grid {item}: no values")
        grid[k.strip()] = values
    return grid


def expand_grid(grid: Mapping[str, Sequence[Any]] | None) -> list[dict[str, Any]]:
    """The Cartesian product of a grid, in key order (the last key varies fastest); ``[{}]`` for no grid."""
    if not grid:
        return [{}]
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(list(grid[k]) for k in keys))]


def _fmt_value(v: Any) -> str:
    return json.dumps(v, separators=(",", ":")) if isinstance(v, list | dict) else str(v)


# ---- the plan ------------------------------------------------------------------------------------------------
@dataclass
class Point:
    """One labelled configuration (without its seed)."""

    label: str
    config: RunConfig


@dataclass
class Sweep:
    """Labelled configurations × seeds.  Build with :meth:`plan`, run with :meth:`execute`."""

    points: list[Point]
    seeds: list[int]
    results: dict[str, list[Result]] = field(default_factory=dict)
    out: Path | None = None

    @classmethod
    def plan(cls, algorithms: Sequence[str] | str | None = None, config: ConfigLike = None, /, *,
             seeds: int | str | Sequence[int] = 1, grid: Mapping[str, Sequence[Any]] | None = None,
             per_algorithm: Mapping[str, Mapping[str, Any]] | None = None, **options: Any) -> Sweep:
        """Validate every point before anything runs.

        ``options`` and ``grid`` keys mean the same as in :func:`fedfuse.run` and ``--set``: a top-level key
        applies to every run; an option (``mu``, ``algorithm_options.mu``) applies to each algorithm that has it
        (an error only when none does); ``ALGO.option`` (``fedprox.mu``) to that algorithm only, as do the
        options in ``per_algorithm[ALGO]``."""
        from fedfuse.config import algorithm_prefix, canonical_name

        top = {k: v for k, v in options.items() if k in RunConfig.__dataclass_fields__}
        rest = {k: v for k, v in options.items() if k not in top}
        base = make_config(config, **top)
        if isinstance(algorithms, str):
            algorithms = [a.strip() for a in algorithms.split(",") if a.strip()]
        algorithms = [canonical_name("algorithm", a) for a in algorithms or []]
        for a in algorithms:
            validate(apply(RunConfig(), {"algorithm": a}))  # an unknown name: the closest names
        names = list(algorithms) if algorithms else [base.algorithm]
        if len(set(names)) != len(names):
            raise ConfigError(f"algorithms: listed twice in {', '.join(names)}")
        per_algorithm = {canonical_name("algorithm", k): v for k, v in (per_algorithm or {}).items()}
        stray = sorted(set(per_algorithm) - set(names))
        for k in [*rest, *(grid or {})]:
            pre = algorithm_prefix(k)
            if pre is not None and pre[0] not in names:
                stray.append(f"{pre[0]} (in {k})")
        if stray:
            raise ConfigError(f"options given for {', '.join(stray)}, which is not among the algorithms "
                              f"{', '.join(names)}")
        seed_list = parse_seeds(seeds)
        if len(set(seed_list)) != len(seed_list):
            raise ConfigError(f"seeds: listed twice in {seed_list}")
        grid = dict(grid or {})
        if "algorithm" in grid:  # applied to a resolved config, it would inherit the first one's options
            raise ConfigError("--grid algorithm=...: list algorithms with `compare --algorithms A,B` (or "
                              "fedfuse.compare), so each starts from its own option defaults")
        used: set[str] = set()
        points: list[Point] = []
        for name in names:
            start = base.to_dict()
            if algorithms:  # a new algorithm starts from its own option defaults
                start = {**start, "algorithm": name, "algorithm_options": {}}
            cfg = apply(RunConfig(), start)
            for k, v in rest.items():
                if _accepts(cfg, k, v):
                    cfg = apply(cfg, {k: v})
                    used.add(k)
            cfg = validate(apply(cfg, dict(per_algorithm.get(name, {}))))
            keys = [k for k in grid if _accepts(cfg, k, grid[k][0])]
            used.update(keys)
            for combo in expand_grid({k: grid[k] for k in keys}):
                c = cfg
                for k, v in combo.items():
                    c = apply(c, {k: v})
                c = validate(c)
                parts = [name] if (len(names) > 1 or not combo) else []
                parts += [f"{_short_key(k)}={_fmt_value(v)}" for k, v in combo.items()]
                points.append(Point(" ".join(parts), c))
        for k in [*rest, *grid]:
            if k not in used:
                _raise_unused(k, names, base, "--grid" if k in grid else "--set")
        labels = [p.label for p in points]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"two sweep points share a label: {labels}")
        return cls(points, seed_list)

    def configs(self) -> list[tuple[str, RunConfig]]:
        """(label, config with its seed) for every run, seeds outermost."""
        out = []
        for s in self.seeds:
            for p in self.points:
                out.append((p.label, validate(apply(p.config, {"seed": s}))))
        return out

    # ---- execution ---------------------------------------------------------------------------------------
    def execute(self, *, out: str | Path | None = None, store: str | Path | None = None, jobs: int = 1,
                rerun: bool = False, progress: bool = False, log: Sequence[str] = (),
                callbacks: Sequence[Callback] = (), verbose: bool = False) -> Sweep:
        """Run every missing run; returns ``self`` with :attr:`results` filled (label → results in seed order).

        ``store``: where runs live (default ``out/runs``; in memory when both are None).  ``out``: where
        ``sweep.json`` (the list of runs, read by ``fedfuse report``) is written.
        """
        self.out = Path(out) if out else None
        store_dir = Path(store) if store else (self.out / "runs" if self.out else None)
        todo: list[tuple[int, str, RunConfig, bool]] = []  # (index, label, cfg, resume)
        done: dict[int, Result] = {}
        plan = self.configs()
        for i, (label, cfg) in enumerate(plan):
            if store_dir is None:
                todo.append((i, label, cfg, False))
                continue
            run_dir = store_dir / run_dir_name(cfg)
            cfg.out = str(run_dir)
            status = _status(run_dir, cfg)
            if rerun and status != "empty":
                shutil.rmtree(run_dir)
                status = "empty"
            if status == "done":
                res = load(run_dir)
                res.cached = True
                done[i] = res
            else:
                todo.append((i, label, cfg, status == "partial"))
        if verbose:
            print(f"{len(plan)} runs: {len(done)} cached, {len(todo)} to run"
                  + (f" in {jobs} processes" if jobs > 1 and len(todo) > 1 else ""), file=sys.stderr)
        if jobs > 1 and len(todo) > 1:
            done.update(_run_parallel(todo, jobs, list(log), list(callbacks), verbose))
        else:
            from fedfuse.config import resolve_device
            from fedfuse.engine.loop import build_federation

            fed_key, fed = None, None  # runs are ordered seed-major: consecutive runs share one federation
            for i, label, cfg, resume in todo:
                if _federation_key(cfg) != fed_key:
                    fed = None  # free the previous one first
                    fed_key, fed = _federation_key(cfg), build_federation(cfg, resolve_device(cfg.device))
                res = _run_job(cfg, resume, progress, list(log), list(callbacks), fed=fed)
                if verbose:
                    print(f"  done: {label} seed {cfg.seed}", file=sys.stderr)
                done[i] = res
        self.results = {p.label: [] for p in self.points}
        for i, (label, _) in enumerate(plan):
            self.results[label].append(done[i])
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            entries = [{"label": label, "seed": cfg.seed, "hash": config_hash(cfg),
                        "dir": str(Path(done[i].out).resolve()) if done[i].out else None}
                       for i, (label, cfg) in enumerate(plan)]
            (self.out / "sweep.json").write_text(json.dumps({"labels": [p.label for p in self.points],
                                                             "seeds": self.seeds, "runs": entries}, indent=2))
        return self

    def table(self, **kwargs: Any) -> ResultTable:
        return ResultTable(self.results, **kwargs)


def run_dir_name(cfg: RunConfig) -> str:
    """``<algorithm>-<dataset>-s<seed>-<first 12 hex digits of the config hash>``."""
    from fedfuse.data.flower_datasets import dataset_label

    return f"{cfg.algorithm}-{dataset_label(cfg.dataset)}-s{cfg.seed}-{config_hash(cfg)[:12]}"


def _federation_key(cfg: RunConfig) -> str:
    """Everything that shapes a federation: runs with equal keys can share one."""
    return json.dumps([cfg.dataset, cfg.data_dir, cfg.partition, cfg.clients, cfg.seed, cfg.val_fraction,
                       cfg.partition_options, cfg.dataset_options, cfg.device], sort_keys=True, default=str)


def run_cached(cfg: RunConfig, *, progress: bool = False, fed: Any = None) -> Result:
    """Run ``cfg`` into ``cfg.out`` unless that directory already holds it: a finished run with the same config
    hash is loaded (``Result.cached``), an interrupted one resumes from its checkpoint, anything else (another
    config, no checkpoint) is run afresh.  Used by ``fedfuse reproduce --reuse``."""
    if not cfg.out:
        raise ValueError("run_cached: the config needs an out directory")
    run_dir = Path(cfg.out)
    status = _status(run_dir, cfg, strict=False)
    if status == "done":
        res = load(run_dir)
        res.cached = True
        return res
    return _run_job(cfg, status == "partial", progress, [], [], fed=fed)


def _status(run_dir: Path, cfg: RunConfig, strict: bool = True) -> str:
    """``done`` (finished, same config), ``partial`` (a checkpoint to resume), ``empty`` (nothing usable).

    A directory holding another configuration is an error when ``strict`` (store directories are named by
    their hash), otherwise ``empty``."""
    if not (run_dir / "config.yaml").exists():
        return "empty"
    try:
        old = load(run_dir).config
    except Exception:  # unreadable leftovers: start again
        return "empty"
    if config_hash(old) != config_hash(cfg):
        if not strict:
            return "empty"
        raise ConfigError(f"{run_dir} holds a different configuration than its name says; delete it")
    if (run_dir / "summary.json").exists():
        return "done"
    return "partial" if (run_dir / "checkpoint.pt").exists() else "empty"


def _accepts(cfg: RunConfig, key: str, value: Any) -> bool:
    """Whether ``key`` names a key or option of ``cfg`` (its algorithm, model, ...); a bad value still raises."""
    from fedfuse.config import UnknownKeyError

    try:
        apply(RunConfig(**{**cfg.to_dict()}), {key: value})
    except UnknownKeyError:
        return False
    return True


def _short_key(key: str) -> str:
    """A grid key as a label shows it: ``fedprox.mu`` → ``mu`` (the label names the algorithm already)."""
    from fedfuse.config import algorithm_prefix

    pre = algorithm_prefix(key)
    return pre[1] if pre else key


def _raise_unused(key: str, names: list[str], base: RunConfig, flag: str) -> None:
    """The error for an option no algorithm of the sweep has: the closest option names and who has them."""
    from fedfuse.config import UnknownKeyError, _all_algorithm_options, algorithms_with_option
    from fedfuse.names import closest, did_you_mean

    name = key.split(".", 1)[1] if key.startswith("algorithm_options.") else key
    if len(names) == 1:  # one algorithm: its own message says what would work
        apply(apply(RunConfig(), {**base.to_dict(), "algorithm": names[0]}), {key: None})
    known: set[str] = set()
    for n in names:
        cfg = apply(RunConfig(), {**base.to_dict(), "algorithm": n, "algorithm_options": {}})
        known.update(registered_options(cfg))
    hint = did_you_mean(name, sorted(known))
    msg = f"{flag} {key}: no algorithm among {', '.join(names)} has this option"
    if hint:
        raise UnknownKeyError(f"{msg}; {hint}")
    near = [name] if algorithms_with_option(name) else closest(name, _all_algorithm_options(), 1, 0.75)
    if near:
        owners = algorithms_with_option(near[0])
        what = f"{name} is" if near[0] == name else f"did you mean {near[0]}? It is"
        msg += f"; {what} an option of {', '.join(owners[:5])}{', ...' if len(owners) > 5 else ''}"
    raise UnknownKeyError(msg)


def registered_options(cfg: RunConfig) -> list[str]:
    """Every key and option name ``cfg`` accepts, bare (``rounds``, ``mu``, ``widths``...)."""
    from fedfuse.config import NAMESPACES, namespace_defaults

    names = list(RunConfig.__dataclass_fields__)
    for ns in NAMESPACES:
        names += list(namespace_defaults(cfg, ns))
    return names


def _run_job(cfg: RunConfig, resume: bool, progress: bool, log: list[str], callbacks: list[Any],
             fed: Any = None) -> Result:
    from fedfuse.runner import execute

    if cfg.out and not resume and Path(cfg.out).exists():
        shutil.rmtree(cfg.out)  # an incomplete run without a checkpoint: start it again
    return execute(cfg, progress=progress, callbacks=callbacks, log=log, resume=resume, fed=fed)


def _worker(args: tuple[dict[str, Any], bool, list[str], list[Any]]) -> Result:
    import torch

    from fedfuse.runtime.threads import worker_threads

    cfg_dict, resume, log, callbacks = args
    cfg = RunConfig(**cfg_dict)
    # one process per core: no oversubscription (an explicit count is kept; auto and 0 mean 1 per worker)
    cfg = dataclasses.replace(cfg, threads=str(worker_threads(cfg.threads)))
    torch.set_num_threads(int(cfg.threads))
    return _run_job(cfg, resume, False, log, callbacks)


def _run_parallel(todo: list[tuple[int, str, RunConfig, bool]], jobs: int, log: list[str],
                  callbacks: list[Any], verbose: bool) -> dict[int, Result]:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # Workers fork from a clean server process that imported fedfuse once (never from this process, which may
    # already run torch threads); spawn where forkserver does not exist.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["fedfuse.sweep", "fedfuse.engine.loop", "fedfuse.runner", "fedfuse.algorithms"])
    else:
        ctx = mp.get_context("spawn")
    out: dict[int, Result] = {}
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=ctx) as pool:
        futs = {pool.submit(_worker, (cfg.to_dict(), resume, log, callbacks)): (i, label, cfg.seed)
                for i, label, cfg, resume in todo}
        for fut in as_completed(futs):
            i, label, seed = futs[fut]
            out[i] = fut.result()
            if verbose:
                print(f"  done: {label} seed {seed}", file=sys.stderr)
    return out


# ---- statistics table ----------------------------------------------------------------------------------------
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
        if metric == "auto":
            every = [r for rs in self.results.values() for r in rs]
            metric = "global_accuracy" if all(r.final("global_accuracy") is not None for r in every) \
                else "personal_accuracy"
        every = [r for rs in self.results.values() for r in rs]
        if not any(h.get(metric) is not None for r in every for h in r.history):
            measured = sorted({k for r in every for h in r.history for k, v in h.items()
                               if isinstance(v, int | float) and not isinstance(v, bool)})
            from fedfuse.names import did_you_mean

            hint = did_you_mean(metric, measured)
            listed = f"; {hint}" if hint else (f"; measured: {', '.join(measured)}" if len(measured) <= 16 else
                                               " (the measured metrics are the columns of metrics.jsonl)")
            raise ConfigError(f"metric {metric!r} was not measured by any run{listed}")
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

    def _row(self, label: str, rs: list[Result]) -> Row:
        m, t = self.metric, self.target
        rounds = [rounds_to_target(r.history, t, m, self.lower) if t is not None else None for r in rs]
        vs = None
        if label != self.baseline:
            a, b = self._values(label), self._values(self.baseline)
            common = sorted(set(a) & set(b))
            vs = paired_test([a[s] for s in common], [b[s] for s in common], self.test)
        return Row(
            label=label, seeds=[r.seed for r in rs],
            final=mean_std([r.final(m, self.last) for r in rs]),
            best=mean_std([best_value(r.history, m, self.lower) for r in rs]),
            rounds_to_target=mean_std(rounds), reached=sum(x is not None for x in rounds),
            bytes_to_target=mean_std([cost_to_target(r.history, t, m, "total_bytes", self.lower)
                                      if t is not None else None for r in rs]),
            flops_to_target=mean_std([cost_to_target(r.history, t, m, "total_client_flops", self.lower)
                                      if t is not None else None for r in rs]),
            total_bytes=mean_std([r.history[-1].get("total_bytes") if r.history else None for r in rs]),
            total_flops=mean_std([r.history[-1].get("total_client_flops") if r.history else None for r in rs]),
            seconds=mean_std([r.history[-1].get("wall_seconds") if r.history else None for r in rs]),
            vs_baseline=vs,
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
        counts = [len(evaluations(r.history, self.metric)) for rs in self.results.values() for r in rs]
        note = (f"\n\n{final_note(self.last, counts)}; metric {self.metric} ({better}best = the "
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


def load_sweep(path: str | Path) -> dict[str, list[Result]]:
    """Runs of a sweep directory (``sweep.json``) or of any directory tree of run directories, by label.

    Without ``sweep.json`` runs are grouped by their config without the seed; the label is the algorithm plus
    the options in which the groups differ.
    """

    root = Path(path)
    if (root / "sweep.json").exists():
        meta = json.loads((root / "sweep.json").read_text())
        out: dict[str, list[Result]] = {label: [] for label in meta["labels"]}
        for e in meta["runs"]:
            d = Path(e["dir"])
            if not d.is_absolute() and not d.exists():
                d = root / d
            out[e["label"]].append(load(d))
        return out
    if is_run_dir(root):
        r = load(root)
        return {r.config.algorithm: [r]}
    dirs = sorted({p.parent for p in root.rglob("metrics.jsonl") if is_run_dir(p.parent)})
    if not dirs:
        raise FileNotFoundError(f"{root}: no run directories (config.yaml + metrics.jsonl) below it")
    groups: dict[str, list[Result]] = {}
    keys: dict[str, dict[str, Any]] = {}
    for d in dirs:
        r = load(d)
        k = {**r.config.to_dict(), "seed": None, "out": None}
        h = json.dumps(k, sort_keys=True, default=str)
        groups.setdefault(h, []).append(r)
        keys[h] = k
    flat = {h: _flatten(k) for h, k in keys.items()}
    # a key labels the groups when the groups that have it disagree on it (an option only FedProx has, at one
    # value, does not)
    varying = sorted(k for k in {k for f in flat.values() for k in f} - {"algorithm"}
                     if len({json.dumps(f[k], default=str) for f in flat.values() if k in f}) > 1)
    out = {}
    for h, rs in groups.items():
        label = " ".join([keys[h]["algorithm"], *(f"{k.split('.')[-1]}={_fmt_value(flat[h][k])}"
                                                 for k in varying if k in flat[h])])
        if label in out:  # groups that differ only in a key the label cannot show: keep them apart
            label = f"{label} #{h_short(h)}"
        out[label] = sorted(rs, key=lambda r: r.seed)
    return out


def h_short(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:6]


def _flatten(d: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out
