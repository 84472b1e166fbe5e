"""docs/deploy.md, executed: its numbered steps' commands, read from the page itself, run on loopback with three
devices — each its own directory holding only what the guide copies to it — through a SuperLink crash and a device
restart, and the deployed run must equal the in-process run round for round.

Only what a single machine forces is changed, by the explicit rules of :func:`localise`: the server's and the
devices' addresses become loopback, the fixed ports free ones, ``/srv``/``/data`` paths temporary directories,
``node-0`` device *i*'s name, ``5`` devices 3, and ``python`` this interpreter.  A documented command that the test
cannot map (a new flag, a renamed file) fails here, so the guide and the test cannot disagree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")

from fedfuse.flower.federation import _signal_tree, _tree, free_port

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "deploy.md"
DEVICES = 3

#: The study the test deploys (docs/deploy.md's study.yaml is MNIST for 20 rounds; this is its small stand-in).
STUDY: dict[str, Any] = {"algorithm": "fedavg", "dataset": "digits", "clients": 3, "clients_per_round": 3,
                         "rounds": 4, "eval_every": 2, "threads": 1, "plots": False, "seed": 5,
                         "model_options": {"widths": [16]}}
#: The server holds no dataset once federated evaluation lands (#40 item 2): merge its settings here, one line.
NO_SERVER_DATA: dict[str, Any] = {}


def guide() -> dict[int, list[str]]:
    """The commands of the guide's ``bash`` blocks, by numbered section (``## 1. Prepare`` → 1), continuation
    lines joined; an abbreviated example (a line with ``...``) is left out."""
    out: dict[int, list[str]] = {}
    for section in re.split(r"\n## ", GUIDE.read_text())[1:]:
        found = re.match(r"(\d+)\. ", section)
        if not found:
            continue
        for block in re.findall(r"```bash\n(.*?)```", section, re.S):
            for cmd in re.sub(r"\\\n\s*", "", block).splitlines():
                cmd = cmd.split("  #", 1)[0].strip()
                if cmd and "..." not in cmd:
                    out.setdefault(int(found.group(1)), []).append(cmd)
    return out


def localise(cmd: str, ports: dict[str, int], tmp: Path, device: int = 0) -> str:
    """A documented command as it runs on this one machine (see the module docstring)."""
    rules = [
        (r"\b192\.168\.1\.10:9093\b", f"127.0.0.1:{ports['gateway']}"),
        (r"\b0\.0\.0\.0:9093\b", f"127.0.0.1:{ports['gateway']}"),
        (r"\b9091\b", str(ports["admin"])),
        (r"\b9094\b", str(ports[f"runtime-{device}"])),
        (r"/srv/fedfuse/study\b", str(tmp / "out")),
        (r"/srv/data\b", str(tmp / "data")),
        (r"/data/node-0\b", str(tmp / "A" / "parts" / f"node-{device}")),
        (r"\bnode-0\b", f"node-{device}"),
        (r"--nodes 5\b", f"--nodes {DEVICES}"),
        (r"--min-nodes 5\b", f"--min-nodes {DEVICES}"),
        (r"^python ", f"{sys.executable} "),
    ]
    for pattern, value in rules:
        cmd = re.sub(pattern, value, cmd)
    if cmd.startswith("fedfuse flower-app") and "--admin-port" not in cmd:  # the guide uses the default, 9091
        cmd += f" --admin-port {ports['admin']}"
    return cmd


class Machine:
    """A directory standing for one machine: commands run there with ``bash -c`` (the guide's shell syntax)."""

    def __init__(self, dir: Path, env: dict[str, str]) -> None:
        self.dir = dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def run(self, cmd: str, timeout: float = 300) -> str:
        res = subprocess.run(["bash", "-c", cmd], cwd=self.dir, env=self.env, capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)
        assert res.returncode == 0, f"$ {cmd}\n{res.stdout}\n{res.stderr}"
        return res.stdout

    def start(self, name: str, cmd: str) -> Path:
        log = self.dir / f"{name}.log"
        with log.open("ab") as fh:
            self.procs[name] = subprocess.Popen(["bash", "-c", cmd], cwd=self.dir, env=self.env,
                                                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True)
        return log

    def kill(self, name: str) -> None:
        """SIGKILL the process and everything it started (a crash: no goodbye)."""
        proc = self.procs.pop(name)
        _signal_tree(_tree(proc.pid), signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name)


def _wait_for(what: str, check: Any, timeout: float, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
        assert time.monotonic() < deadline, f"{what} not within {timeout} s\n{tail}"
        time.sleep(0.2)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _start_device(machine: Machine, cmd: str, timeout: float = 180) -> int:
    """Start a device with the guide's command; returns its node id.  A restarted device's key is refused until
    the SuperLink has seen its old connection lapse ("Failed to activate SuperNode", up to a minute): the device is
    started again every 2 s until it connects."""
    deadline = time.monotonic() + timeout
    log = machine.dir / "device.log"
    while True:
        offset = log.stat().st_size if log.exists() else 0
        machine.start("device", cmd)
        proc = machine.procs["device"]
        while proc.poll() is None:
            text = log.read_bytes()[offset:].decode(errors="replace")
            if found := re.search(r"SuperNode ID: (\d+)", text):
                return int(found.group(1))
            assert time.monotonic() < deadline, text[-3000:]
            time.sleep(0.2)
        machine.kill("device")
        text = log.read_bytes()[offset:].decode(errors="replace")
        assert "Failed to activate SuperNode" in text and time.monotonic() < deadline, text[-3000:]
        time.sleep(2.0)


@pytest.mark.slow
def test_the_deployment_guide_runs_as_written_through_a_superlink_crash_and_a_device_restart(tmp_path: Path) -> None:
    import yaml

    import fedfuse
    from fedfuse.config import make_config
    from fedfuse.engine.loop import strip_timing
    from fedfuse.runner import experiment

    steps = guide()
    assert sorted(steps) == [1, 2, 3, 4], steps
    src = str(Path(fedfuse.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p),
               FLWR_TELEMETRY_ENABLED="0", PYTHONUNBUFFERED="1", COLUMNS="200", NO_COLOR="1")
    ports = {"gateway": free_port(), "admin": free_port(), **{f"runtime-{i}": free_port() for i in range(DEVICES)}}
    (tmp_path / "data").mkdir()
    server = Machine(tmp_path / "A", dict(env, FLWR_HOME=str(tmp_path / "A" / ".flwr-home")))
    devices = [Machine(tmp_path / f"device-{i}", dict(env, FLWR_HOME=str(tmp_path / f"device-{i}" / ".flwr")))
               for i in range(DEVICES)]
    (server.dir / "study.yaml").write_text(yaml.safe_dump({**STUDY, **NO_SERVER_DATA}))
    experiment(make_config(str(server.dir / "study.yaml"), out=str(tmp_path / "ref"), executor="sequential")).run()

    # 1. Prepare (machine A)
    for cmd in steps[1]:
        server.run(localise(cmd, ports, tmp_path))
    # 2. the server: SuperLink and gateway; 3. each device makes its key, the operator registers its public key
    superlink_cmd, gateway_cmd, register_cmd = (localise(c, ports, tmp_path) for c in steps[2])
    assert superlink_cmd.startswith("flower-superlink") and "--database" in superlink_cmd
    server.start("superlink", superlink_cmd)
    _wait_for("the SuperLink", lambda: _listening(ports["admin"]), 120, server.dir / "superlink.log")
    server.start("gateway", gateway_cmd)
    _wait_for("the gateway", lambda: _listening(ports["gateway"]), 120, server.dir / "gateway.log")
    keygen, supernode = steps[3]
    device_cmds = []
    for i, device in enumerate(devices):  # what the operator hands each device: ca.crt, trusted entities, its data
        shutil.copy(server.dir / "study-app" / "certs" / "ca.crt", device.dir)
        shutil.copy(server.dir / "study-app" / "trusted-entities.yaml", device.dir)
        device.run(localise(keygen, ports, tmp_path, i))
        shutil.copy(device.dir / f"node-{i}.pub", server.dir)  # only the public key leaves the device
        server.run(localise(register_cmd, ports, tmp_path, i))
        device_cmds.append(localise(supernode, ports, tmp_path, i))
        assert f"data='{tmp_path / 'A' / 'parts' / f'node-{i}'}'" in device_cmds[-1]
    try:
        node_ids = [_start_device(d, c) for d, c in zip(devices, device_cmds, strict=True)]
        # 4. Run
        run_cmd, resume_cmd = (localise(c, ports, tmp_path) for c in steps[4])
        assert "resume=true" in resume_cmd and "resume" not in run_cmd
        metrics = tmp_path / "out" / "metrics.jsonl"

        def rounds() -> list[dict[str, Any]]:
            return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

        first = server.start("run-1", run_cmd)
        _wait_for("round 2", lambda: len(rounds()) >= 2, 600, first)
        server.kill("superlink")  # the server crashes (its ServerApp with it) ...
        devices[1].kill("device")  # ... and device 1 restarts meanwhile
        server.start("superlink", superlink_cmd)
        _wait_for("the restarted SuperLink", lambda: _listening(ports["admin"]), 120, server.dir / "superlink.log")
        assert _start_device(devices[1], device_cmds[1]) == node_ids[1]  # same key, same registration
        server.procs.pop("run-1").wait(timeout=60)  # its stream ended with the SuperLink
        second = server.start("run-2", resume_cmd)
        _wait_for("the resumed run", lambda: server.procs["run-2"].poll() is not None, 900, second)
        assert all(d.procs["device"].poll() is None for d in devices)  # every device still up
        got = rounds()
        ref = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in got] == list(range(1, STUDY["rounds"] + 1)), second.read_text()[-3000:]
        assert [strip_timing(r) for r in got] == [strip_timing(r) for r in ref]
        log = second.read_text(errors="replace")
        assert f"fedfuse round {STUDY['rounds']}/{STUDY['rounds']}: {DEVICES}/{DEVICES} replied" in log
    finally:
        for m in (*devices, server):
            m.stop()
