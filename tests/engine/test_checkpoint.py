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


# ---- safe loading: a tampered checkpoint runs no code ------------------------------------------------------------
class _Payload:
    """What an attacker who can write the run directory pickles into ``checkpoint.pt``: unpickling it with
    ``weights_only=False`` runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


FAST = ["--rounds", "2", "--clients", "4", "--clients-per-round", "2", "--model", "mlp", "--set", "widths=[16]",
        "--set", "plots=false", "--threads", "1", "--no-progress"]


def test_a_tampered_checkpoint_runs_no_code_on_resume(tmp_path, capsys):
    """Adversary: whoever can write the run directory (a shared disk, a copied run).  They add a pickled payload
    to a real checkpoint; ``--resume`` refuses the file with one line and the payload never runs."""
    from fedfuse.engine.checkpoint import safe_load

    out = tmp_path / "run"
    assert main(["run", *FAST, "--out", str(out)]) == 0
    real = safe_load(out / "checkpoint.pt", what="test")
    control = tmp_path / "control-marker"
    torch.save({**real, "extra": _Payload(control)}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)  # the attack is real: an unsafe load runs it
    assert control.exists()
    marker = tmp_path / "marker"
    torch.save({**real, "extra": _Payload(marker)}, out / "checkpoint.pt")
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--rounds", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedfuse: error: --resume:") and len(err.splitlines()) == 1, err
    assert "posix.system" in err and "refused" in err and "Traceback" not in err
    assert not marker.exists()


def test_checkpoint_values_round_trip_as_plain_types(tmp_path):
    """Everything a checkpoint holds (NumPy sampler state, late replies as Messages, int keys, tuples, sets) is
    stored as types ``weights_only=True`` reads and comes back equal; any other object is refused at save time,
    naming where it is."""
    from collections import OrderedDict

    import numpy as np
    import pytest

    from fedfuse.engine.checkpoint import TAG, load_checkpoint, save_checkpoint
    from fedfuse.types import FitStats, Message

    late = Message({"w": torch.arange(3.0)}, {"slot": (1, 2)}, FitStats(num_examples=5, train_loss=0.5))
    record = {"round": 2, "state": {"global": {"w": torch.ones(2)}, "odd": {TAG: "x", 3: frozenset({1})}},
              "client_states": {0: {"opt": OrderedDict(a=torch.zeros(1))}}, "totals": {}, "best": None,
              "history": [{"acc": np.float64(0.5)}], "sampler": {"grads": np.arange(6, dtype=np.float32)},
              "late_box": {3: (late, Message())}, "set": {1, 2}}
    save_checkpoint(tmp_path / "ck.pt", record)
    torch.load(tmp_path / "ck.pt", weights_only=True)  # loads with the strict unpickler alone
    back = load_checkpoint(tmp_path / "ck.pt")
    assert back["sampler"]["grads"].dtype == np.float32 and np.array_equal(back["sampler"]["grads"], np.arange(6))
    reply, sent = back["late_box"][3]
    assert torch.equal(reply.tensors["w"], late.tensors["w"]) and reply.meta == late.meta
    assert reply.stats == late.stats and sent.stats is None and sent.tensors == {}
    assert back["state"]["odd"] == {TAG: "x", 3: frozenset({1})} and back["set"] == {1, 2}
    assert isinstance(back["client_states"][0]["opt"], OrderedDict) and back["history"] == [{"acc": 0.5}]
    with pytest.raises(TypeError, match=r"_Payload at \['state'\]\['x'\]"):
        save_checkpoint(tmp_path / "bad.pt", {"state": {"x": _Payload(tmp_path / "m")}})


def test_an_older_checkpoint_with_numpy_arrays_still_loads_but_object_arrays_do_not(tmp_path):
    import numpy as np
    import pytest

    from fedfuse.config import ConfigError
    from fedfuse.engine.checkpoint import load_checkpoint

    base = {"round": 1, "state": {}, "client_states": {}, "totals": {}, "best": None, "history": []}
    torch.save({**base, "sampler": {"grads": np.ones((2, 3), dtype=np.float32)}}, tmp_path / "old.pt")
    assert load_checkpoint(tmp_path / "old.pt")["sampler"]["grads"].shape == (2, 3)
    torch.save({**base, "sampler": {"grads": np.array([_Payload(tmp_path / "m")], dtype=object)}},
               tmp_path / "obj.pt")
    with pytest.raises(ConfigError, match="refused"):
        load_checkpoint(tmp_path / "obj.pt")
    assert not (tmp_path / "m").exists()


def test_resume_with_numpy_sampler_state_and_late_replies_is_bit_identical(tmp_path):
    """Clustered sampling keeps NumPy arrays and next-round late replies keep Messages in the checkpoint: both
    survive the plain-type encoding and the resumed run equals the uninterrupted one."""
    for name, extra in (("clustered", ["--set", "sampling=clustered"]),
                        ("late", ["--set", "stragglers=0.5", "--set", "late_replies=next-round"])):
        args = [*FAST, "--rounds", "4", "--set", "checkpoint_every=1", *extra]
        assert main(["run", *args, "--out", str(tmp_path / f"{name}-full")]) == 0
        part = tmp_path / f"{name}-part"
        assert main(["run", *args, "--rounds", "2", "--out", str(part)]) == 0
        assert main(["run", "--resume", str(part), "--rounds", "4", "--no-progress"]) == 0
        assert _records(part) == _records(tmp_path / f"{name}-full"), name
