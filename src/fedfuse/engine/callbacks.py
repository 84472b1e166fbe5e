"""Metrics callbacks: one interface for sending a run's metrics where researchers look at them.

Subclass :class:`Callback` and override any of its three methods; pass instances to
``fedfuse.run(..., callbacks=[...])``.  Built-in loggers are chosen by name (``--log tensorboard,mlflow`` on the
command line, ``log=["tensorboard"]`` in the API):

- ``tensorboard``: scalars under ``<out>/tensorboard`` (needs the ``tensorboard`` extra:
  ``pip install 'fedfuse[tensorboard]'``);
- ``mlflow``: a run in the active MLflow tracking URI with the config as params (needs ``mlflow``);
- ``csv``: ``<out>/metrics.csv``, one row per round (no dependency).

Each round's record is the dict written to ``metrics.jsonl``; only finite scalar values are logged.
With ``jobs > 1`` callbacks run inside worker processes, so they must be picklable.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from fedfuse.config import ConfigError, RunConfig
from fedfuse.extras import require_extra
from fedfuse.runfiles import METRICS_CSV, TENSORBOARD


class Callback:
    """Receives a run's lifecycle: ``on_run_start`` (resolved config), ``on_round`` (each round's metrics) and
    ``on_run_end`` (the summary, also after an error: then possibly partial)."""

    #: the optional extra (or package) a built-in logger needs (:mod:`fedfuse.extras`); checked before a run starts
    extra: ClassVar[str | None] = None

    def on_run_start(self, config: RunConfig) -> None:
        pass

    def on_round(self, record: dict[str, Any]) -> None:
        pass

    def on_run_end(self, summary: dict[str, Any]) -> None:
        pass


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numeric entries of a metrics record (lists, dicts, None, NaN and strings dropped)."""
    out = {}
    for k, v in record.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


class CallbackList(Callback):
    """Calls every callback in order."""

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks = list(callbacks)

    def on_run_start(self, config: RunConfig) -> None:
        for cb in self.callbacks:
            cb.on_run_start(config)

    def on_round(self, record: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb.on_round(record)

    def on_run_end(self, summary: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb.on_run_end(summary)


class CSVLogger(Callback):
    """``metrics.csv`` next to ``metrics.jsonl``: one row per round, one column per scalar metric."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else None
        self.rows: list[dict[str, float]] = []

    def on_run_start(self, config: RunConfig) -> None:
        if self.path is None and config.out:
            self.path = Path(config.out) / METRICS_CSV

    def on_round(self, record: dict[str, Any]) -> None:
        # integers (round, counts, bytes) stay integers: 3, not 3.0
        self.rows.append({k: record[k] if isinstance(record[k], int) else v for k, v in scalars(record).items()})

    def on_run_end(self, summary: dict[str, Any]) -> None:
        if self.path is None or not self.rows:
            return
        import csv

        cols: list[str] = []
        for r in self.rows:
            cols += [c for c in r if c not in cols]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(self.rows)


class TensorBoardLogger(Callback):
    """Scalars per round (step = round) in ``log_dir`` (default ``<out>/tensorboard``), hyper-parameters at the
    end.  Uses ``torch.utils.tensorboard``, which needs the ``tensorboard`` package."""

    extra = "tensorboard"

    def __init__(self, log_dir: str | Path | None = None) -> None:
        require_extra(self.extra, "--log tensorboard")
        self.log_dir = Path(log_dir) if log_dir else None
        self.writer: Any = None
        self.config: RunConfig | None = None

    def on_run_start(self, config: RunConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.config = config
        log_dir = self.log_dir or (Path(config.out) / TENSORBOARD if config.out else None)
        self.writer = SummaryWriter(log_dir=str(log_dir) if log_dir else None)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in config.to_dict().items()))

    def on_round(self, record: dict[str, Any]) -> None:
        step = int(record.get("round", 0))
        for k, v in scalars(record).items():
            if k != "round":
                self.writer.add_scalar(k, v, step)

    def on_run_end(self, summary: dict[str, Any]) -> None:
        if self.writer is None:
            return
        self.writer.flush()
        self.writer.close()


class MLflowLogger(Callback):
    """An MLflow run: the flattened config as params, every scalar metric per round (step = round), the
    summary's final block as ``final_*`` metrics.  Uses the active tracking URI (``MLFLOW_TRACKING_URI``)."""

    extra = "mlflow"

    def __init__(self, experiment: str | None = None) -> None:
        require_extra(self.extra, "--log mlflow")
        self.experiment = experiment
        self.active = False

    def on_run_start(self, config: RunConfig) -> None:
        import mlflow

        if self.experiment:
            mlflow.set_experiment(self.experiment)
        mlflow.start_run(run_name=f"{config.algorithm}-{config.dataset}-seed{config.seed}")
        self.active = True
        flat = {}
        for k, v in config.to_dict().items():
            if isinstance(v, dict):
                flat.update({f"{k}.{kk}": str(vv) for kk, vv in v.items()})
            else:
                flat[k] = str(v)
        mlflow.log_params(flat)

    def on_round(self, record: dict[str, Any]) -> None:
        import mlflow

        step = int(record.get("round", 0))
        mlflow.log_metrics({k: v for k, v in scalars(record).items() if k != "round"}, step=step)

    def on_run_end(self, summary: dict[str, Any]) -> None:
        import mlflow

        if not self.active:
            return
        final = scalars(summary.get("final", {})) if summary else {}
        if final:
            mlflow.log_metrics({f"final_{k}": v for k, v in final.items()})
        mlflow.end_run()
        self.active = False


LOGGERS: dict[str, type[Callback]] = {"tensorboard": TensorBoardLogger, "mlflow": MLflowLogger, "csv": CSVLogger}


def logger_names(names: Sequence[str] | str | None) -> list[str]:
    """The built-in logger names in ``names`` (a list or a comma-separated string), checked without building a
    logger: raises :class:`ConfigError` for an unknown name and :class:`fedfuse.extras.MissingExtra` for a logger
    whose extra is not installed (cheap: call it before any work)."""
    if not names:
        return []
    if isinstance(names, str):
        names = names.split(",")
    out = [x.strip().lower() for x in names if x.strip()]
    for n in out:
        if n not in LOGGERS:
            raise ConfigError(f"--log: unknown logger {n!r}; choose from {', '.join(LOGGERS)}")
        extra = LOGGERS[n].extra
        if extra:
            require_extra(extra, f"--log {n}")
    return out


def make_loggers(names: Sequence[str] | str | None, config: RunConfig | None = None) -> list[Callback]:
    """Built-in loggers by name (a list or a comma-separated string), checked by :func:`logger_names`."""
    return [LOGGERS[n]() for n in logger_names(names)]
