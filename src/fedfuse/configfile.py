"""A run configuration as a YAML file: reading a user's ``--config`` file, writing a run's ``config.yaml``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import yaml

from fedfuse.errors import ConfigError
from fedfuse.runfiles import RUN_FILES


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



def holds_run(path: str | Path) -> bool:
    """``path`` is a directory holding a run (any of :data:`RUN_FILES`)."""
    return any((Path(path) / f).exists() for f in RUN_FILES)


def config_file(path: str | Path) -> dict[str, Any]:
    """The keys of a ``--config`` YAML file.

    A run's ``config.yaml`` names the run's directory as ``out``.  Re-running the file, or a copy of it anywhere
    (``cp runs/X/config.yaml my.yaml``), starts a new run in a new directory instead of colliding with the run it
    came from: an ``out`` that names the file's own directory or a directory already holding a run
    (:func:`holds_run`) is dropped (:func:`stale_out` says which), so the run's default directory is used and
    ``--out`` chooses another.  An ``out`` naming a fresh directory is kept."""
    data = load_yaml(path)
    if stale_out(data, path) is not None:
        data = {k: v for k, v in data.items() if k != "out"}
    return data


def stale_out(data: dict[str, Any], path: str | Path) -> str | None:
    """The ``out`` of config file ``path`` (its keys ``data``) that :func:`config_file` drops: the file's own
    directory or one holding a run; None when it has none or keeps it."""
    out = data.get("out")
    if not isinstance(out, str) or not out:
        return None
    if Path(out).resolve() == Path(path).resolve().parent or holds_run(out):
        return out
    return None


def dump_yaml(cfg: AsDict, path: str | Path) -> None:
    """Write a run configuration (:class:`fedfuse.config.RunConfig`) as YAML, keys in field order."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
