"""The Python API: run, compare, load and discover experiments from a notebook or a script.

>>> import fedfuse
>>> res = fedfuse.run(algorithm="fedprox", dataset="digits", rounds=2, clients=5, mu=0.1)
>>> res.metrics[["round", "global_accuracy"]]          # a pandas DataFrame, one row per round
>>> table = fedfuse.compare(["fedavg", "fedprox"], seeds=3, rounds=5)
>>> print(table.to_markdown())                          # mean ± std (n), paired test vs the baseline

Options are named exactly as the configuration keys (``rounds``, ``lr``, ``algorithm_options.mu`` or the bare
``mu`` when only one namespace has it), and are validated by the same code as ``--config`` files and CLI flags.
The command line (:mod:`fedfuse.cli`) is a thin layer over these functions.  ``fedfuse.load``/``Result`` are
:mod:`fedfuse.result` (the run store), ``fedfuse.make_config``/``config_hash`` are :mod:`fedfuse.config`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfuse.catalog import when_text
from fedfuse.config import ConfigError, ConfigLike, make_config
from fedfuse.result import Result
from fedfuse.runner import execute
from fedfuse.types import Admits

if TYPE_CHECKING:  # pragma: no cover
    from fedfuse.catalog import Component
    from fedfuse.engine.callbacks import Callback
    from fedfuse.result_table import ResultTable

__all__ = ["compare", "list_algorithms", "list_datasets", "list_models", "list_partitions",
           "privacy_table", "run", "show", "sweep", "write_privacy_table"]


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
    return execute(cfg, progress=progress, callbacks=callbacks, log=log, resume=resume)


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
    from fedfuse.report import write_compare
    from fedfuse.sweep import Sweep

    sw = Sweep.plan(algorithms, config, seeds=seeds, grid=grid, per_algorithm=per_algorithm, **options)
    sw.execute(out=out, store=store, jobs=jobs, rerun=rerun, progress=progress, log=log, callbacks=callbacks)
    table = sw.table(baseline=baseline, metric=metric, last=last, target=target, test=test)
    if out is not None:
        write_compare(table, out, plots=sw.points[0].config.plots)
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


def privacy_table() -> str:
    """The Markdown table of every registered algorithm's privacy declaration (docs/privacy.md embeds it)."""
    from fedfuse.algorithms import ALGORITHMS

    def cell(v: Admits) -> str:
        return f"**{v.support.value}**: {v.why}".replace("|", "\\|")

    rows = ["| algorithm | the server must see | central DP | local DP | SecAgg |", "|---|---|---|---|---|"]
    for name, cls in sorted(ALGORITHMS.items()):
        for e in getattr(cls, "privacy", ()):
            label = f"`{name}`" + (f" ({when_text(e)})" if e.when else "")
            view = f"**{e.view.value}**: {e.why}".replace("|", "\\|")
            rows.append(f"| {label} | {view} | {cell(e.central_dp)} | {cell(e.local_dp)} | {cell(e.secagg)} |")
    rows += ["", "Admitted with the default options, by mechanism:", ""]
    for mech, label in (("central_dp", "central DP (`dp=central`)"), ("local_dp", "local DP (`dp=local`)"),
                        ("secagg", "SecAgg (`secagg=true`)")):
        names = [f"`{n}`" for n, c in sorted(ALGORITHMS.items())
                 if (e := c.privacy_for()) is not None and e.admits(mech).ok]
        rows.append(f"- {label}: {', '.join(names) or 'none'}")
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


def show(name: str, kind: str | None = None) -> list[Component]:
    """Every component called ``name`` (or only those of ``kind``), with the options a config accepts for it.

    The options come from the same declarations config validation uses (an algorithm's ``Options`` dataclass,
    a model builder's keyword arguments, a partition's or dataset's option table).  ``show("config")`` lists the
    top-level run keys.  Raises ``KeyError`` listing the valid names when nothing matches.
    """
    from fedfuse.catalog import find, live

    return find(name, kind, live())
