"""The optional extras (``pip install 'fedfuse[EXTRA]'``): which modules each provides, and the one error a
missing one raises.

A feature that needs an extra checks it with :func:`require_extra` *before* any long work (loading data,
pretraining a base, the first round) — the check asks :func:`importlib.util.find_spec`, which imports nothing —
and imports the extra's modules with :func:`import_extra` where it uses them.  Both raise
:class:`MissingExtra`, a :class:`~fedfuse.errors.UserError`: the command line prints one line naming the install
command and exits with 2, e.g.::

    fedfuse: error: fedmerge-lora needs the lora extra (peft is not installed): pip install 'fedfuse[lora]'
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

from fedfuse.errors import UserError

#: extra → the top-level modules it installs that fedfuse imports (pyproject.toml's optional dependencies)
EXTRAS: dict[str, tuple[str, ...]] = {
    "lora": ("peft", "transformers"),
    "flower": ("flwr", "flwr_datasets", "datasets"),
    "dp": ("opacus",),
    "tensorboard": ("tensorboard",),
}
#: optional packages that no extra installs (install them by name)
PACKAGES: tuple[str, ...] = ("mlflow",)


class MissingExtra(UserError, ImportError):
    """An optional extra (or package) a requested feature needs is not installed.  A user error (exit 2) whose
    message ends with the ``pip install`` line; also an :class:`ImportError`, for code that catches those."""


def install_command(extra: str) -> str:
    """``pip install 'fedfuse[EXTRA]'`` for an extra of :data:`EXTRAS`, ``pip install NAME`` for a package of
    :data:`PACKAGES`."""
    if extra in EXTRAS:
        return f"pip install 'fedfuse[{extra}]'"
    if extra in PACKAGES:
        return f"pip install {extra}"
    raise KeyError(f"unknown extra {extra!r}; known: {', '.join([*EXTRAS, *PACKAGES])}")


def _found(module: str) -> bool:
    """``module`` can be imported (checked without importing it).  A module already in ``sys.modules`` counts as
    installed, ``sys.modules[name] = None`` as absent (Python's own marker of a module that must not import)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module with no spec
        return False


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that are not installed (empty when it is complete)."""
    install_command(extra)  # checks the name
    return [m for m in EXTRAS.get(extra, (extra,)) if not _found(m)]


def has_extra(extra: str) -> bool:
    """Every module of ``extra`` is installed."""
    return not missing_modules(extra)


def missing_message(extra: str, what: str, modules: list[str] | None = None) -> str:
    """The one line for a missing ``extra`` needed by ``what`` (e.g. ``"--log tensorboard"``)."""
    modules = missing_modules(extra) if modules is None else modules
    kind = "package" if extra in PACKAGES else f"{extra} extra"
    absent = f" ({', '.join(modules)} {'is' if len(modules) == 1 else 'are'} not installed)" if modules else ""
    return f"{what} needs the {kind}{absent}: {install_command(extra)}"


def require_extra(extra: str, what: str) -> None:
    """Raise :class:`MissingExtra` when ``extra`` is not fully installed; ``what`` names the feature that needs it
    (the message's subject).  Imports nothing, so it is cheap enough to call before any work starts."""
    modules = missing_modules(extra)
    if modules:
        raise MissingExtra(missing_message(extra, what, modules))


def import_extra(module: str, extra: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``, raising :class:`MissingExtra` (for ``extra``, needed by ``what``) when it
    cannot be imported."""
    if module.split(".")[0] == "fedfuse":
        raise ValueError(f"import_extra imports a third-party module, not {module}")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = (e.name or module).split(".")[0]
        raise MissingExtra(missing_message(extra, what, [top])) from e
