"""What the round loop tells every algorithm hook: where it is (:class:`RoundInfo`) and the run's static
facts (:class:`RunContext`).  These live in the engine layer so the engine needs nothing from
``fedfuse.algorithms``; ``fedfuse.algorithms.base`` re-exports them for algorithm authors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfuse.engine.client import TrainConfig
from fedfuse.errors import UserError
from fedfuse.privacy.dp import DPSettings
from fedfuse.rng import derive_seed
from fedfuse.types import TensorDict

ClientState = dict[str, Any] | None
ServerState = dict[str, Any]


@dataclass(frozen=True)
class RoundInfo:
    """Where the loop is: 0-based round index, stage within the round, and the planned total."""

    index: int
    total: int
    stage: int = 0


@dataclass
class RunContext:
    """Static facts every hook may read: how to build the model, local training settings, client sizes.

    Holds no data, no mutable server state and no ground truth (a partition's true clusters reach only
    ``diagnostics`` / ``finish``, through the Federation they are handed).  ``model(meta)`` returns a module for
    the architecture a payload describes (``meta["model_options"]`` may override widths, e.g. FedMA's grown
    layers); modules are cached per architecture so loading a payload costs a ``load_state_dict``, not a rebuild.
    """

    model_name: str
    model_options: dict[str, Any]
    input_shape: tuple[int, ...]
    num_classes: int
    task: str
    train: TrainConfig
    num_clients: int
    clients_per_round: int
    client_sizes: np.ndarray
    seed: int
    device: torch.device
    eval_batch_size: int = 512
    out_dir: Path | None = None  # where the run writes (diagnostic plots); None when not writing
    eval_every: int = 1  # the loop evaluates every this many rounds (and at the last round)
    dp: DPSettings = field(default_factory=DPSettings)  # the run's differential privacy (privacy/dp.py)
    secagg: bool = False  # the run's server update is computed by secure aggregation (privacy/secure.py)
    _cache: dict[str, nn.Module] = field(default_factory=dict, repr=False)

    def build(self, overrides: Mapping[str, Any] | None = None) -> nn.Module:
        """A freshly initialised model (uses the global torch RNG: seed it first)."""
        from fedfuse.models import build_model

        opts = {**self.model_options, **(overrides or {})}
        return build_model(self.model_name, self.input_shape, self.num_classes, task=self.task, **opts).to(
            self.device
        )

    def model(self, meta: Mapping[str, Any] | None = None) -> nn.Module:
        """A cached module of the architecture named by ``meta.get("model_options")``."""
        overrides = (meta or {}).get("model_options") or {}
        key = json.dumps(overrides, sort_keys=True, default=str)
        if key not in self._cache:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                self._cache[key] = self.build(overrides)
        return self._cache[key]

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None = None) -> nn.Module:
        """The cached module with ``tensors`` loaded (strict: every state entry must be present)."""
        m = self.model(meta)
        m.load_state_dict(tensors, strict=True)
        return m

    def param_keys(self, meta: Mapping[str, Any] | None = None) -> set[str]:
        return {k for k, _ in self.model(meta).named_parameters()}


def state_of(model: nn.Module) -> TensorDict:
    """A detached copy of the full state (parameters and buffers)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def seeded_state(ctx: RunContext, seed: int) -> TensorDict:
    """A freshly initialised full model state from ``seed`` (the global torch RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return state_of(ctx.build())


def init_states(ctx: RunContext, count: int, purpose: str) -> list[TensorDict]:
    """``count`` independently initialised full model states, model ``j`` seeded from ``(seed, purpose, j)``
    (FedMerge, IFCA and FedEM start their several global models this way)."""
    out = []
    for j in range(count):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(ctx.seed, purpose, j))
            out.append(state_of(ctx.build()))
    return out


def client_initial_state(ctx: RunContext, cid: int, init: str, purpose: str = "fedma-init") -> TensorDict:
    """A client's starting model: its own initialisation seeded from ``(seed, purpose, cid)`` (``"distinct"``)
    or the run's shared one (``"shared"``, seeded by the run seed).  The default purpose is the one FedMA, one-shot
    matching and Simple-FedMA have always used, so their runs are unchanged."""
    if init not in ("distinct", "shared"):
        raise UserError(f"init={init!r}; choose distinct or shared")
    return seeded_state(ctx, derive_seed(ctx.seed, purpose, cid) if init == "distinct" else ctx.seed)


def model_params(ctx: RunContext) -> int:
    """Parameters of the configured model."""
    return int(sum(p.numel() for p in ctx.model().parameters()))
