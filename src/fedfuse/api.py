"""The Python API: run, compare, load and discover experiments from a notebook or a script.

>>> import fedfuse
>>> res = fedfuse.run(algorithm="fedprox", dataset="digits", rounds=2, clients=5, mu=0.1)
>>> res.metrics[["round", "global_accuracy"]]          # a pandas DataFrame, one row per round
>>> table = fedfuse.compare(["fedavg", "fedprox"], seeds=3, rounds=5)
>>> print(table.to_markdown())                          # mean ± std (n), paired test vs the baseline

Options are named exactly as the configuration keys (``rounds``, ``lr``, ``algorithm_options.mu`` or the bare
``mu`` when only one namespace has it), and are validated by the same code as ``--config`` files and CLI flags.
The command line (:mod:`fedfuse.cli`) is a thin layer over these functions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfuse.config import ConfigError, RunConfig, apply, load_yaml, validate
from fedfuse.options import OptionInfo, describe
from fedfuse.types import Admits, Privacy

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure

    from fedfuse.engine.callbacks import Callback
    from fedfuse.sweep import ResultTable

ConfigLike = RunConfig | Mapping[str, Any] | str | Path | None

# Records carry these as lists/dicts; the per-round DataFrame keeps scalar columns only.
_NON_SCALAR = ("clients", "client_test_accuracy")


# ---- configuration -------------------------------------------------------------------------------------------
def make_config(config: ConfigLike = None, /, **options: Any) -> RunConfig:
    """A validated, fully resolved :class:`RunConfig`: defaults → ``config`` (object, mapping or YAML path) →
    ``options``.  Raises :class:`fedfuse.config.ConfigError` naming a bad key or value."""
    cfg = RunConfig()
    if isinstance(config, RunConfig):
        cfg = apply(RunConfig(), config.to_dict())
    elif isinstance(config, str | Path):
        cfg = apply(cfg, load_yaml(config))
    elif config is not None:
        cfg = apply(cfg, dict(config))
    top = {k: v for k, v in options.items() if k in RunConfig.__dataclass_fields__}
    cfg = apply(cfg, top)
    for k, v in options.items():  # one at a time, after the algorithm/model/... are chosen
        if k not in top:
            cfg = apply(cfg, {k: v})
    return validate(cfg)


def config_hash(cfg: RunConfig) -> str:
    """SHA-256 of everything in a resolved config that can change a run's metrics.

    Excluded: where outputs go and how they are produced (``out``, ``plots``, ``checkpoint_every``), where the
    data files are (``data_dir``: the same files give the same run) and ``threads``.
    """
    import hashlib

    d = cfg.to_dict()
    for k in ("out", "plots", "checkpoint_every", "data_dir", "threads"):
        d.pop(k, None)
    text = json.dumps(d, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


# ---- results -------------------------------------------------------------------------------------------------
def _augment(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds ``total_bytes`` (down + up + peer, cumulative) and ``bytes`` (this round) to each record."""
    out = []
    for h in history:
        h = dict(h)
        if "total_bytes" not in h:
            h["total_bytes"] = sum(h.get(k) or 0 for k in ("total_bytes_down", "total_bytes_up", "total_bytes_peer"))
        if "bytes" not in h:
            h["bytes"] = sum(h.get(k) or 0 for k in ("bytes_down", "bytes_up", "bytes_peer"))
        out.append(h)
    return out


