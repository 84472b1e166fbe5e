"""How the command line reports failures: one line naming the culprit, never a Python traceback.

Exit codes: 0 success; 1 a run that failed (divergence, an unexpected internal error, an I/O failure of the
machine); 2 a usage error (bad option, file or directory); 130 interrupted.  A closed output pipe ends quietly with 0.
Set ``FEDFUSE_DEBUG=1`` to get the traceback of an internal error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class UserError(ValueError):
    """A mistake in what the user asked for (a bad option, value, file or combination): the message says what
    and how to fix it; the command line prints it as one line and exits with 2.  :class:`fedfuse.config.ConfigError`
    and :class:`fedfuse.data.dataset.DatasetNotFoundError` are user errors."""


class DivergenceError(RuntimeError):
    """A run whose loss or model became non-finite; the message says at which round and what was kept."""


USAGE = 2
FAILED = 1


def _say(msg: str) -> None:
    print(f"fedfuse: error: {msg}", file=sys.stderr)


def run_guarded(fn: Callable[[], int]) -> int:
    """Run a command; turn every expected failure into one ``fedfuse: error: ...`` line and an exit code."""
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
    except ValueError as e:  # bad values found by loaders, partitioners and models
        _say(str(e))
        return USAGE
    except OSError as e:  # disk full, device errors: the machine, not the user's input
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        _say(f"{where}{e.strerror or e}")
        return FAILED
    except Exception as e:
        if os.environ.get("FEDFUSE_DEBUG", "") not in ("", "0"):
            raise
        _say(f"internal error {type(e).__name__}: {e} (set FEDFUSE_DEBUG=1 for the traceback; please report it)")
        return FAILED
