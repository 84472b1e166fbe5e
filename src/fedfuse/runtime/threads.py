"""CPU threads that do not fight: a passive OpenMP wait policy and ``threads = auto``.

PyTorch's CPU kernels run on OpenMP.  With OpenMP's default wait policy an idle worker thread spins for a while
before it sleeps, so on a machine whose cores are busy with other work two torch threads spin against each other
and against the other processes (measured in ``docs/engine.md``: a small run many times slower with two threads
than with one).  fedfuse therefore

- sets ``OMP_WAIT_POLICY=PASSIVE`` in its own environment when ``fedfuse`` is imported (OpenMP reads it once,
  when torch loads it, so this holds for the command line and for programs that import fedfuse before torch)
  unless the user has set it, and every worker process it starts inherits it;
- resolves ``threads = "auto"`` (the default) to ``$FEDFUSE_THREADS`` when that is set, else to a count that
  helps on a busy machine: ``min(physical cores, cores left idle by the 1-minute load average)``, at least 1.

The load-based count can differ between two runs of one command, and float sums (hence, through discrete steps
such as FedMA's matching, whole results) depend on the thread count.  Bit-identical re-runs therefore need a fixed
count: ``--threads N``, or ``FEDFUSE_THREADS=N`` for every run a shell or a test session starts.  The count a run
used is in its accounting (``threads``).
"""

from __future__ import annotations

import math
import os

from fedfuse.config import parse_threads
from fedfuse.errors import ConfigError

#: the wait policy fedfuse asks OpenMP for unless ``OMP_WAIT_POLICY`` is already set
WAIT_POLICY = "PASSIVE"
#: the environment variable that fixes what ``threads = auto`` resolves to (a count, or ``auto`` for the load rule)
THREADS_ENV = "FEDFUSE_THREADS"


def set_passive_wait_policy() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` in this process's environment unless the user set the variable.

    Effective in this process only when called before torch is imported; child processes inherit it.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)


def usable_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity mask; every CPU where that is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int] | None = None) -> int:
    """Physical cores among ``cpus`` (hyper-threads of one core counted once), from ``/proc/cpuinfo``."""
    cpus = usable_cpus() if cpus is None else cpus
    try:
        with open("/proc/cpuinfo") as f:
            blocks = f.read().strip().split("\n\n")
    except OSError:
        return max(1, len(cpus))
    cores = set()
    wanted = set(cpus)
    for block in blocks:
        info = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        if "processor" not in info or int(info["processor"]) not in wanted:
            continue
        cores.add((info.get("physical id", "0"), info.get("core id", info["processor"])))
    return max(1, len(cores)) if cores else max(1, len(cpus))


def idle_cores(load: float | None = None, cpus: int | None = None) -> int:
    """Logical CPUs not taken by the 1-minute load average (at least 1)."""
    cpus = len(usable_cpus()) if cpus is None else cpus
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # pragma: no cover - no load average on this platform
            load = 0.0
    return max(1, cpus - math.ceil(load - 0.5))


def auto_threads(load: float | None = None, cpus: int | None = None, cores: int | None = None) -> int:
    """``threads = auto``: ``min(physical cores, idle cores)``, at least 1 (1 on a loaded machine)."""
    cores = physical_cores() if cores is None else cores
    return max(1, min(cores, idle_cores(load, cpus)))


def pinned_threads() -> int | str | None:
    """``$FEDFUSE_THREADS`` parsed (a count or ``"auto"``), None when unset or empty."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    try:
        return parse_threads(raw)
    except ValueError as e:
        raise ConfigError(f"{THREADS_ENV}={raw!r}: {e}") from None


def resolve_threads(value: object) -> int:
    """The torch thread count of a ``threads`` setting (0 = leave PyTorch's default); ``auto`` is
    ``$FEDFUSE_THREADS`` when set, else the load rule of :func:`auto_threads`."""
    parsed = parse_threads(value)
    if parsed == "auto":
        pinned = pinned_threads()
        parsed = pinned if pinned is not None else "auto"
    return auto_threads() if parsed == "auto" else int(parsed)


def worker_threads(value: object) -> int:
    """Torch threads per worker process: the explicit count, else 1 (the workers already fill the cores)."""
    parsed = parse_threads(value)
    return 1 if parsed in ("auto", 0) else int(parsed)


def apply_threads(value: object) -> int:
    """Set this process's torch threads from a ``threads`` setting; returns the count in effect."""
    import torch

    n = resolve_threads(value)
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()