@dataclass
class Result:
    """One finished run: its resolved config, per-round history, summary and (when written) output files."""

    config: RunConfig
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    out: Path | None = None
    cached: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        self.history = _augment(self.history)

    # -- metrics --
    @property
    def metrics(self) -> pd.DataFrame:
        """Per-round metrics as a DataFrame (one row per round, scalar columns: accuracies, losses, bytes, FLOPs,
        parameter counts, timings and any scalar diagnostic of the algorithm); rounds without an evaluation hold
        NaN in the evaluation columns."""
        import pandas as pd

        rows = [{k: v for k, v in h.items() if k not in _NON_SCALAR and not isinstance(v, list | dict)}
                for h in self.history]
        return pd.DataFrame.from_records(rows)

    @property
    def client_accuracy(self) -> pd.DataFrame:
        """Personalised test accuracy of every client (columns) at every evaluated round (index)."""
        import pandas as pd

        rows = {h["round"]: {int(c): v for c, v in h["client_test_accuracy"].items()}
                for h in self.history if h.get("client_test_accuracy")}
        frame = pd.DataFrame.from_dict(rows, orient="index")
        frame.index.name = "round"
        return frame.sort_index(axis=1)

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def algorithm(self) -> str:
        return self.config.algorithm

    def final(self, key: str = "global_accuracy", last: int = 5) -> float | None:
        """Mean of ``key`` over the last ``last`` evaluations."""
        from fedfuse.stats import final_mean

        return final_mean(self.history, key, last)

    def best(self, key: str = "global_accuracy") -> float | None:
        """Highest value of ``key`` over all evaluations."""
        from fedfuse.stats import best_value

        return best_value(self.history, key)

    # -- files --
    @property
    def artefacts(self) -> dict[str, Path]:
        """Output files that exist, by name (``config``, ``metrics``, ``summary``, ``curves``, ``partition``,
        ``checkpoint``, ``model_final``, ``model_best`` and the algorithm's own files such as heat-maps)."""
        if self.out is None or not self.out.is_dir():
            return {}
        known = {"config": "config.yaml", "metrics": "metrics.jsonl", "summary": "summary.json",
                 "curves": "curves.png", "partition": "partition.png", "partition_json": "partition.json",
                 "checkpoint": "checkpoint.pt", "model_final": "model_final.pt", "model_best": "model_best.pt"}
        out = {name: self.out / f for name, f in known.items() if (self.out / f).exists()}
        taken = set(known.values())
        for p in sorted(self.out.iterdir()):
            if p.is_file() and p.name not in taken:
                out.setdefault(p.stem, p)
        return out

    def plot(self, metrics: Sequence[str] | str | None = None, path: str | Path | None = None) -> Figure:
        """A figure with one panel per metric (default: the accuracies and losses this run measured) against
        rounds; saved to ``path`` when given.  Loss-like metrics use a log scale."""
        from fedfuse.plots import plot_metrics

        return plot_metrics({self.config.algorithm: [self.history]}, metrics, path)

    def __repr__(self) -> str:
        acc = self.final("global_accuracy")
        pers = self.final("personal_accuracy")
        parts = [f"{self.config.algorithm} on {self.config.dataset}", f"seed {self.config.seed}",
                 f"{len(self.history)} rounds"]
        if acc is not None:
            parts.append(f"final global acc {100 * acc:.2f}%")
        if pers is not None:
            parts.append(f"final personal acc {100 * pers:.2f}%")
        if self.out:
            parts.append(f"in {self.out}")
        return f"Result({', '.join(parts)})"


