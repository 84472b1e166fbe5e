"""docs/deploy.md, executed: its numbered steps' commands, read from the page itself, run on loopback with three
devices — each its own directory holding only what the guide copies to it — and a server that holds no dataset,
through a SuperLink crash in the middle of a round and a device restart; the deployed run must equal the in-process
run with the same federated evaluation round for round.

The machines: ``D`` holds the dataset and splits it into the devices' bundles (``export-partitions``), ``A`` is
the server (SuperLink, gateway, ServerApp, ``flwr run``) with an empty ``FEDFUSE_DATA`` and an audit hook recording
every file its ServerApp opens, ``device-i`` a device (its warm worker records the files it opens).

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
#: The server holds no dataset: the devices evaluate the global model (docs/deploy.md's study.yaml says the same).
NO_SERVER_DATA: dict[str, Any] = {"global_eval": "federated"}


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
        (r"/data/node-0\b", str(tmp / "D" / "parts" / f"node-{device}")),
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


def _opened(path: Path) -> list[Path]:
    """The files an audit hook (``FEDFUSE_AUDIT_OPEN``) recorded, resolved."""
    text = path.read_text() if path.exists() else ""
    return [Path(p).resolve() for p in text.splitlines() if p and not p.isdigit()]


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
    import sklearn
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
    env.pop("FEDFUSE_AUDIT_OPEN", None)
    ports = {"gateway": free_port(), "admin": free_port(), **{f"runtime-{i}": free_port() for i in range(DEVICES)}}
    (tmp_path / "data").mkdir()
    server_data = tmp_path / "server-data"  # the server's FEDFUSE_DATA: empty, and it must stay so
    server_data.mkdir()
    data = Machine(tmp_path / "D", env)
    server = Machine(tmp_path / "A", dict(env, FLWR_HOME=str(tmp_path / "A" / ".flwr-home"),
                                          FEDFUSE_DATA=str(server_data),
                                          FEDFUSE_AUDIT_OPEN=str(tmp_path / "A" / "serverapp.opened")))
    devices = [Machine(tmp_path / f"device-{i}", dict(env, FLWR_HOME=str(tmp_path / f"device-{i}" / ".flwr"),
                                                      FEDFUSE_AUDIT_OPEN=str(tmp_path / f"device-{i}" / "opened")))
               for i in range(DEVICES)]
    study = {**STUDY, **NO_SERVER_DATA}
    assert yaml.safe_load(re.search(r"```yaml\n(.*?)```", GUIDE.read_text(), re.S).group(1))["global_eval"] \
        == study["global_eval"]  # the guide's study evaluates as this one does
    for m in (data, server):
        (m.dir / "study.yaml").write_text(yaml.safe_dump(study))
    experiment(make_config(str(server.dir / "study.yaml"), out=str(tmp_path / "ref"), executor="sequential")).run()

    # 1. Prepare: the data's machine splits the dataset into the devices' bundles; the server writes the app
    export, *prepare = steps[1]
    assert export.startswith("fedfuse export-partitions") and not any("export-partitions" in c for c in prepare)
    data.run(localise(export, ports, tmp_path))
    for cmd in prepare:
        assert "--data-dir" not in cmd and "parts" not in cmd, cmd  # the server is given no data
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
    bundles = [(data.dir / "parts" / f"node-{i}").resolve() for i in range(DEVICES)]
    for i, device in enumerate(devices):  # what the operator hands each device: ca.crt, trusted entities, its data
        shutil.copy(server.dir / "study-app" / "certs" / "ca.crt", device.dir)
        shutil.copy(server.dir / "study-app" / "trusted-entities.yaml", device.dir)
        device.run(localise(keygen, ports, tmp_path, i))
        shutil.copy(device.dir / f"node-{i}.pub", server.dir)  # only the public key leaves the device
        server.run(localise(register_cmd, ports, tmp_path, i))
        device_cmds.append(localise(supernode, ports, tmp_path, i))
        assert f"data='{bundles[i]}'" in device_cmds[-1]
    try:
        node_ids = [_start_device(d, c) for d, c in zip(devices, device_cmds, strict=True)]
        # 4. Run
        run_cmd, resume_cmd = (localise(c, ports, tmp_path) for c in steps[4])
        assert "resume=true" in resume_cmd and "resume" not in run_cmd
        metrics = tmp_path / "out" / "metrics.jsonl"

        def rounds() -> list[dict[str, Any]]:
            return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

        def in_round_3() -> bool:  # round 2 written and every device has its round-3 job: a crash mid-round
            jobs = [(d.dir / "device.log").read_text(errors="replace").count("Receiving: train message")
                    for d in devices]
            return len(rounds()) >= 2 and min(jobs) >= 3

        first = server.start("run-1", run_cmd)
        _wait_for("round 3's jobs", in_round_3, 600, first)
        pids = [d.procs["device"].pid for d in devices]
        server.kill("superlink")  # the server crashes (its ServerApp with it) ...
        devices[1].kill("device")  # ... and device 1 restarts meanwhile
        server.start("superlink", superlink_cmd)
        _wait_for("the restarted SuperLink", lambda: _listening(ports["admin"]), 120, server.dir / "superlink.log")
        assert _start_device(devices[1], device_cmds[1]) == node_ids[1]  # same key, same registration
        server.procs.pop("run-1").wait(timeout=60)  # its stream ended with the SuperLink
        second = server.start("run-2", resume_cmd)
        _wait_for("the resumed run", lambda: server.procs["run-2"].poll() is not None, 900, second)
        # the other devices neither exited nor re-registered through the crash: the same processes throughout
        assert [d.procs["device"].pid for d in devices[::2]] == pids[::2]
        assert all(d.procs["device"].poll() is None for d in devices)
        got = rounds()
        ref = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in got] == list(range(1, STUDY["rounds"] + 1)), second.read_text()[-3000:]
        assert [strip_timing(r) for r in got] == [strip_timing(r) for r in ref]
        assert got[-1]["global_eval_clients"] == STUDY["clients"]  # evaluated on the devices, every client
        log = second.read_text(errors="replace")
        for r in got[2:]:  # the resumed run's rounds in Flower's own log, as metrics.jsonl has them
            assert (f"fedfuse round {r['round']}/{STUDY['rounds']}: {DEVICES}/{DEVICES} replied, "
                    f"train_loss {r['train_loss']:.4f}") in log, log[-3000:]
        assert f"global_accuracy {got[-1]['global_accuracy']:.4f}" in log
        # the killed run's log too, kept in the SuperLink's --database ("Watching a run": flwr log RUN_ID --show)
        killed = re.search(r"Successfully started run (\d+)", first.read_text(errors="replace"))
        assert killed, first.read_text(errors="replace")[-3000:]
        shown = server.run(f"FLWR_HOME=study-app/.flwr COLUMNS=200 flwr log {killed.group(1)} fedfuse --show")
        assert f"fedfuse round 2/{STUDY['rounds']}: {DEVICES}/{DEVICES} replied" in shown, shown[-3000:]
        links = (server.dir / "superlink.log").read_text(errors="replace")
        assert "Invalid run configuration" not in links and "No SuperNode found" not in links
    finally:
        for m in (*devices, server):
            m.stop()
    # no data reached the server: its FEDFUSE_DATA untouched, and its ServerApps opened no dataset file or bundle
    assert list(server_data.iterdir()) == [] and not (server.dir / "parts").exists()
    opened = _opened(server.dir / "serverapp.opened")
    assert any(p.name == "fedfuse-config.yaml" for p in opened)  # the hook ran in the ServerApp's process
    held = [Path(sklearn.__file__).parent / "datasets" / "data", server_data.resolve(), *bundles]
    assert not [p for p in opened if any(p.is_relative_to(d) for d in held)]
    for i in range(DEVICES):  # each device's worker opened its own bundle, no other device's
        seen = _opened(devices[i].dir / "opened")
        assert any(p.is_relative_to(bundles[i]) for p in seen)
        assert not [p for p in seen if any(p.is_relative_to(b) for j, b in enumerate(bundles) if j != i)]
