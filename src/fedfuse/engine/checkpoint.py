"""Run checkpoints: ``checkpoint.pt`` in the run directory, written atomically, read back with checks.

A checkpoint holds everything a resumed run needs to continue bit-identically (``engine/loop.py`` builds the
record): the server and client states, the running totals, the best record, the history, the sampler's state,
late replies in flight, the config, the (possibly halved) learning rate and the executor the run used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fedfuse.config import ConfigError

CHECKPOINT = "checkpoint.pt"
#: entries every checkpoint has
REQUIRED = ("round", "state", "client_states", "totals", "best", "history")


def save_checkpoint(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` to ``path`` atomically (a temporary file, then a rename): a kill leaves the old one."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(record, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """A run checkpoint; an empty, truncated or foreign file is a :class:`ConfigError` naming it."""
    if not path.is_file():
        raise ConfigError(f"--resume: {path} does not exist (nothing to resume)")
    if path.stat().st_size == 0:
        raise ConfigError(f"--resume: {path} is empty (the run was stopped while writing it?); start the run "
                          "again with --overwrite")
    try:
        ck = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # truncated zip, wrong pickle, not a torch file at all
        raise ConfigError(f"--resume: {path} is not a readable checkpoint ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else 'corrupt'}); start the run again with --overwrite"
                          ) from None
    if not isinstance(ck, dict) or any(k not in ck for k in REQUIRED):
        raise ConfigError(f"--resume: {path} is not a fedfuse run checkpoint (missing entries)")
    return ck


def checkpoint_round(path: Path) -> int | None:
    """The number of rounds the checkpoint at ``path`` has done (None when there is none)."""
    if not path.is_file():
        return None
    return int(torch.load(path, map_location="cpu", weights_only=False)["round"])