def load(run_dir: str | Path) -> Result:
    """The :class:`Result` of a run directory written by ``fedfuse run`` or :func:`run` (``config.yaml`` and
    ``metrics.jsonl``; ``summary.json`` when the run finished)."""
    d = Path(run_dir)
    if not (d / "config.yaml").exists() or not (d / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{d}: not a run directory (needs config.yaml and metrics.jsonl)")
    cfg = apply(RunConfig(), load_yaml(d / "config.yaml"))
    history = []
    lines = [line for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    for i, line in enumerate(lines):
        try:
            history.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a run killed while writing its last record
                break
            raise
    summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
    return Result(cfg, history, summary, d)


def is_run_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "config.yaml").exists() and (p / "metrics.jsonl").exists()


# ---- running -------------------------------------------------------------------------------------------------
def run(config: ConfigLike = None, /, *, progress: bool = False, callbacks: Sequence[Callback] = (),
        log: Sequence[str] = (), resume: bool = False, **options: Any) -> Result:
    """Run one experiment and return its :class:`Result`.

    ``config`` is a :class:`RunConfig`, a mapping of config keys or a YAML path; ``options`` override it
    (``rounds=5``, ``lr=0.05``, ``mu=0.1``, ``model_options={"widths": [64]}``...).  Without ``out`` nothing is
    written to disk.  ``callbacks`` receive every round's metrics (see :mod:`fedfuse.engine.callbacks`);
    ``log`` names built-in loggers (``"tensorboard"``, ``"mlflow"``, ``"csv"``).  ``resume=True`` continues
    the run in ``out`` from its checkpoint.
    """
    for word in ("seeds", "grid", "jobs"):
        if word in options:
            raise ConfigError(f"run() is one run; for {word}= use fedfuse.compare(...) or fedfuse.sweep(...)")
    cfg = make_config(config, **options)
    if resume and not (cfg.out and (Path(cfg.out) / "checkpoint.pt").exists()):
        raise ConfigError(f"resume: no checkpoint.pt in out={cfg.out!r} (nothing to resume)")
    return _execute(cfg, progress=progress, callbacks=callbacks, log=log, resume=resume)


def _execute(cfg: RunConfig, *, progress: bool = False, callbacks: Sequence[Callback] = (),
             log: Sequence[str] = (), resume: bool = False, fed: Any = None) -> Result:
    from fedfuse.engine.callbacks import CallbackList, make_loggers
    from fedfuse.experiment import Experiment

    cbs = CallbackList([*callbacks, *make_loggers(log, cfg)])
    exp = Experiment(cfg, fed=fed, progress=progress, on_round=cbs.on_round)
    cbs.on_run_start(exp.cfg)
    try:
        summary = exp.run(resume=resume)
    finally:
        cbs.on_run_end(exp.summary() if exp.history else {})
    return Result(exp.cfg, exp.history, summary, exp.out)


def compare(algorithms: Sequence[str] | str | None = None, config: ConfigLike = None, /, *,
            seeds: int | str | Sequence[int] = 1, grid: Mapping[str, Sequence[Any]] | None = None,
            per_algorithm: Mapping[str, Mapping[str, Any]] | None = None, baseline: str | None = None,
            metric: str = "auto", last: int = 5, target: float | None = None, test: str = "t",
            out: str | Path | None = None, store: str | Path | None = None, jobs: int = 1,
            rerun: bool = False, progress: bool = False, log: Sequence[str] = (),
            callbacks: Sequence[Callback] = (), **options: Any) -> ResultTable:
    """Run several algorithms (and/or a grid of options) over several seeds; return a :class:`ResultTable`.

    Each (algorithm, grid point, seed) is one run.  With the same seed every algorithm sees the same partition
    and initialisation, so the table's paired test compares like with like.  ``seeds`` is a count (``3`` →
    0, 1, 2) or a list.  ``grid`` maps config keys to value lists (the Cartesian product is run; a key applies
    to the algorithms that have it).  ``per_algorithm`` gives options for one algorithm only, e.g.
    ``{"fedprox": {"mu": 0.1}}``.

    With ``out``, the table (``compare.md/.csv/.json``) and the report are written there too.
    Runs are stored under ``store`` (default ``out/runs`` when ``out`` is given, otherwise in memory) in one
    directory per full-config hash: a finished run is loaded instead of rerun, an interrupted one resumes from
    its checkpoint, so an interrupted or extended sweep runs only what is missing (``rerun=True`` forces).
    ``jobs > 1`` runs in that many processes; each run's metrics are identical to a serial run's.
    """
    from fedfuse.sweep import Sweep

    sw = Sweep.plan(algorithms, config, seeds=seeds, grid=grid, per_algorithm=per_algorithm, **options)
    sw.execute(out=out, store=store, jobs=jobs, rerun=rerun, progress=progress, log=log, callbacks=callbacks)
    table = sw.table(baseline=baseline, metric=metric, last=last, target=target, test=test)
    if out is not None:
        table.write(out, plots=sw.points[0].config.plots)
    return table


def sweep(grid: Mapping[str, Sequence[Any]], config: ConfigLike = None, /, **kwargs: Any) -> ResultTable:
    """:func:`compare` over a grid of options of one configuration (``fedfuse.sweep({"lr": [0.01, 0.05]},
    algorithm="fedprox", seeds=3)``)."""
    return compare(None, config, grid=grid, **kwargs)


# ---- discovery -----------------------------------------------------------------------------------------------
def list_algorithms() -> dict[str, str]:
    """Algorithm name → one-line description."""
    from fedfuse.algorithms import ALGORITHMS

    return {k: v.description for k, v in sorted(ALGORITHMS.items())}


def list_datasets() -> dict[str, str]:
    """Dataset name → one-line description."""
    from fedfuse.data.datasets import DATASETS

    return {k: v.description for k, v in sorted(DATASETS.items())}


def list_models() -> dict[str, str]:
    """Model name → one-line description."""
    from fedfuse.models import MODELS

    return {k: v.description for k, v in sorted(MODELS.items())}


def list_partitions() -> dict[str, str]:
    """Partition name → one-line description."""
    from fedfuse.data.partition import PARTITIONS

    return dict(sorted(PARTITIONS.items()))


@dataclass(frozen=True)
class Component:
    """An algorithm, model, dataset, partition or the run configuration itself, with its options."""

    kind: str  # "algorithm", "model", "dataset", "partition" or "config"
    name: str
    description: str
    namespace: str  # where its options go in a config: "algorithm_options", ... ("" for top-level keys)
    options: list[OptionInfo]
    privacy: tuple[Privacy, ...] = ()  # an algorithm's declared privacy entries (docs/privacy.md)

    def format(self) -> str:
        """The text ``fedfuse show`` prints."""
        head = f"{self.name} ({self.kind}): {self.description}".rstrip(": ")
        head += "".join("\n" + line for e in self.privacy for line in privacy_lines(e))
        if not self.options:
            return head + "\n  (no options)"
        where = (f"set with --set {self.namespace}.NAME=VALUE, or under '{self.namespace}:' in a --config file"
                 if self.namespace else "set with a flag, --set NAME=VALUE, or as a top-level key of a --config file")
        rows = [(o.name, o.type, _show_default(o.default), _show_help(o)) for o in self.options]
        w = [max(len(r[i]) for r in [*rows, ("option", "type", "default", "")]) for i in range(3)]
        lines = [head, f"  options ({where}):",
                 f"    {'option':<{w[0]}}  {'type':<{w[1]}}  {'default':<{w[2]}}  help"]
        import shutil
        import textwrap

        indent = 4 + w[0] + w[1] + w[2] + 6
        width = max(shutil.get_terminal_size((120, 24)).columns, indent + 40)
        for a, b, c, d in rows:
            wrapped = textwrap.wrap(d, width - indent) or [""]
            lines.append(f"    {a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {wrapped[0]}".rstrip())
            lines += [" " * indent + more for more in wrapped[1:]]
        return "\n".join(lines)


#: how a run requests each mechanism, and its name in the privacy table
MECHANISM_LABELS = {"central_dp": ("central DP", "dp=central"), "local_dp": ("local DP", "dp=local"),
                    "secagg": ("SecAgg", "secagg=true")}


def _when(entry: Privacy) -> str:
    return " ".join(f"{k}={json.dumps(v)}" for k, v in entry.when)


def privacy_lines(entry: Privacy) -> list[str]:
    """The lines ``fedfuse show`` prints for one declared privacy entry."""
    when = f" (with {_when(entry)})" if entry.when else ""
    lines = [f"  privacy{when}: the server must see {entry.view.value}: {entry.why}"]
    for mech, (label, flag) in MECHANISM_LABELS.items():
        v = entry.admits(mech)
        lines.append(f"    {label + ' (' + flag + ')':<28} {v.support.value}: {v.why}")
    return lines


def privacy_table() -> str:
    """The Markdown table of every registered algorithm's privacy declaration (docs/privacy.md embeds it)."""
    from fedfuse.algorithms import ALGORITHMS

    def cell(v: Admits) -> str:
        return f"**{v.support.value}**: {v.why}".replace("|", "\\|")

    rows = ["| algorithm | the server must see | central DP | local DP | SecAgg |", "|---|---|---|---|---|"]
    for name, cls in sorted(ALGORITHMS.items()):
        for e in getattr(cls, "privacy", ()):
            label = f"`{name}`" + (f" ({_when(e)})" if e.when else "")
            view = f"**{e.view.value}**: {e.why}".replace("|", "\\|")
            rows.append(f"| {label} | {view} | {cell(e.central_dp)} | {cell(e.local_dp)} | {cell(e.secagg)} |")
    return "\n".join(rows) + "\n"


TABLE_START, TABLE_END = "<!-- privacy table: generated by fedfuse.api.write_privacy_table -->", "<!-- end -->"


def write_privacy_table(path: str | Path) -> bool:
    """Replace the generated table between the markers of ``path`` (docs/privacy.md); True if it changed."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    new = f"{head}{TABLE_START}\n{privacy_table()}{TABLE_END}{tail}"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def _show_default(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isfinite(v):
        return repr(v)
    return json.dumps(v) if isinstance(v, list | dict | tuple) else str(v)


def _show_help(o: OptionInfo) -> str:
    extra = []
    if o.choices:
        extra.append("one of " + ", ".join(map(str, o.choices)))
    if o.bounds:
        extra.append(o.bounds)
    text = o.help or ""
    return f"{text} [{'; '.join(extra)}]".strip() if extra else text


def _from_defaults(defaults: Mapping[str, Any]) -> list[OptionInfo]:
    """Options declared only by their defaults (no help line yet): the type is the default's."""
    def tname(v: Any) -> str:
        return "any" if v is None else type(v).__name__

    return [OptionInfo(k, tname(v), v, "", None, "") for k, v in defaults.items()]


def show(name: str, kind: str | None = None) -> list[Component]:
    """Every component called ``name`` (or only those of ``kind``), with the options a config accepts for it.

    The options come from the same declarations config validation uses (an algorithm's ``Options`` dataclass,
    a model builder's keyword arguments, a partition's or dataset's option table).  ``show("config")`` lists the
    top-level run keys.  Raises ``KeyError`` listing the valid names when nothing matches.
    """
    from fedfuse.algorithms import ALGORITHMS
    from fedfuse.data.datasets import DATASETS, dataset_options
    from fedfuse.data.partition import PARTITIONS, partition_options
    from fedfuse.models import MODELS, model_options

    found: list[Component] = []
    if kind in (None, "config") and name in ("config", "run"):
        from fedfuse.cli import FLAGS

        flag_help = {key: h for key, _, h in FLAGS.values()}
        opts = [o if o.help else OptionInfo(o.name, o.type, o.default, flag_help.get(o.name, ""), o.choices, o.bounds)
                for o in describe(RunConfig)]
        found.append(Component("config", "config", "top-level run configuration keys", "", opts))
    if kind in (None, "algorithm") and name in ALGORITHMS:
        cls = ALGORITHMS[name]
        opts = describe(cls.Options)
        found.append(Component("algorithm", name, cls.description, "algorithm_options", opts,
                               tuple(getattr(cls, "privacy", ()))))
    if kind in (None, "model") and name in MODELS:
        found.append(Component("model", name, MODELS[name].description, "model_options",
                               _from_defaults(model_options(name))))
    if kind in (None, "dataset") and name in DATASETS:
        found.append(Component("dataset", name, DATASETS[name].description, "dataset_options",
                               _from_defaults(dataset_options(name))))
    if kind in (None, "partition") and name in PARTITIONS:
        found.append(Component("partition", name, PARTITIONS[name], "partition_options",
                               _from_defaults(partition_options(name))))
    if not found:
        names = sorted({*ALGORITHMS, *MODELS, *DATASETS, *PARTITIONS, "config"})
        raise KeyError(f"nothing is called {name!r}; known names: {', '.join(names)}")
    return found
