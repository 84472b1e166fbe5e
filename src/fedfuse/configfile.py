"""A run configuration as a YAML file: reading a user's ``--config`` file, writing a run's ``config.yaml``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import yaml

from fedfuse.errors import ConfigError


class AsDict(Protocol):
    """What :func:`dump_yaml` writes: a configuration that gives its fields as a plain mapping."""

    def to_dict(self) -> dict[str, Any]: ...


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file; a missing, unreadable or malformed file is a :class:`ConfigError`."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--config {path}: no such file")
    if path.is_dir():
        raise ConfigError(f"--config {path}: is a directory, expected a YAML file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: cannot read it ({e})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path}: invalid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of key: value at top level, got {type(data).__name__}")
    return data


def config_file(path: str | Path) -> dict[str, Any]:
    """The keys of a ``--config`` YAML file.  A run's own ``config.yaml`` names the run's directory as ``out``;
    that entry is dropped, so re-running the file starts a new run in a new directory (``--out`` chooses it)
    instead of colliding with the run it came from."""
    data = load_yaml(path)
    out = data.get("out")
    if isinstance(out, str) and Path(out).resolve() == Path(path).resolve().parent:
        data = {k: v for k, v in data.items() if k != "out"}
    return data


def dump_yaml(cfg: AsDict, path: str | Path) -> None:
    """Write a run configuration (:class:`fedfuse.config.RunConfig`) as YAML, keys in field order."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
