"""Runs executed against a *store* of run directories, each named by its config's hash: a finished run is
loaded instead of run again (a run that diverged is finished too: its outcome, ``diverged.json``, is loaded and
reported again, never re-run), an interrupted one resumes from its checkpoint; many runs go serially (sharing a
federation between consecutive runs) or in worker processes.  :meth:`fedfuse.sweep.Sweep.execute` and
``fedfuse reproduce --reuse`` use it."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedfuse.config import ConfigError, RunConfig, config_hash
from fedfuse.errors import DivergenceError
from fedfuse.result import Result, load
from fedfuse.runfiles import CHECKPOINT, CONFIG, DIVERGED, SUMMARY

Job = tuple[int, str, RunConfig, bool]  # (index in the plan, label, config, resume)


class Progress:
    """``done: LABEL seed S (run k of N; T elapsed, about L left)``: the time left assumes the remaining runs
    take as long as the finished ones did on average (with ``jobs`` at once)."""

    def __init__(self, total: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.total, self.done, self._clock = total, 0, clock
        self.t0 = clock()

    def line(self, label: str, seed: int, failed: str | None = None) -> str:
        """The line of a finished run; ``failed``: why it stopped (a diverged run counts as finished)."""
        self.done += 1
        elapsed = self._clock() - self.t0
        left = elapsed / self.done * (self.total - self.done)
        eta = f", about {_duration(left)} left" if self.done < self.total else ""
        what = "failed" if failed else "done"
        return (f"  {what}: {label} seed {seed} (run {self.done} of {self.total}; {_duration(elapsed)} elapsed{eta})"
                + (f": {failed}" if failed else ""))

    def report(self, label: str, seed: int, verbose: bool, failed: str | None = None) -> None:
        """Count a finished run; print its line when ``verbose``, a failed run's always."""
        line = self.line(label, seed, failed)
        if verbose or failed:
            print(line, file=sys.stderr)


class Failures:
    """The runs of a plan that diverged.  A divergence is an outcome of one configuration, not of the plan: the
    other runs go on (and stay in the store), and :meth:`raise_if_any` reports every diverged run at the end.
    Any other error stops the plan at once."""

    def __init__(self) -> None:
        self.diverged: list[str] = []

    def add(self, label: str, seed: int, err: DivergenceError) -> str:
        """Note the divergence of run (label, seed); returns why, for its progress line."""
        self.diverged.append(f"{label} seed {seed}: {err}")
        return str(err)

    def raise_if_any(self, total: int) -> None:
        if self.diverged:
            raise DivergenceError(f"{len(self.diverged)} of {total} runs diverged (every other run finished and "
                                  "is kept): " + "; ".join(self.diverged))


def _duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``1 h 2 min``."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def split_stored(plan: list[tuple[str, RunConfig]], store_dir: Path | None,
                 rerun: bool) -> tuple[list[Job], dict[int, Result]]:
    """The runs still to do, and the finished ones loaded from ``store_dir`` (by plan index).  Each config's
    ``out`` becomes its directory in the store; with ``rerun`` stored runs are deleted first."""
    todo: list[Job] = []
    done: dict[int, Result] = {}
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
        if status in ("done", "diverged"):
            done[i] = _load_cached(run_dir)
        else:
            todo.append((i, label, cfg, status == "partial"))
    return todo, done


def _load_cached(run_dir: Path) -> Result:
    res = load(run_dir)
    res.cached = True
    return res


def divergence_text(res: Result) -> str:
    """What stopped a diverged run, as the engine said it (``the run diverged in round R: why``)."""
    d = res.diverged or {}
    return str(d.get("why")) if d.get("round") is None else f"the run diverged in round {d['round']}: {d.get('why')}"


def _diverged_result(cfg: RunConfig, err: DivergenceError) -> Result:
    """The outcome of a run that diverged: its directory read back (``diverged.json``), or, for a run that
    writes nothing, a result holding only the engine's message."""
    if cfg.out and (Path(cfg.out) / DIVERGED).exists():
        return load(cfg.out)
    return Result(cfg, [], {}, None, diverged={"round": None, "why": str(err), "lr": cfg.lr})


