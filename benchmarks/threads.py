"""Wall and CPU time of ``fedfuse run`` under different thread settings, optionally beside CPU burners.

Every variant is a fresh ``python -m fedfuse run`` process (so OpenMP starts with that variant's wait policy);
variants are interleaved, ``--repeats`` times, and the medians are printed.  ``--burners N`` starts N busy-loop
processes first (the loaded case) and waits ``--warmup`` seconds so the load average sees them.

    python benchmarks/threads.py --repeats 3                  # idle-ish
    python benchmarks/threads.py --repeats 3 --burners 2      # loaded

Variants: ``0/default`` is the behaviour before the passive policy (PyTorch's thread count, OpenMP's default
wait policy: torch is imported before fedfuse can set the policy); the others run with fedfuse's passive policy.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time

#: label -> (extra CLI arguments, keep OpenMP's default wait policy)
VARIANTS: dict[str, tuple[list[str], bool]] = {
    "0/default": (["--threads", "0"], True),
    "0/passive": (["--threads", "0"], False),
    "1": (["--threads", "1"], False),
    "2": (["--threads", "2"], False),
    "auto": ([], False),
}

#: imports torch before fedfuse, so OpenMP reads the environment before fedfuse could set OMP_WAIT_POLICY
_OLD_DEFAULT = "import torch, sys; from fedfuse.cli import main; sys.exit(main())"


def run_once(args: list[str], omp_default: bool, out: str) -> tuple[float, float, float]:
    """(command wall s, the run's own wall s as printed, child CPU s) of one ``fedfuse run``."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if omp_default:
        env.pop("OMP_WAIT_POLICY", None)
        cmd = [sys.executable, "-c", _OLD_DEFAULT]
    else:
        env.pop("OMP_WAIT_POLICY", None)  # fedfuse sets PASSIVE itself
        cmd = [sys.executable, "-m", "fedfuse"]
    cmd += ["run", "--no-progress", "--overwrite", "--out", out, *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    m = re.search(r"wall time: ([0-9.]+) s", done.stdout)
    return wall, float(m.group(1)) if m else float("nan"), cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--burners", type=int, default=0, help="busy-loop processes to start first (loaded case)")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds to let the load average see the burners")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="/tmp/fedfuse-threads-bench")
    p.add_argument("run_args", nargs="*", help="extra arguments for fedfuse run (after --)")
    a = p.parse_args()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.burners)]
    try:
        if burners:
            time.sleep(a.warmup)
        print(f"load average at start: {os.getloadavg()}")
        names = a.variants.split(",")
        times: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
        for _ in range(a.repeats):
            for n in names:
                extra, omp_default = VARIANTS[n]
                times[n].append(run_once([*extra, *a.run_args], omp_default, a.out))
        print(f"load average at end: {os.getloadavg()}  (burners: {a.burners})")
        print("| threads / wait policy | command wall s | run wall s | CPU s |")
        print("|---|---|---|---|")
        for n in names:
            cols = [statistics.median(t[i] for t in times[n]) for i in range(3)]
            print(f"| {n} | {cols[0]:.1f} | {cols[1]:.1f} | {cols[2]:.1f} |")
    finally:
        for b in burners:
            b.kill()
            b.wait()


if __name__ == "__main__":
    main()
