"""The device command's worker flags: a worker needs the SuperNode's process isolation and reads its port."""

from __future__ import annotations

import pytest

from fedfuse.flower.supernode import runtime_port


def test_the_worker_reads_the_runtime_port_and_needs_process_isolation():
    assert runtime_port(["--isolation", "process", "--port", "9201"], "--worker") == "9201"
    assert runtime_port(["--isolation", "process"], "--worker-thread") == "9094"  # Flower's default
    with pytest.raises(SystemExit, match="--worker-thread needs --isolation process"):
        runtime_port(["--port", "9201"], "--worker-thread")
