"""The in-memory forms of the data layer: a loaded :class:`Dataset`, a :class:`Partition` of it, a registry
entry (:class:`DatasetInfo`), and where parsed arrays are cached."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.errors import UserError
from fedfuse.types import Task


class DatasetNotFoundError(UserError, FileNotFoundError):
    """Raised when the canonical files of a dataset are missing; the message says what to put where."""


@dataclass
class Dataset:
    """A loaded dataset, already normalised.

    Classification: ``x`` is float32 (N, C, H, W) for images or (N, F) for features, or int64 (N, L) for
    character sequences; ``y`` is int64 (N,).  Language modelling (``task == "lm"``): ``x`` and ``y`` are
    int64 (N, L) token windows with ``y`` shifted by one.

    ``train_groups`` / ``test_groups`` hold the natural owner of each sample (LEAF writer or role) and
    ``train_domains`` / ``test_domains`` a domain id, when the dataset has them; partitions ``natural``
    and ``domain`` use those.
    """

    name: str
    task: Task
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int  # vocabulary size for LMs
    input_shape: tuple[int, ...]
    val_x: torch.Tensor | None = None
    val_y: torch.Tensor | None = None
    class_names: list[str] | None = None
    train_groups: np.ndarray | None = None
    test_groups: np.ndarray | None = None
    group_names: list[str] | None = None
    train_domains: np.ndarray | None = None
    test_domains: np.ndarray | None = None
    domain_names: list[str] | None = None
    vocab: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def train_labels(self) -> np.ndarray:
        """One label per training sample (for LMs: the first target token), for label-based partitions."""
        y = self.train_y if self.train_y.dim() == 1 else self.train_y[:, 0]
        return y.cpu().numpy()

    @property
    def test_labels(self) -> np.ndarray:
        y = self.test_y if self.test_y.dim() == 1 else self.test_y[:, 0]
        return y.cpu().numpy()


@dataclass
class Partition:
    """Per-client indices into a dataset, plus the ground truth the partition defines."""

    train_indices: list[np.ndarray]
    test_indices: list[np.ndarray] | None = None
    client_groups: list[int] | None = None
    client_classes: list[list[int]] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        return len(self.train_indices)

    def sizes(self) -> np.ndarray:
        """Number of training samples per client."""
        return np.array([len(i) for i in self.train_indices], dtype=np.int64)


@dataclass(frozen=True)
class DatasetInfo:
    """What a dataset is, which files it needs (relative to the data directory) and where to get them."""

    name: str
    description: str
    task: Task
    files: list[str]
    source: str
    alt_files: list[str] = field(default_factory=list)  # other accepted layouts
    options: dict[str, object] = field(default_factory=dict)  # option name -> default
    needs_data_dir: bool = True
    loader: Callable[[Path | None, dict[str, Any]], Dataset] | None = None  # else the family loader of name
    check: Callable[[dict[str, Any]], None] | None = None  # extra option checks


def cache_dir() -> Path:
    """Where parsed arrays are cached: ``$FEDFUSE_CACHE``, else ``~/.cache/fedfuse``."""
    env = os.environ.get("FEDFUSE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedfuse"
