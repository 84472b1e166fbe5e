"""A new user's first hour, timed: every command of the README's tour and every example of docs/api.md, run as
written, each with its wall and CPU time against the time the docs state beside it.

Usage: ``benchmarks/first_hour.sh [WORKDIR]`` (or ``python3 benchmarks/first_hour.py [WORKDIR]``).

A stated time is a comment on the command's line (or the first line of a Python block): ``(~20 s)``,
``(~3 min)``, ``(<= 3 min)``.  A command without one must finish within :data:`DEFAULT_BUDGET` seconds (the
README says so).  The commands run in ``WORKDIR/work`` with ``WORKDIR/shared/data`` linked to ``$FEDFUSE_DATA``
(default ``/work/shared/data``), so ``--data-dir ../shared/data`` works as written; ``fedfuse`` is this
checkout's ``python3 -m fedfuse``.  Placeholders are filled in: ``my.yaml`` is written first, the
``--resume runs/fedavg-digits-<time>`` directory and ``fedfuse.load("runs/cmp/runs/fedavg-digits-s0-...")`` are
the newest matching directories.  Prints one line per command and a table at the end; exits 1 when a command
fails or exceeds its stated time.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET = 60.0  # seconds: "every command without a stated time finishes within a minute on 2 cores"
README_SECTIONS = ("### Run, compare, resume", "### Seeds, sweeps, statistics and reports", "### Python API")
TIME = re.compile(r"\((?:~|<=|≤)\s*(\d+(?:\.\d+)?)\s*(s|min)\)")


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w+)\n(.*?)```", text, flags=re.S)]


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    nxt = re.search(r"^#{2,3} ", text[start + len(heading):], flags=re.M)
    return text[start: start + len(heading) + (nxt.start() if nxt else len(text))]


def budget(line: str) -> float | None:
    m = TIME.search(line)
    if not m:
        return None
    return float(m.group(1)) * (60 if m.group(2) == "min" else 1)


def bash_commands(body: str) -> list[tuple[str, float | None]]:
    """Each command of a bash block (continuation lines joined; ``a; b`` stays one command) with its budget."""
    out, cur = [], ""
    for line in body.splitlines():
        if not line.strip() or (line.lstrip().startswith("#") and not cur):
            continue
        cur += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            out.append((cur.strip(), budget(cur)))
            cur = ""
    return out


def collect() -> list[tuple[str, str, str, float | None]]:
    """(source, kind, code, budget) of every command to run, in document order."""
    todo = []
    readme = (ROOT / "README.md").read_text()
    for heading in README_SECTIONS:
        for lang, body in blocks(section(readme, heading)):
            if lang == "bash":
                todo += [("README", "bash", c, b) for c, b in bash_commands(body)]
            elif lang == "python":
                todo.append(("README", "python", body, budget(body.splitlines()[0])))
    for lang, body in blocks((ROOT / "docs" / "api.md").read_text()):
        if lang == "bash":
            todo += [("docs/api.md", "bash", c, b) for c, b in bash_commands(body)]
        elif lang == "python":
            todo.append(("docs/api.md", "python", body, budget(body.splitlines()[0])))
    return todo


def fill_placeholders(code: str, work: Path) -> str:
    def newest(pattern: str) -> str | None:
        found = sorted(work.glob(pattern), key=lambda p: p.stat().st_mtime)
        return str(found[-1].relative_to(work)) if found else None

    if "--resume runs/fedavg-digits-" in code:
        d = newest("runs/fedavg-digits-2*")
        code = re.sub(r"--resume runs/fedavg-digits-\d+-\d+", f"--resume {d}", code) if d else code
    if 'fedfuse.load("runs/cmp/runs/fedavg-digits-s0-...")' in code:
        d = newest("runs/cmp/runs/fedavg-digits-s0-*")
        code = code.replace('"runs/cmp/runs/fedavg-digits-s0-..."', repr(d)) if d else code
    return code


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv: list[str]) -> int:
    base = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="fedfuse-first-hour-"))
    work, shared = base / "work", base / "shared"
    work.mkdir(parents=True, exist_ok=True)
    shared.mkdir(exist_ok=True)
    data = Path(os.environ.get("FEDFUSE_DATA", "/work/shared/data"))
    if not (shared / "data").exists():
        (shared / "data").symlink_to(data)
    bin_dir = base / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "fedfuse"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fedfuse "$@"\n')
    shim.chmod(0o755)
    (work / "my.yaml").write_text("algorithm: fedavg\nclients: 10\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MPLBACKEND": "Agg",
           "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}".rstrip(":")}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    print(f"# first hour: {base} (load {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores)", flush=True)
    rows, bad = [], 0
    for source, kind, code, limit in collect():
        code = fill_placeholders(code, work)
        stated = limit if limit is not None else DEFAULT_BUDGET
        cmd = ["bash", "-o", "pipefail", "-c", code] if kind == "bash" else [sys.executable, "-c", code]
        c0, t0 = cpu_children(), time.perf_counter()
        p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - t0, cpu_children() - c0
        ok = p.returncode == 0
        verdict = "ok" if ok and wall <= stated else ("FAILED" if not ok else "SLOW")
        bad += verdict != "ok"
        label = code.splitlines()[0][:90] if kind == "bash" else f"python block: {code.splitlines()[0][:70]}"
        rows.append((source, label, wall, cpu, stated, limit is not None, verdict))
        print(f"{verdict:<6} {wall:7.1f} s wall {cpu:7.1f} s cpu / {stated:5.0f} s {source}: {label}", flush=True)
        if not ok:
            print("   " + (p.stderr.strip().splitlines() or ["(no stderr)"])[-1], flush=True)
    print(f"\n# load at the end {os.getloadavg()[0]:.1f}\n")
    print("| source | command | wall (s) | CPU (s) | stated (s) | verdict |\n|---|---|---|---|---|---|")
    for source, label, wall, cpu, stated, explicit, verdict in rows:
        limit = f"{stated:.0f}" if explicit else f"{stated:.0f} (default)"
        print(f"| {source} | `{label}` | {wall:.1f} | {cpu:.1f} | {limit} | {verdict} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
