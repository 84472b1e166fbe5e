"""Typed values from what a user writes (YAML, ``--set`` text, a config file): a value checked and converted
to a declared type, with errors that name the key (:class:`fedfuse.errors.ConfigError`)."""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from types import UnionType
from typing import Any

import yaml

from fedfuse.errors import ConfigError


def parse_threads(value: object) -> int | str:
    """A ``threads`` setting: ``"auto"`` or a non-negative integer (0 = PyTorch's own default); raises
    ``ValueError`` otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool):
        raise ValueError(f"expected auto or a non-negative integer, got {value!r}")
    try:
        n = int(str(value).strip())
    except ValueError:
        raise ValueError(f"expected auto or a non-negative integer, got {value!r}") from None
    if n < 0:
        raise ValueError(f"expected auto or a non-negative integer, got {value!r}")
    return n


def parse_value(text: str) -> Any:
    """YAML scalar/list parsing for ``--set`` values (``0.1`` → float, ``[6,5,8]`` → list, ``none`` → None)."""
    if text.strip().lower() in ("none", "null"):
        return None
    return yaml.safe_load(text)


def _unwrap_optional(typ: Any) -> tuple[Any, bool]:
    """``(T, True)`` for ``T | None`` (``Optional[T]``), else ``(typ, False)``."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) in (typing.Union, UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return typ, False


def _coerce_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{key}: expected true/false, got {value!r}")


def _coerce_int(key: str, value: Any) -> int:
    """An int, or a string/float holding a whole finite number; never a bool."""
    if isinstance(value, bool) or not isinstance(value, int | str | float):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    try:
        f = float(value)
    except ValueError:
        raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if not math.isfinite(f) or not f.is_integer():
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    return int(f)


def _coerce_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None


def _coerce_str(key: str, value: Any) -> str:
    if isinstance(value, dict | list | tuple):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return str(value)


def _coerce_list(key: str, value: Any, elem: Any) -> list[Any]:
    """A list, each element coerced to ``elem`` (naming ``key[i]``) unless ``elem`` is None or Any."""
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{key}: expected a list, got {value!r}")
    if elem is None or elem is Any:
        return list(value)
    return [coerce(f"{key}[{i}]", v, elem) for i, v in enumerate(value)]


def _coerce_dict(key: str, value: Any) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    return dict(value)


_SCALAR_COERCIONS: dict[type, Callable[[str, Any], Any]] = {
    bool: _coerce_bool, int: _coerce_int, float: _coerce_float, str: _coerce_str}


def coerce(key: str, value: Any, typ: Any) -> Any:
    """``value`` converted to ``typ`` (bool, int, float, str, list[...], dict, optional); errors name ``key``."""
    typ, optional = _unwrap_optional(typ)
    if optional and value is None:
        return None
    if typ in _SCALAR_COERCIONS:
        return _SCALAR_COERCIONS[typ](key, value)
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (list, tuple) or typ in (list, tuple):
        return _coerce_list(key, value, args[0] if args else None)
    if origin is dict or typ is dict:
        return _coerce_dict(key, value)
    return value


def coerce_option(key: str, value: Any, default: Any, hint: Any = None) -> Any:
    """Coerce an option value to its declared type (``hint``), else to the type of its default.

    List elements are checked too (``widths=[a]`` names ``widths[0]``)."""
    if value is None:
        return value
    if hint is not None and hint is not Any:
        return coerce(key, value, hint)
    if default is None:
        return value
    if isinstance(default, bool):
        return coerce(key, value, bool)
    if isinstance(default, int):
        return coerce(key, value, int)
    if isinstance(default, float):
        return coerce(key, value, float)
    if isinstance(default, str):
        return coerce(key, value, str)
    if isinstance(default, list | tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        kinds = {type(d) for d in default if d is not None}
        if len(kinds) == 1:
            kind = kinds.pop()
            if kind in (bool, int, float, str):
                return [coerce(f"{key}[{i}]", v, kind) for i, v in enumerate(value)]
        return list(value)
    return value


def plain(value: Any) -> Any:
    """Tuples become lists so the resolved config round-trips through YAML."""
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    return value
