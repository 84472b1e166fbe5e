"""Seeds and grids of many runs: a :class:`Sweep` planned, validated and executed against a store of run
directories; a sweep's runs read back by label (:func:`load_sweep`).

A :class:`Sweep` is a list of labelled points (an algorithm and option overrides) times a list of seeds.
:meth:`Sweep.execute` runs what is missing from a *store* (:mod:`fedfuse.cached_runs`): one directory per run
named by the hash of its full resolved config (:func:`fedfuse.config.config_hash`).  A finished run there is
loaded, an interrupted one resumes from its checkpoint, so rerunning a sweep with more seeds or more grid values
runs only the new runs.  With ``jobs > 1`` runs execute in separate processes; every random draw depends only on
the seed, so the metrics are the same as a serial run's.  :meth:`Sweep.table` gives the statistics table over
the runs (:class:`fedfuse.result_table.ResultTable`).
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfuse.cached_runs import divergence_text, run_parallel, run_serial, split_stored
from fedfuse.config import (
    ConfigError,
    ConfigLike,
    RunConfig,
    apply,
    check_extras,
    config_hash,
    make_config,
    parse_value,
    validate,
)
from fedfuse.errors import DivergenceError
from fedfuse.result import Result, is_run_dir, load
from fedfuse.result_table import ResultTable
from fedfuse.runfiles import METRICS
from fedfuse.stats import parse_seeds

if TYPE_CHECKING:  # pragma: no cover
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
        top = {k: v for k, v in options.items() if k in RunConfig.__dataclass_fields__}
        rest = {k: v for k, v in options.items() if k not in top}
        base = make_config(config, **top)
        algorithms = _algorithm_list(algorithms)
        names = list(algorithms) if algorithms else [base.algorithm]
        if len(set(names)) != len(names):
            raise ConfigError(f"algorithms: listed twice in {', '.join(names)}")
        per_algorithm = _per_algorithm(per_algorithm, names, [*rest, *(grid or {})])
        seed_list = _unique_seeds(seeds)
        grid = _checked_grid(grid)
        used: set[str] = set()
        points: list[Point] = []
        for name in names:
            start = base.to_dict()
            if algorithms:  # a new algorithm starts from its own option defaults
                start = {**start, "algorithm": name, "algorithm_options": {}}
            cfg = _with_accepted(apply(RunConfig(), start), rest, used)
            cfg = validate(apply(cfg, dict(per_algorithm.get(name, {}))))
            points += _grid_points(name, cfg, grid, used, named=len(names) > 1)
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
                callbacks: Sequence[Callback] = (), verbose: bool = False, diverged_ok: bool = False) -> Sweep:
        """Run every missing run; returns ``self`` with :attr:`results` filled (label → results in seed order).

        A run that diverged is an outcome, kept in the store and never re-run (``rerun`` aside): every other run
        goes on, and at the end a :class:`~fedfuse.errors.DivergenceError` names each diverged run (fresh or
        stored) unless ``diverged_ok``, which returns them as results with ``diverged`` set and no final value.

        ``store``: where runs live (default ``out/runs``; in memory when both are None).  ``out``: where
        ``sweep.json`` (the list of runs, read by ``fedfuse report``) is written.  A missing extra that any run
        to do needs (:func:`fedfuse.config.check_extras`, ``log``'s loggers) is raised before the first run.
        """
        from fedfuse.engine.callbacks import logger_names

        self.out = Path(out) if out else None
        store_dir = Path(store) if store else (self.out / "runs" if self.out else None)
        plan = self.configs()
        todo, done = split_stored(plan, store_dir, rerun)
        if todo:
            check_extras(*(cfg for _, _, cfg, _ in todo))
            logger_names(log)
        parallel = jobs > 1 and len(todo) > 1
        if verbose:
            print(f"{len(plan)} runs: {len(done)} cached, {len(todo)} to run"
                  + (f" in {jobs} processes" if parallel else ""), file=sys.stderr)
        stored_diverged = [i for i, r in done.items() if r.diverged]
        if verbose:
            for i in stored_diverged:
                print(f"  diverged (stored): {plan[i][0]} seed {plan[i][1].seed}: {divergence_text(done[i])}",
                      file=sys.stderr)
        if parallel:
            done.update(run_parallel(todo, jobs, list(log), list(callbacks), verbose, raise_diverged=False))
        else:
            done.update(run_serial(todo, progress, list(log), list(callbacks), verbose, raise_diverged=False))
        self.results = {p.label: [] for p in self.points}
        for i, (label, _) in enumerate(plan):
            self.results[label].append(done[i])
        if self.out:
            self._write_index(self.out, plan, done)
        diverged = [f"{label} seed {cfg.seed}: {divergence_text(done[i])}" for i, (label, cfg) in enumerate(plan)
                    if done[i].diverged]
        if diverged and not diverged_ok:
            raise DivergenceError(f"{len(diverged)} of {len(plan)} runs diverged (every other run finished and is "
                                  "kept): " + "; ".join(diverged))
        return self

    def _write_index(self, out: Path, plan: list[tuple[str, RunConfig]], done: Mapping[int, Result]) -> None:
        """``out/sweep.json``: the labels, the seeds and every run (label, seed, config hash, directory)."""
        out.mkdir(parents=True, exist_ok=True)
        entries = [{"label": label, "seed": cfg.seed, "hash": config_hash(cfg),
                    "dir": str(Path(done[i].out).resolve()) if done[i].out else None}
                   for i, (label, cfg) in enumerate(plan)]
        (out / "sweep.json").write_text(json.dumps({"labels": [p.label for p in self.points],
                                                    "seeds": self.seeds, "runs": entries}, indent=2))

    def table(self, **kwargs: Any) -> ResultTable:
        return ResultTable(self.results, **kwargs)


def _algorithm_list(algorithms: Sequence[str] | str | None) -> list[str]:
    """The algorithms of a sweep (a list or ``"a,b"``) as the registry spells them; an unknown name raises
    with the closest names."""
    from fedfuse.config import canonical_name

    if isinstance(algorithms, str):
        algorithms = [a.strip() for a in algorithms.split(",") if a.strip()]
    names = [canonical_name("algorithm", a) for a in algorithms or []]
    for a in names:
        validate(apply(RunConfig(), {"algorithm": a}))  # an unknown name: the closest names
    return names


def _per_algorithm(per_algorithm: Mapping[str, Mapping[str, Any]] | None, names: list[str],
                   keys: list[str]) -> dict[str, Mapping[str, Any]]:
    """``per_algorithm`` by canonical name; raises when it or an ``ALGO.option`` key among ``keys`` names an
    algorithm outside ``names``."""
    from fedfuse.config import algorithm_prefix, canonical_name

    per = {canonical_name("algorithm", k): v for k, v in (per_algorithm or {}).items()}
    stray = sorted(set(per) - set(names))
    for k in keys:
        pre = algorithm_prefix(k)
        if pre is not None and pre[0] not in names:
            stray.append(f"{pre[0]} (in {k})")
    if stray:
        raise ConfigError(f"options given for {', '.join(stray)}, which is not among the algorithms "
                          f"{', '.join(names)}")
    return per


def _unique_seeds(seeds: int | str | Sequence[int]) -> list[int]:
    seed_list = parse_seeds(seeds)
    if len(set(seed_list)) != len(seed_list):
        raise ConfigError(f"seeds: listed twice in {seed_list}")
    return seed_list


def _checked_grid(grid: Mapping[str, Sequence[Any]] | None) -> dict[str, Sequence[Any]]:
    grid = dict(grid or {})
    if "algorithm" in grid:  # applied to a resolved config, it would inherit the first one's options
        raise ConfigError("--grid algorithm=...: list algorithms with `compare --algorithms A,B` (or "
                          "fedfuse.compare), so each starts from its own option defaults")
    return grid


def _with_accepted(cfg: RunConfig, options: Mapping[str, Any], used: set[str]) -> RunConfig:
    """``cfg`` with those ``options`` it has applied; their keys are added to ``used``."""
    for k, v in options.items():
        if _accepts(cfg, k, v):
            cfg = apply(cfg, {k: v})
            used.add(k)
    return cfg


def _grid_points(name: str, cfg: RunConfig, grid: Mapping[str, Sequence[Any]], used: set[str], *,
                 named: bool) -> list[Point]:
    """One validated point per combination of the grid keys ``cfg`` has (added to ``used``); the label names
    the algorithm when ``named`` or when there is no combination, then each grid value."""
    keys = [k for k in grid if _accepts(cfg, k, grid[k][0])]
    used.update(keys)
    points = []
    for combo in expand_grid({k: grid[k] for k in keys}):
        c = cfg
        for k, v in combo.items():
            c = apply(c, {k: v})
        c = validate(c)
        parts = [name] if (named or not combo) else []
        parts += [f"{_short_key(k)}={_fmt_value(v)}" for k, v in combo.items()]
        points.append(Point(" ".join(parts), c))
    return points


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


def load_sweep(path: str | Path) -> dict[str, list[Result]]:
    """Runs of a sweep directory (``sweep.json``) or of any directory tree of run directories, by label.

    Without ``sweep.json`` runs are grouped by their config without the seed; the label is the algorithm plus
    the options in which the groups differ.
    """

    root = Path(path)
    if (root / "sweep.json").exists():
        return _load_index(root)
    if is_run_dir(root):
        r = load(root)
        return {r.config.algorithm: [r]}
    dirs = sorted({p.parent for p in root.rglob(METRICS) if is_run_dir(p.parent)})
    if not dirs:
        raise FileNotFoundError(f"{root}: no run directories (config.yaml + metrics.jsonl) below it")
    return _label_groups([load(d) for d in dirs])


def _load_index(root: Path) -> dict[str, list[Result]]:
    """The runs a sweep's ``sweep.json`` lists, by label (a relative directory is taken below ``root``)."""
    meta = json.loads((root / "sweep.json").read_text())
    out: dict[str, list[Result]] = {label: [] for label in meta["labels"]}
    for e in meta["runs"]:
        d = Path(e["dir"])
        if not d.is_absolute() and not d.exists():
            d = root / d
        out[e["label"]].append(load(d))
    return out


def _label_groups(runs: list[Result]) -> dict[str, list[Result]]:
    """Runs grouped by their config without seed and directory, each group labelled by its algorithm and the
    options in which the groups differ; runs in seed order."""
    groups: dict[str, list[Result]] = {}
    keys: dict[str, dict[str, Any]] = {}
    for r in runs:
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
