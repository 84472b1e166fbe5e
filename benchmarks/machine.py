"""What the machine was doing while a benchmark ran: the load line every benchmark prints beside its numbers.

A leaf module of ``benchmarks/``: benchmarks import it, it imports no benchmark (the scripts form no import
cycle; ``tests/system/test_layers.py`` checks it).
"""

from __future__ import annotations

import os
import subprocess


def load() -> str:
    """``uptime``'s line (the load averages), or the load averages alone where there is no ``uptime``."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg())
