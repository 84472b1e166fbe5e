"""Run configuration: one flat dataclass plus four option namespaces, validated with helpful errors.

Resolution order: defaults → ``--config FILE.yaml`` → explicit CLI flags → ``--set key=value``.
``--set`` accepts a top-level field (``rounds=50``), a namespaced option (``algorithm_options.mu=0.1``) or
a bare option name that belongs to exactly one namespace (``mu=0.1``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

NAMESPACES = ("algorithm_options", "model_options", "partition_options", "dataset_options")


class ConfigError(ValueError):
    """A bad key or value in a run configuration; the message names it and the valid choices."""


@dataclass
class RunConfig:
    algorithm: str = "fedavg"
    dataset: str = "digits"
    partition: str = "dirichlet"
    model: str = "auto"  # "auto" = the dataset's default model
    clients: int = 10
    clients_per_round: int = 5
    rounds: int = 20
    local_epochs: int = 2
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    optimizer: str = "sgd"
    grad_clip: float = 0.0
    seed: int = 0
    data_dir: str | None = None
    out: str | None = None
    device: str = "auto"
    executor: str = "sequential"  # how clients run: sequential | batched | processes | auto (engine/executor.py)
    threads: int = 0  # torch intra-op threads; 0 = PyTorch's default (1 is often faster for small models)
    val_fraction: float = 0.1
    eval_every: int = 1
    checkpoint_every: int = 1
    eval_batch_size: int = 512
    plots: bool = True
    sampling: str = "auto"  # client sampling policy (fedfuse.engine.sampling): auto = the algorithm's default
    algorithm_options: dict[str, Any] = field(default_factory=dict)
    model_options: dict[str, Any] = field(default_factory=dict)
    partition_options: dict[str, Any] = field(default_factory=dict)
    dataset_options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CHOICES: dict[str, tuple[str, ...]] = {
    "optimizer": ("sgd", "adam"),
    "executor": ("sequential", "batched", "processes", "auto"),
    "sampling": ("auto", "uniform", "size-weighted", "clustered", "clustered-size"),
}
POSITIVE = {"clients", "clients_per_round", "rounds", "local_epochs", "batch_size", "eval_every",
            "checkpoint_every", "eval_batch_size"}


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(RunConfig)


def _registry_choices(key: str) -> tuple[str, ...]:
    if key == "algorithm":
        from fedfuse.algorithms import ALGORITHMS

        return tuple(sorted(ALGORITHMS))
    if key == "dataset":
        from fedfuse.data.datasets import DATASETS

        return tuple(sorted(DATASETS))
    if key == "partition":
        from fedfuse.data.partition import PARTITIONS

        return tuple(sorted(PARTITIONS))
    if key == "model":
        from fedfuse.models import MODELS

        return ("auto", *sorted(MODELS))
    return CHOICES.get(key, ())


def namespace_defaults(cfg: RunConfig, namespace: str) -> dict[str, Any]:
    """Valid option names (with defaults) of the chosen algorithm/model/partition/dataset."""
    if namespace == "algorithm_options":
        from fedfuse.algorithms import get_algorithm

        return get_algorithm(cfg.algorithm).option_defaults()
    if namespace == "model_options":
        from fedfuse.models import model_options

        return model_options(resolved_model(cfg))
    if namespace == "partition_options":
        from fedfuse.data.partition import partition_options

        return partition_options(cfg.partition)
    if namespace == "dataset_options":
        from fedfuse.data.datasets import dataset_options

        return dataset_options(cfg.dataset)
    raise ConfigError(f"unknown namespace {namespace!r}")


def resolved_model(cfg: RunConfig) -> str:
    if cfg.model != "auto":
        return cfg.model
    from fedfuse.models import default_model

    return default_model(cfg.dataset)


def parse_value(text: str) -> Any:
    """YAML scalar/list parsing for ``--set`` values (``0.1`` → float, ``[6,5,8]`` → list, ``none`` → None)."""
    if text.strip().lower() in ("none", "null"):
        return None
    return yaml.safe_load(text)


def _coerce(key: str, value: Any, typ: Any) -> Any:
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and type(None) in args:
        if value is None:
            return None
        typ = next(a for a in args if a is not type(None))
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int | str | float):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            f = float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if not f.is_integer():
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(f)
    if typ is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if typ is str:
        return str(value)
    if typing.get_origin(typ) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    return value


def _coerce_option(key: str, value: Any, default: Any) -> Any:
    """Coerce an option value to the type of its default (when the default has a simple type)."""
    if default is None or value is None:
        return value
    if isinstance(default, bool):
        return _coerce(key, value, bool)
    if isinstance(default, int):
        return _coerce(key, value, int)
    if isinstance(default, float):
        return _coerce(key, value, float)
    if isinstance(default, str):
        return _coerce(key, value, str)
    if isinstance(default, list | tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return list(value)
    return value


def apply(cfg: RunConfig, updates: dict[str, Any]) -> RunConfig:
    """Apply ``updates`` (top-level keys, ``ns.key`` or bare option names) with type checking."""
    types = _field_types()
    values = cfg.to_dict()
    pending: list[tuple[str, Any]] = []
    for key, value in updates.items():
        if key in types:
            if key in NAMESPACES:
                if not isinstance(value, dict):
                    raise ConfigError(f"{key}: expected a mapping of option: value, got {value!r}")
                for k, v in value.items():
                    pending.append((f"{key}.{k}", v))
                continue
            values[key] = _coerce(key, value, types[key])
        else:
            pending.append((key, value))
    cfg = RunConfig(**values)
    for key, value in pending:
        cfg = _apply_option(cfg, key, value)
    return cfg


def _apply_option(cfg: RunConfig, key: str, value: Any) -> RunConfig:
    if "." in key:
        ns, name = key.split(".", 1)
        if ns not in NAMESPACES:
            raise ConfigError(f"unknown key {key!r}; namespaces are {', '.join(NAMESPACES)}")
        defaults = namespace_defaults(cfg, ns)
        if name not in defaults:
            what = ns.replace("_options", "")
            raise ConfigError(
                f"unknown option {name!r} for {what} {getattr(cfg, what)!r}; valid options: "
                f"{', '.join(sorted(defaults)) or '(none)'}"
            )
        getattr(cfg, ns)[name] = _coerce_option(key, value, defaults[name])
        return cfg
    owners = [ns for ns in NAMESPACES if key in namespace_defaults(cfg, ns)]
    if len(owners) == 1:
        return _apply_option(cfg, f"{owners[0]}.{key}", value)
    if len(owners) > 1:
        raise ConfigError(f"option {key!r} is ambiguous: say one of {', '.join(f'{o}.{key}' for o in owners)}")
    valid = sorted(_field_types())
    for ns in NAMESPACES:
        valid += [f"{ns}.{k}" for k in sorted(namespace_defaults(cfg, ns))]
    raise ConfigError(f"unknown key {key!r}; valid keys: {', '.join(valid)}")


def validate(cfg: RunConfig) -> RunConfig:
    """Check choices and ranges; return the config with ``model`` resolved.  Raises :class:`ConfigError`."""
    for key in ("algorithm", "dataset", "partition", "model", "optimizer", "executor", "sampling"):
        choices = _registry_choices(key)
        if getattr(cfg, key) not in choices:
            raise ConfigError(f"{key}: unknown value {getattr(cfg, key)!r}; choose one of: {', '.join(choices)}")
    for key in POSITIVE:
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key}: must be >= 1, got {getattr(cfg, key)}")
    if cfg.clients_per_round > cfg.clients:
        raise ConfigError(
            f"clients_per_round: {cfg.clients_per_round} exceeds clients ({cfg.clients}); choose 1..{cfg.clients}"
        )
    if cfg.threads < 0:
        raise ConfigError(f"threads: must be >= 0 (0 = PyTorch default), got {cfg.threads}")
    if cfg.lr <= 0:
        raise ConfigError(f"lr: must be > 0, got {cfg.lr}")
    if not 0 <= cfg.val_fraction < 1:
        raise ConfigError(f"val_fraction: must be in [0, 1), got {cfg.val_fraction}")
    if cfg.device not in ("auto", "cpu") and not cfg.device.startswith(("cuda", "mps")):
        raise ConfigError(f"device: unknown value {cfg.device!r}; choose auto, cpu, cuda or cuda:N")
    cfg = dataclasses.replace(cfg, model=resolved_model(cfg))
    resolved: dict[str, dict[str, Any]] = {}
    for ns in NAMESPACES:
        defaults = namespace_defaults(cfg, ns)
        given = getattr(cfg, ns)
        for k in given:
            if k not in defaults:
                what = ns.replace("_options", "")
                raise ConfigError(
                    f"unknown option {k!r} for {what} {getattr(cfg, what)!r}; valid options: "
                    f"{', '.join(sorted(defaults)) or '(none)'}"
                )
        resolved[ns] = {k: _plain(v) for k, v in {**defaults, **given}.items()}
    return dataclasses.replace(cfg, **resolved)


def _plain(value: Any) -> Any:
    """Tuples become lists so the resolved config round-trips through YAML."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def load_yaml(path: str | Path) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at top level")
    return data


def dump_yaml(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def resolve_device(name: str) -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
