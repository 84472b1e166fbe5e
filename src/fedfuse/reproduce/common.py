"""Helpers shared by the reproductions: run a grid of configurations on shared federations and
write Markdown tables."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedfuse.config import RunConfig, apply, resolve_device, validate
from fedfuse.engine.loop import build_federation
from fedfuse.runner import run
from fedfuse.types import Federation

_FED_CACHE: dict[str, Federation] = {}


def federation_for(cfg: RunConfig) -> Federation:
    """One federation per (dataset, partition, clients, seed, options): every algorithm sees the same split."""
    key = json.dumps(
        [cfg.dataset, cfg.data_dir, cfg.partition, cfg.clients, cfg.seed, cfg.val_fraction,
         cfg.partition_options, cfg.dataset_options, cfg.device],
        sort_keys=True, default=str,
    )
    if key not in _FED_CACHE:
        _FED_CACHE[key] = build_federation(cfg, resolve_device(cfg.device))
    return _FED_CACHE[key]


REUSE = False  # `fedfuse reproduce --reuse`: keep finished runs, resume interrupted ones (fedfuse.sweep.run_cached)


def run_one(base: dict[str, Any], out: Path, progress: bool = True, **overrides: Any) -> tuple[dict, list[dict]]:
    """Run one configuration (``base`` updated by ``overrides``) into ``out``; returns (summary, history)."""
    cfg = validate(apply(RunConfig(), {**base, **overrides, "out": str(out)}))
    if REUSE:
        from fedfuse.sweep import run_cached

        res = run_cached(cfg, progress=progress, fed=federation_for(cfg))
        return res.summary, res.history
    return run(cfg, fed=federation_for(cfg), progress=progress)


def pct(v: float | None) -> float | None:
    return None if v is None else round(100.0 * v, 2)


def run_seeds(base: dict[str, Any], out: Path, seeds: Iterable[int], progress: bool = False,
              **overrides: Any) -> list[tuple[dict, list[dict]]]:
    """Run one configuration once per seed into ``out/seed<k>``; returns [(summary, history)] in seed order.

    The seed sets everything (partition, initialisation, sampling, batches), so each seed is an
    independent replicate of the whole experiment.
    """
    runs = []
    for s in seeds:
        runs.append(run_one(base, Path(out) / f"seed{s}", progress=progress, **{**overrides, "seed": int(s)}))
    return runs


def add_seed_argument(p: Any, default: str = "3") -> None:
    """The ``--seeds`` flag shared by the reproductions: a count (``3`` → 0,1,2) or a list (``0,4,7``)."""
    p.add_argument("--seeds", default=default,
                   help=f"seeds to run: a count or a comma list (default {default}); tables show mean ± std")
