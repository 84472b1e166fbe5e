"""kill -9 at a random round with dropouts, stragglers and a corrupt client, then --resume: bit-identical."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from fedfuse.cli import main
from fedfuse.engine.loop import strip_timing
from support import ROOT

ARGS = ["--rounds", "4", "--clients", "6", "--clients-per-round", "4", "--local-epochs", "1", "--model", "mlp",
        "--set", "widths=[16]", "--set", "plots=false", "--set", "dropout=0.3", "--set", "stragglers=0.3",
        "--set", "corrupt=nan", "--set", "corrupt_clients=[2]", "--threads", "1", "--no-progress"]


def _records(out: Path) -> list[dict]:
    return [strip_timing(json.loads(x)) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _final(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model_final.pt", weights_only=False)["state"]


def test_kill9_and_resume_under_faults_is_bit_identical(tmp_path, capsys):
    ref = tmp_path / "ref"
    assert main(["run", *ARGS, "--out", str(ref)]) == 0
    killed = tmp_path / "killed"
    kill_after = random.Random(os.getpid()).randint(1, 3)  # a random round, reported on failure
    src = str(ROOT / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "fedfuse.cli", "run", *ARGS, "--out", str(killed)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            m = killed / "metrics.jsonl"  # the round's record is written before its checkpoint: wait for both
            if m.exists() and len(m.read_text().splitlines()) >= kill_after and (killed / "checkpoint.pt").exists():
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert (killed / "checkpoint.pt").exists(), kill_after
    assert main(["run", "--resume", str(killed), "--no-progress"]) == 0
    assert _records(killed) == _records(ref), kill_after
    a, b = _final(killed), _final(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), kill_after
    assert sum(len(r["dropped"]) for r in _records(ref)) > 0
    assert all("2" in r["quarantined"] for r in _records(ref) if 2 in r["clients"] and 2 not in r["dropped"]
               and 2 not in r["late"])
