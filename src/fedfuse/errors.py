"""Which failures are the user's and which are fedfuse's, and how the command line reports each.

- A **user error** (:class:`UserError`: a bad option, value, file, or a model an algorithm cannot work with) is
  raised where the input is checked; the command line prints it as one ``fedfuse: error: ...`` line and exits
  with 2.  So do a missing or unreadable file the user named (``FileNotFoundError``, ``PermissionError``...).
- A run that **failed** for a reason the user can act on — it diverged (:class:`DivergenceError`), or the machine
  failed (disk full) — prints one line and exits with 1.
- Anything else is an **internal error: a bug in fedfuse**.  The command line says so, exits with 1 and keeps the
  traceback: on screen with ``--debug`` (or ``FEDFUSE_DEBUG=1``), and always in the run's log file
  (``fedfuse.log`` in the run directory, when the run has one; :mod:`fedfuse.runner` writes it).

``Ctrl-C`` exits with 130; a closed output pipe ends quietly with 0.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable


class UserError(ValueError):
    """A mistake in what the user asked for (a bad option, value, file or combination): the message says what
    and how to fix it; the command line prints it as one line and exits with 2.  :class:`ConfigError`
    and :class:`fedfuse.data.dataset.DatasetNotFoundError` are user errors."""


class UnsupportedModel(UserError, TypeError):
    """A model that does not declare what an algorithm or operator needs (e.g. ``unit_groups()`` for width
    slicing): the user chose a model the algorithm cannot work with."""


class ConfigError(UserError):
    """A bad key or value in a run configuration; the message names it and the valid choices."""


class UnknownKeyError(ConfigError):
    """A key or option name that the configuration (with its chosen algorithm, model, ...) does not have.

    A sweep over several algorithms applies an option to those that have it and skips the others on this error.
    """


class DivergenceError(RuntimeError):
    """A run whose loss or model became non-finite; the message says at which round and what was kept."""


USAGE = 2
FAILED = 1
BUG = ("internal error (a bug in fedfuse, not in your configuration; please report it with the traceback)")


def _say(msg: str) -> None:
    print(f"fedfuse: error: {msg}", file=sys.stderr)


def debug_requested() -> bool:
    """``FEDFUSE_DEBUG`` is set (the command line's ``--debug`` sets it)."""
    return os.environ.get("FEDFUSE_DEBUG", "") not in ("", "0")


def _where_traceback(e: BaseException) -> str:
    """Where the traceback of ``e`` can be read (the notes :mod:`fedfuse.runner` adds name the run's log)."""
    logs = [n for n in getattr(e, "__notes__", ()) if n.startswith("traceback in ")]
    hint = "rerun with --debug to see the traceback"
    return f"{logs[-1]}; {hint}" if logs else hint


def run_guarded(fn: Callable[[], int]) -> int:
    """Run a command; report a failure as one ``fedfuse: error: ...`` line (a user error: exit 2; a failed run:
    exit 1) or, for a bug in fedfuse, say so, exit 1 and keep the traceback (printed with ``--debug``)."""
    try:
        rc = int(fn())
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler
        return rc
    except BrokenPipeError:  # e.g. `fedfuse list | head -1`: the reader has all it wants
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout replaced (e.g. captured in tests)
            pass
        return 0
    except KeyboardInterrupt:
        print("fedfuse: interrupted", file=sys.stderr)
        return 130
    except UserError as e:
        _say(str(e))
        return USAGE
    except DivergenceError as e:
        _say(str(e))
        return FAILED
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError) as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        _say(f"{where}{e.strerror or e}")
        return USAGE
    except OSError as e:  # disk full, device errors: the machine, not the user's input
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        _say(f"{where}{e.strerror or e}")
        return FAILED
    except Exception as e:
        if debug_requested():
            traceback.print_exc(file=sys.stderr)
        first = str(e).splitlines()[0] if str(e) else ""
        _say(f"{BUG}: {type(e).__name__}: {first} ({_where_traceback(e)})")
        return FAILED
