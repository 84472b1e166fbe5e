"""The run configuration in sections: the settings the engine consumes, grouped by what they govern.

:class:`fedfuse.config.RunConfig` keeps the flat keys users write (``lr: 0.05`` in YAML, ``--lr`` on the command
line), its YAML and its config hash; its properties ``training``, ``faults``, ``privacy`` and ``runtime`` give
these sections, built from the flat keys each time (a section is a value: change the run config, not a section).

- :class:`TrainConfig` (``cfg.training``): the local optimisation of a client step — the type the client
  training code, algorithms and executors take;
- :class:`FaultSettings` (``cfg.faults``): injected faults and the server's defences against bad replies;
- :class:`PrivacySettings` (``cfg.privacy``): differential privacy (:class:`DPOptions`) and secure aggregation
  (:class:`SecAggOptions`);
- :class:`RuntimeSettings` (``cfg.runtime``): where and how fast the run computes, which never changes a number
  of a non-private run (device, executor, precision, threads).

Every other key says what the run is (algorithm, data, model, clients, rounds, seed, evaluation cadence, outputs).
:data:`SECTIONS` maps every sectioned flat key to its section; ``tests/test_sections.py`` checks that each key of
``RunConfig`` is in one section or named in :data:`UNSECTIONED`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from fedfuse.errors import UserError


@dataclass(frozen=True)
class TrainConfig:
    """The local optimisation of one client step (one fresh optimiser per step, as in the seed papers' code):
    the run's settings (``RunContext.train``) and what a declared client program trains with."""

    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    optimizer: str = "sgd"  # "sgd" | "adam"
    grad_clip: float = 0.0  # 0 = off; otherwise the max global L2 norm of the gradient
    max_steps: int = 0  # 0 = no cap; otherwise stop after this many optimiser steps
    two_pass: str = ""  # "" | "sam" | "asam": sharpness-aware two-pass steps (fedfuse.engine.sam)
    sam_rho: float = 0.0  # SAM/ASAM radius ρ
    sam_eta: float = 0.01  # ASAM's T_w = |w| + η

    def replace(self, **changes: Any) -> TrainConfig:
        """These settings with ``changes`` (e.g. an algorithm's own learning rate or epochs)."""
        return dataclasses.replace(self, **changes)

    def with_two_pass(self, kind: str, rho: float, eta: float = 0.01) -> TrainConfig:
        """These settings with SAM (``kind="sam"``) or ASAM (``"asam"``) two-pass steps of radius ``rho``."""
        if kind not in ("sam", "asam"):
            raise UserError(f"two_pass must be 'sam' or 'asam', not {kind!r}")
        return dataclasses.replace(self, two_pass=kind, sam_rho=float(rho), sam_eta=float(eta))

    def schedule(self, n: int) -> list[int]:
        """The batch size of every optimiser step on ``n`` samples, in order (what ``train_local`` does)."""
        if n == 0:
            return []
        bs = min(self.batch_size, n)
        per_epoch = [min(bs, n - s) for s in range(0, n, bs)]
        steps = per_epoch * self.local_epochs
        return steps[: self.max_steps] if self.max_steps else steps


@dataclass(frozen=True)
class FaultSettings:
    """Injected faults (dropouts, stragglers, corrupted replies: ``engine/faults.py``) and the server's defences
    (quorum, update checks, what a divergence does; docs/reliability.md)."""

    dropout: float = 0.0
    stragglers: float = 0.0
    deadline: float = 2.0
    late_replies: str = "drop"
    quorum: int = 1
    check_updates: bool = True
    norm_bound: float = 100.0
    norm_max: float = 100.0
    on_divergence: str = "stop"
    corrupt: str = "none"
    corrupt_clients: tuple[int, ...] = ()


@dataclass(frozen=True)
class DPOptions:
    """Differential privacy's keys (``dp`` and ``dp_*``), named as :class:`fedfuse.privacy.dp.DPSettings` names
    them (``DPSettings(**dataclasses.asdict(options))``)."""

    mode: str = "none"
    noise: float = 1.0
    clip: float = 1.0
    quantile: float = 0.0
    clip_lr: float = 0.2
    count_noise: float = 0.0
    delta: float = 1e-5
    accountant: str = "rdp"
    reproducible: bool = False
    debug_metrics: bool = False


@dataclass(frozen=True)
class SecAggOptions:
    """Secure aggregation's keys (``secagg`` and ``secagg_*``)."""

    enabled: bool = False
    threshold: float = 0.5
    min_clients: int = 3
    max_weight: int = 0
    neighbors: int = 0
    frac_bits: int = 24


@dataclass(frozen=True)
class PrivacySettings:
    """The run's privacy mechanisms (docs/privacy.md)."""

    dp: DPOptions = DPOptions()
    secagg: SecAggOptions = SecAggOptions()


@dataclass(frozen=True)
class RuntimeSettings:
    """Where and how fast the run computes (docs/engine.md)."""

    device: str = "auto"
    executor: str = "sequential"
    precision: str = "fp32"
    memory_format: str = "auto"
    fp32_matmul: str = "ieee"
    threads: str | int = "auto"


#: section -> (its type, {the section's field: the flat RunConfig key}); a nested section maps to its parts
_TRAINING = {f.name: f.name for f in fields(TrainConfig) if f.name not in ("max_steps", "two_pass", "sam_rho",
                                                                           "sam_eta")}
_FAULTS = {f.name: f.name for f in fields(FaultSettings)}
_DP = {"mode": "dp", **{f.name: f"dp_{f.name}" for f in fields(DPOptions) if f.name != "mode"}}
_SECAGG = {"enabled": "secagg", **{f.name: f"secagg_{f.name}" for f in fields(SecAggOptions) if f.name != "enabled"}}
_RUNTIME = {f.name: f.name for f in fields(RuntimeSettings)}

#: every sectioned flat key -> ``section`` or ``section.part``
SECTIONS: dict[str, str] = {
    **{k: "training" for k in _TRAINING.values()},
    **{k: "faults" for k in _FAULTS.values()},
    **{k: "privacy.dp" for k in _DP.values()},
    **{k: "privacy.secagg" for k in _SECAGG.values()},
    **{k: "runtime" for k in _RUNTIME.values()},
}
#: the keys that say what the run is rather than how one part of it runs: in no section
UNSECTIONED = ("algorithm", "dataset", "partition", "model", "clients", "clients_per_round", "rounds", "seed",
               "data_dir", "out", "val_fraction", "eval_every", "global_eval", "checkpoint_every", "eval_batch_size",
               "plots", "sampling", "algorithm_options", "model_options", "partition_options", "dataset_options")


def _pick(cls: type, keys: dict[str, str], flat: Any) -> Any:
    return cls(**{name: getattr(flat, key) for name, key in keys.items()})


def training(flat: Any) -> TrainConfig:
    """The :class:`TrainConfig` of a run config ``flat``."""
    return _pick(TrainConfig, _TRAINING, flat)


def faults(flat: Any) -> FaultSettings:
    """The :class:`FaultSettings` of a run config ``flat``."""
    s = _pick(FaultSettings, _FAULTS, flat)
    return dataclasses.replace(s, corrupt_clients=tuple(int(c) for c in s.corrupt_clients))


def privacy(flat: Any) -> PrivacySettings:
    """The :class:`PrivacySettings` of a run config ``flat``."""
    return PrivacySettings(_pick(DPOptions, _DP, flat), _pick(SecAggOptions, _SECAGG, flat))


def runtime(flat: Any) -> RuntimeSettings:
    """The :class:`RuntimeSettings` of a run config ``flat``."""
    return _pick(RuntimeSettings, _RUNTIME, flat)
