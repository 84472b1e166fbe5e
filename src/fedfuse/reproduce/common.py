"""Helpers shared by the reproductions: one federation per data setting, the ``--seeds`` flag."""

from __future__ import annotations

import json
from typing import Any

from fedfuse.config import RunConfig, resolve_device
from fedfuse.engine.assemble import build_federation
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


def add_seed_argument(p: Any, default: str = "3", quick: str = "1") -> None:
    """The ``--seeds`` flag shared by the reproductions: a count (``3`` → 0,1,2) or a list (``0,4,7``); empty
    means the preset's own (``default``, with ``--quick`` ``quick``), see :func:`seeds`."""
    p.add_argument("--seeds", default="",
                   help=f"seeds to run: a count or a comma list (default {default}; --quick: {quick}); tables show "
                        "mean ± std")
    p.set_defaults(preset_seeds=(default, quick))


def seeds(args: Any) -> list[int]:
    """The seeds of an invocation: ``--seeds``, else the preset's default for ``--quick`` or the full run."""
    from fedfuse.stats import parse_seeds

    default, quick = getattr(args, "preset_seeds", ("3", "1"))
    return parse_seeds(args.seeds or (quick if getattr(args, "quick", False) else default))


def data_root(args: Any) -> str:
    """``--data-dir``, else ``$FEDFUSE_DATA``, else ``../shared/data``."""
    import os

    return args.data_dir or os.environ.get("FEDFUSE_DATA") or "../shared/data"