def run_serial(todo: list[Job], progress: bool, log: list[str], callbacks: list[Any],
               verbose: bool, raise_diverged: bool = True) -> dict[int, Result]:
    """Run ``todo`` in this process; consecutive runs with the same federation share it.  A run that diverges
    does not stop the others (:class:`Failures`); its outcome is returned with them, and raised at the end when
    ``raise_diverged``."""
    from fedfuse.config import resolve_device
    from fedfuse.engine.assemble import build_federation

    out: dict[int, Result] = {}
    fed_key, fed = None, None  # runs are ordered seed-major: consecutive runs share one federation
    counter, failures = Progress(len(todo)), Failures()
    for i, label, cfg, resume in todo:
        if _federation_key(cfg) != fed_key:
            fed = None  # free the previous one first
            fed_key, fed = _federation_key(cfg), build_federation(cfg, resolve_device(cfg.device))
        why = None
        try:
            out[i] = _run_job(cfg, resume, progress, log, callbacks, fed=fed)
        except DivergenceError as e:
            why = failures.add(label, cfg.seed, e)
            out[i] = _diverged_result(cfg, e)
        counter.report(label, cfg.seed, verbose, why)
    if raise_diverged:
        failures.raise_if_any(len(todo))
    return out


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
        return _load_cached(run_dir)
    if status == "diverged":
        raise DivergenceError(divergence_text(load(run_dir)))
    return _run_job(cfg, status == "partial", progress, [], [], fed=fed)


def _status(run_dir: Path, cfg: RunConfig, strict: bool = True) -> str:
    """``done`` (finished, same config), ``diverged`` (stopped by a divergence: a finished outcome), ``partial``
    (a checkpoint to resume), ``empty`` (nothing usable).

    A directory holding another configuration is an error when ``strict`` (store directories are named by
    their hash), otherwise ``empty``."""
    if not (run_dir / CONFIG).exists():
        return "empty"
    try:
        old = load(run_dir).config
    except Exception:  # unreadable leftovers: start again
        return "empty"
    if config_hash(old) != config_hash(cfg):
        if not strict:
            return "empty"
        raise ConfigError(f"{run_dir} holds a different configuration than its name says; delete it")
    if (run_dir / SUMMARY).exists():
        return "done"
    if (run_dir / DIVERGED).exists():
        return "diverged"
    return "partial" if (run_dir / CHECKPOINT).exists() else "empty"


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


def run_parallel(todo: list[Job], jobs: int, log: list[str],
                 callbacks: list[Any], verbose: bool, raise_diverged: bool = True) -> dict[int, Result]:
    """Run ``todo`` in ``jobs`` worker processes (the metrics are those of a serial run).  A run that diverges is
    reported when it stops and does not stop the others (its outcome is returned, and raised at the end when
    ``raise_diverged``); any other error cancels the runs not yet started."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # Workers fork from a clean server process that imported fedfuse once (never from this process, which may
    # already run torch threads); spawn where forkserver does not exist.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["fedfuse.cached_runs", "fedfuse.engine.loop", "fedfuse.runner",
                                    "fedfuse.algorithms"])
    else:
        ctx = mp.get_context("spawn")
    out: dict[int, Result] = {}
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=ctx) as pool:
        futs = {pool.submit(_worker, (cfg.to_dict(), resume, log, callbacks)): (i, label, cfg)
                for i, label, cfg, resume in todo}
        counter, failures = Progress(len(todo)), Failures()
        for fut in as_completed(futs):
            i, label, cfg = futs[fut]
            seed = cfg.seed
            why = None
            try:
                out[i] = fut.result()
            except DivergenceError as e:
                why = failures.add(label, seed, e)
                out[i] = _diverged_result(cfg, e)
            except BaseException:
                for f in futs:
                    f.cancel()
                raise
            counter.report(label, seed, verbose, why)
    if raise_diverged:
        failures.raise_if_any(len(todo))
    return out
