"""Run directories: checking that a fresh run may write into ``--out``, and resuming a run from its own
directory (its ``config.yaml`` and ``checkpoint.pt``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fedfuse.coerce import plain
from fedfuse.config import RunConfig
from fedfuse.errors import ConfigError
from fedfuse.runfiles import CHECKPOINT, CONFIG, REPLACED, RUN_FILES


def prepare_run_dir(out: str | Path, *, overwrite: bool = False) -> Path:
    """Check that a fresh run may write into ``out``: not a file, writable, and not an earlier run's directory
    unless ``overwrite`` (then the earlier run's files are removed).  Creates nothing: the run makes its
    directory once its data and model are built, so a run that fails before leaves no empty folder.
    Raises :class:`ConfigError`."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path}: is a file, not a directory; choose another --out")
    earlier = [f for f in RUN_FILES if (path / f).exists()]
    if earlier and not overwrite:
        raise ConfigError(f"--out {path}: already holds a run ({', '.join(earlier)}); pass --overwrite to replace "
                          f"it, --resume {path} to continue it, or choose another --out")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out {path}: cannot write there ({existing} is a file); choose another --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {path}: cannot write there ({existing} is not writable)")
    if earlier:
        for name in REPLACED:
            (path / name).unlink(missing_ok=True)
    return path


#: fields that must agree between a checkpoint and the run resuming it (everything that shapes the model,
#: the data or the algorithm's state); rounds may grow, device/threads/plots/eval settings may change
RESUME_FIXED = ("algorithm", "dataset", "partition", "model", "clients", "clients_per_round", "seed", "val_fraction",
                "local_epochs", "batch_size", "lr", "momentum", "weight_decay", "optimizer", "grad_clip",
                "algorithm_options", "model_options", "partition_options", "dataset_options", "dropout",
                "stragglers", "deadline", "late_replies", "quorum", "corrupt", "corrupt_clients", "dp", "secagg",
                "dp_noise", "dp_clip", "dp_quantile", "dp_clip_lr", "dp_count_noise", "dp_delta", "dp_accountant",
                "precision", "memory_format", "fp32_matmul", "secagg_threshold", "secagg_neighbors",
                "secagg_frac_bits", "dp_reproducible", "dp_debug_metrics", "global_eval")
#: what else ε depends on, fixed when the checkpoint's run used DP (a change would rewrite the accounting)
DP_RESUME_FIXED = ("sampling",)


def check_resume(saved: dict[str, Any], cfg: RunConfig, done_rounds: int, source: str) -> None:
    """Raise :class:`ConfigError` unless a checkpoint's config ``saved`` belongs to run ``cfg`` (same algorithm,
    model, data, ...) and ``cfg.rounds`` is at least the ``done_rounds`` already completed."""
    new = cfg.to_dict()
    dp = saved.get("dp", "none") not in (None, "none") or new.get("dp") != "none"
    for key in RESUME_FIXED + (DP_RESUME_FIXED if dp else ()):
        if key in saved and key in new and plain(saved[key]) != plain(new[key]):
            why = " (the privacy accounting of the rounds already run depends on it)" if (
                dp and (key.startswith("dp") or key in (*DP_RESUME_FIXED, "clients", "clients_per_round"))) else ""
            raise ConfigError(f"--resume: {source} was written with {key}={saved[key]!r} but this run has "
                              f"{key}={new[key]!r}{why}; a checkpoint resumes only the run that wrote it")
    if cfg.rounds < done_rounds:
        raise ConfigError(f"rounds: {cfg.rounds} is fewer than the {done_rounds} rounds the checkpoint already "
                          f"completed; give --rounds >= {done_rounds}")


def resume_config(args: Any, build: Any) -> RunConfig:
    """The configuration to resume run directory ``args.resume``: its ``config.yaml``, then the flags given now
    (only ``rounds`` and run-time settings such as ``device`` may differ; the checkpoint check enforces it)."""
    out = Path(args.resume)
    if not (out / CHECKPOINT).is_file():
        raise ConfigError(f"--resume {out}: no checkpoint.pt there (nothing to resume)")
    if not (out / CONFIG).is_file():
        raise ConfigError(f"--resume {out}: no config.yaml there; it is not a fedfuse run directory")
    if getattr(args, "config", None):
        raise ConfigError("--resume takes the run's own config.yaml; drop --config (change rounds with --rounds)")
    if getattr(args, "out", None) and Path(args.out).resolve() != out.resolve():
        raise ConfigError(f"--out {args.out}: a resumed run writes into its own directory {out}; drop --out")
    if getattr(args, "overwrite", False):
        raise ConfigError("--overwrite and --resume contradict each other; choose one")
    args.config = str(out / CONFIG)
    cfg = build(args)
    cfg.out = str(out)
    return cfg
