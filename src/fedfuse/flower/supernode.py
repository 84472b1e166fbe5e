"""``flower-supernode`` with a shorter idle poll (flwr 1.40-1.41).

A flwr 1.41 SuperNode asks the SuperLink for a message, and when there is none it sleeps **3 s** before asking
again (``time.sleep(3)`` in ``flwr.supernode.start_client_internal``; not configurable); while a ClientApp runs it
checks for the reply every 0.5 s.  A round's messages therefore wait 1.5 s on average (up to 3 s) before a node
even sees them — Flower's floor for a deployed round.  This launcher runs Flower's own ``flower-supernode`` with
those two sleeps capped at ``--idle-poll`` seconds (it replaces the ``time`` module that one Flower module
sees with one whose ``sleep`` is capped; nothing else changes).  A shorter poll costs the SuperLink more
requests: one per node every ``--idle-poll`` seconds while idle.

    python -m fedfuse.flower.supernode --idle-poll 0.1 --superlink HOST:PORT ...   # flower-supernode's flags

``--worker`` (with ``--isolation process``) also starts the SuperNode's warm ClientApp worker
(:mod:`fedfuse.flower.worker`) on its Runtime API (``--port``), as a child that exits with the SuperNode — also
when the SuperNode is killed (the worker watches its parent's pid): one command per device, no orphaned worker.
``--worker-thread`` runs that worker as a thread of the SuperNode's own process instead: one process per device
(Flower itself has no in-process ClientApp for a deployed SuperNode; the worker talks to the SuperNode's Runtime
API over loopback HTTP as it does from its own process, and dies with the process).
"""

from __future__ import annotations

import argparse
import atexit
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any


class CappedTime:
    """The ``time`` module with ``sleep`` capped at ``cap`` seconds."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.cap))


def runtime_port(flower_args: Sequence[str], flag: str) -> str:
    """The Runtime API port of the SuperNode that ``flower_args`` describe (``--port``, Flower's default 9094);
    ``flag`` (``--worker``, ``--worker-thread``) needs ``--isolation process``, where a worker runs the tasks."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--port", default="9094")
    p.add_argument("--isolation", default="subprocess")
    known, _ = p.parse_known_args(list(flower_args))
    if known.isolation != "process":
        raise SystemExit(f"{flag} needs --isolation process (the worker runs the ClientApp tasks)")
    return str(known.port)


def start_worker(flower_args: Sequence[str], poll: float | None = None,
                 any_app: bool = False) -> subprocess.Popen[bytes]:
    """Start the warm ClientApp worker of the SuperNode that ``flower_args`` describe (its Runtime API is
    ``--port``, Flower's default 9094), watching this process: it exits when this process does."""
    port = runtime_port(flower_args, "--worker")
    cmd = [sys.executable, "-m", "fedfuse.flower.worker", "--runtime-api-address", f"127.0.0.1:{port}",
           "--parent-pid", str(os.getpid())]
    if poll is not None:
        cmd += ["--poll", str(poll)]
    if any_app:
        cmd.append("--any-app")
    worker = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    atexit.register(worker.terminate)
    return worker


def start_worker_thread(flower_args: Sequence[str], poll: float | None = None,
                        any_app: bool = False) -> threading.Thread:
    """Run the warm ClientApp worker of the SuperNode that ``flower_args`` describe in a daemon thread of this
    process (one process per device); its log lines go to this process's stderr."""
    import logging

    from fedfuse.flower.worker import DEFAULT_POLL, WarmWorker

    port = runtime_port(flower_args, "--worker-thread")
    log = logging.getLogger("fedfuse")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)

    def serve() -> None:
        import torch

        torch.set_num_threads(int(os.environ.get("FEDFUSE_THREADS", "1")))
        worker = WarmWorker(f"127.0.0.1:{port}", poll=DEFAULT_POLL if poll is None else poll, any_app=any_app)
        log.info("warm ClientApp worker serving 127.0.0.1:%s in the SuperNode's process (pid %d)", port,
                 os.getpid())
        worker.serve()

    thread = threading.Thread(target=serve, name="fedfuse-worker", daemon=True)
    thread.start()
    return thread


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--idle-poll", type=float, default=3.0)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--worker-thread", action="store_true")  # the worker in this process: one process per device
    p.add_argument("--worker-poll", type=float, default=None)
    p.add_argument("--worker-any-app", action="store_true")  # the worker serves any Flower app, not only fedfuse's
    args, rest = p.parse_known_args(argv)
    if args.worker_thread:
        start_worker_thread(rest, args.worker_poll, args.worker_any_app)
    elif args.worker:
        start_worker(rest, args.worker_poll, args.worker_any_app)
    import flwr.supernode.start_client_internal as loop
    from flwr.supernode.cli import flower_supernode

    loop.time = CappedTime(args.idle_poll)  # type: ignore[assignment]
    sys.argv = ["flower-supernode", *rest]
    flower_supernode()


if __name__ == "__main__":
    main()
