"""The run store: every file the round loop writes into a run directory, written in one place.

:class:`RunStore` owns ``config.yaml``, ``metrics.jsonl``, ``checkpoint.pt``, ``model_final.pt``,
``model_best_val_loss.pt`` and ``summary.json`` (the names and the table of who writes what are in
:mod:`fedfuse.runfiles`), and gives the output callbacks and the Flower app the paths of theirs.  A run without
an output directory has a store that writes nothing (:attr:`RunStore.enabled` is False), so the loop never asks
whether it has one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from fedfuse.configfile import AsDict, dump_yaml
from fedfuse.engine.checkpoint import checkpoint_round, load_checkpoint, save_checkpoint
from fedfuse.runfiles import CHECKPOINT, CONFIG, DIVERGED, METRICS, MODEL_BEST_VAL_LOSS, MODEL_FINAL, SUMMARY
from fedfuse.types import TensorDict

#: which global model :meth:`RunStore.save_model` writes, by the name the run knows it by
MODELS = {"final": MODEL_FINAL, "best_val_loss": MODEL_BEST_VAL_LOSS}


class RunStore:
    """The files of the run directory ``out`` (None: a run that writes nothing)."""

    def __init__(self, out: str | Path | None) -> None:
        self.dir = Path(out) if out else None

    @property
    def enabled(self) -> bool:
        """Whether the run has a directory to write into."""
        return self.dir is not None

    def path(self, name: str) -> Path:
        """Where the run's file ``name`` (a :mod:`fedfuse.runfiles` name) is; only for a store with a directory."""
        if self.dir is None:
            raise ValueError(f"{name}: this run has no output directory (out is not set)")
        return self.dir / name

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self, cfg: AsDict) -> None:
        """A fresh run: create the directory, write ``config.yaml`` and an empty ``metrics.jsonl``."""
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.write_config(cfg)
        self.path(METRICS).write_text("")
        self.clear_diverged()

    def write_config(self, cfg: AsDict) -> None:
        """``config.yaml``: every key of ``cfg``, in field order."""
        if self.dir is not None:
            dump_yaml(cfg, self.path(CONFIG))

    # ---- metrics ---------------------------------------------------------------------------------------------
    def append_metrics(self, record: dict[str, Any]) -> None:
        """Add one round's record to ``metrics.jsonl``."""
        if self.dir is not None:
            with open(self.path(METRICS), "a") as f:
                f.write(json.dumps(record) + "\n")

    def rewrite_metrics(self, history: Iterable[dict[str, Any]]) -> None:
        """``metrics.jsonl`` holding exactly ``history`` (a resume drops records written after its checkpoint)."""
        if self.dir is not None:
            self.path(METRICS).write_text("".join(json.dumps(rec) + "\n" for rec in history))

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def save_checkpoint(self, record: dict[str, Any]) -> None:
        """Write ``checkpoint.pt`` atomically (:func:`fedfuse.engine.checkpoint.save_checkpoint`)."""
        if self.dir is not None:
            save_checkpoint(self.path(CHECKPOINT), record)

    def load_checkpoint(self, device: torch.device | str = "cpu") -> dict[str, Any]:
        """The run's checkpoint, read safely and checked (:func:`fedfuse.engine.checkpoint.load_checkpoint`)."""
        return load_checkpoint(self.path(CHECKPOINT), device)

    def checkpoint_round(self) -> int | None:
        """How many rounds the run's checkpoint has done (None without a checkpoint or a directory)."""
        return checkpoint_round(self.path(CHECKPOINT)) if self.dir is not None else None

    # ---- models and the summary ------------------------------------------------------------------------------
    def save_model(self, which: str, state: TensorDict, meta: dict[str, Any], round_: int) -> None:
        """The global model ``which`` (``final`` or ``best_val_loss``, :data:`MODELS`) after round ``round_``."""
        if self.dir is not None:
            torch.save({"state": state, "meta": meta, "round": round_}, self.path(MODELS[which]))

    def write_summary(self, summary: dict[str, Any]) -> None:
        """``summary.json``."""
        if self.dir is not None:
            self.path(SUMMARY).write_text(json.dumps(summary, indent=2))

    def mark_diverged(self, round_: int, why: str, lr: float) -> None:
        """``diverged.json``: the run stopped in round ``round_`` (1-based) because of ``why``."""
        if self.dir is not None:
            self.path(DIVERGED).write_text(json.dumps({"round": round_, "why": why, "lr": lr}))

    def clear_diverged(self) -> None:
        """A resumed run goes on: whatever stopped an earlier attempt is no longer its outcome."""
        if self.dir is not None:
            self.path(DIVERGED).unlink(missing_ok=True)

    def write_json(self, name: str, obj: Any) -> None:
        """Another JSON file of the run (``partition.json``, ``flower_calls.json``: :data:`fedfuse.runfiles.FILES`
        names its writer)."""
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.path(name).write_text(json.dumps(obj))

    def read_metrics(self) -> list[dict[str, Any]]:
        """The records in ``metrics.jsonl`` ([] without it)."""
        if self.dir is None or not self.path(METRICS).is_file():
            return []
        return [json.loads(line) for line in self.path(METRICS).read_text().splitlines() if line.strip()]
