"""A local Flower federation: a TLS SuperLink and N SuperNodes on loopback, as subprocesses on free ports, logs to
files, SuperNodes registered (node authentication) before they connect, ``kill(i)`` to simulate a dead device.

Used by the ``flower`` executor (:mod:`fedfuse.flower.simulation`: a loopback SuperLink in simulation mode), the
deployment tests and the deployment benchmarks.  The certificates and the app project it starts from are written
by :mod:`fedfuse.flower.deploy`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from fedfuse.flower.deploy import (
    DEFAULT_CONNECTION,
    SIGNING_KEY,
    TRUSTED_ENTITIES,
    Certificates,
    build_fab,
    make_certificates,
    make_signing_key,
    sign_fab,
    toml_value,
    write_connection,
    write_trusted_entities,
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tool(name: str) -> str:
    """Path of a Flower console script: next to this interpreter if there, else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found (pip install 'fedfuse[flower]')")
    return found


#: Seconds after its last heartbeat that the SuperLink keeps a silent SuperNode online: Flower's default heartbeat
#: interval (30 s) times its patience (2); until then the node's key cannot be activated again.
NODE_OFFLINE_AFTER = 60.0


class FederationError(RuntimeError):
    """A SuperLink, SuperNode or ``flwr`` command failed; the message ends with the relevant log tail."""


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    offset: int  # where this process's output starts in ``log`` (a restarted SuperNode appends)


class LocalFederation:
    """A TLS SuperLink and ``nodes`` SuperNodes on loopback, started as subprocesses.

    >>> with LocalFederation(tmp, nodes=2) as fed:            # doctest: +SKIP
    ...     run_id = fed.run(app_dir)                          # flwr run APP fedfuse --stream
    ...     fed.wait(run_id, timeout=120)                      # "finished:completed"

    Every process gets its own ``FLWR_HOME`` under ``dir`` and logs to ``dir/logs/NAME.log``; :meth:`kill` SIGKILLs
    a SuperNode together with the SuperExec and ClientApp processes it spawned (a device that dies), and leaving the
    ``with`` block stops everything.  ``auth=True`` starts the SuperLink with ``--enable-supernode-auth`` and
    registers every SuperNode's public key (``flwr supernode register``) before the SuperNode starts.  ``env`` is
    added to every process's environment (e.g. ``PYTHONPATH`` so the app's modules import on the SuperLink and the
    SuperNodes).

    ``gateway=True`` deploys as docs/deploy.md does: the SuperLink listens on its own loopback port
    (:attr:`admin_address`, where the ``flwr`` CLI submits runs) and the SuperNodes dial the Fleet API gateway
    (:mod:`fedfuse.flower.gateway`) at :attr:`address`; ``signed=True`` also gives the operator a signing key,
    starts the SuperNodes with ``--trusted-entities`` (that key only) and signs every app :meth:`run` submits
    (``sign=False`` submits it unsigned); ``database=True`` keeps the SuperLink's state in ``dir/superlink.db``
    across :meth:`restart_superlink`.  Warm workers serve only fedfuse's app unless ``any_app=True``;
    ``worker_thread=True`` runs each in its SuperNode's process (``python -m fedfuse.flower.supernode
    --worker-thread``: one process per device).
    """

    def __init__(self, dir: str | Path, nodes: int = 2, *, auth: bool = True, env: Mapping[str, str] | None = None,
                 connection: str = DEFAULT_CONNECTION, node_config: Sequence[str] | None = None,
                 startup_timeout: float = 60.0, warm: bool = False, worker_poll: float | None = None,
                 node_poll: float | None = None, audit_open: bool = False, simulation: bool = False,
                 gateway: bool = False, signed: bool = False, database: bool = False, any_app: bool = False,
                 worker_thread: bool = False) -> None:
        self.dir = Path(dir).resolve()
        self.num_nodes = nodes
        self.auth = auth
        self.connection = connection
        self.node_config = list(node_config) if node_config is not None else [
            f"partition-id={i} num-partitions={nodes}" for i in range(nodes)]
        self.startup_timeout = startup_timeout
        self.warm = warm
        self.worker_thread = worker_thread  # warm workers as threads of their SuperNode's process (one per device)
        self.worker_poll = worker_poll
        self.node_poll = node_poll  # SuperNode idle poll (fedfuse.flower.supernode); None: Flower's 3 s
        self.audit_open = audit_open  # warm workers record every file they open (logs/worker-I.opened)
        self.simulation = simulation  # a plain-HTTP loopback SuperLink in simulation mode, no SuperNodes
        self.use_gateway = gateway
        self.any_app = any_app  # warm workers serve any Flower app, not only fedfuse's
        self.signed = signed
        self.database = self.dir / "superlink.db" if database else None
        self.signatures = self.dir / "signatures"  # what the gateway hands out with a bundle
        self.signing_key = self.dir / "operator" / SIGNING_KEY  # the operator's key (``signed=True``)
        self.trusted_entities = self.dir / "operator" / TRUSTED_ENTITIES
        self.admin_port = 0
        self.gateway: _Proc | None = None
        self.workers: list[_Proc | None] = [None] * nodes  # warm ClientApp workers (``warm=True``)
        self.logs = self.dir / "logs"
        self.home = self.dir / "cli-home"  # FLWR_HOME of the flwr CLI (holds the SuperLink connection)
        self.port = 0
        self.certs: Certificates | None = None
        self.superlink: _Proc | None = None
        self.nodes: list[_Proc | None] = []
        self.node_id: list[int] = []  # Flower node id of each SuperNode
        self._streams: dict[int, subprocess.Popen[bytes]] = {}
        self._env = dict(os.environ)
        self._env.update(env or {})
        self._env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
        self._env["PYTHONUNBUFFERED"] = "1"

    # -- addresses ---------------------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The device-facing ``host:port``: the gateway's (``gateway=True``: Fleet API only), else the SuperLink's
        (Fleet, Control and Runtime APIs share it)."""
        return f"127.0.0.1:{self.port}"

    @property
    def admin_address(self) -> str:
        """The SuperLink's own ``host:port`` (loopback), where the ``flwr`` CLI submits runs."""
        return f"127.0.0.1:{self.admin_port}"

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def __enter__(self) -> LocalFederation:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Certificates, SuperLink, CLI connection, node registrations, SuperNodes; returns when all are up."""
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        if self.simulation:  # Flower's local simulation runtime: `flwr run` starts the ServerApp and the
            # simulated SuperNodes in one flwr-simulation process (Ray), as `flwr run APP local` does
            write_connection(self.home, self.address, None, self.connection, insecure=True)
            self.admin_port = self.port
            cmd = [_tool("flower-superlink"), "--insecure", "--simulation", "--host", "127.0.0.1", "--port",
                   str(self.port), "--disable-runtime-dependency-installation"]
            self.superlink = self._spawn("superlink", cmd, self.dir / "superlink-home")
            self._wait_listening(self.superlink, self.port)
            return
        self.certs = make_certificates(self.dir / "certs", nodes=self.num_nodes if self.auth else 0)
        if self.signed:
            write_trusted_entities(self.trusted_entities, [make_signing_key(self.signing_key)])
        self.admin_port = free_port() if self.use_gateway else self.port
        write_connection(self.home, self.admin_address, self.certs.ca_cert, self.connection)
        self.start_superlink()
        if self.auth and self.num_nodes:  # registrations run side by side: each `flwr` call is a Python start-up
            with ThreadPoolExecutor(self.num_nodes) as pool:
                list(pool.map(self.register, range(self.num_nodes)))
        self.nodes = [self._start_node(i) for i in range(self.num_nodes)]
        self.node_id = [self._wait_node(i) for i in range(self.num_nodes)]

    def start_superlink(self) -> None:
        """Start the SuperLink (on :attr:`admin_address`) and, with ``gateway``, the gateway in front of it."""
        assert self.certs is not None
        tls = ["--ssl-ca-certfile", str(self.certs.ca_cert), "--ssl-certfile", str(self.certs.server_cert),
               "--ssl-keyfile", str(self.certs.server_key)]
        cmd = [_tool("flower-superlink"), *tls, "--host", "127.0.0.1", "--port", str(self.admin_port),
               "--disable-runtime-dependency-installation"]
        if self.auth:
            cmd.append("--enable-supernode-auth")
        if self.database is not None:
            cmd += ["--database", str(self.database)]
        self.superlink = self._spawn("superlink", cmd, self.dir / "superlink-home")
        self._wait_listening(self.superlink, self.admin_port)
        if self.use_gateway and self.gateway is None:
            self.signatures.mkdir(parents=True, exist_ok=True)
            gw = [sys.executable, "-m", "fedfuse.flower.gateway", "--listen", self.address,
                  "--superlink", self.admin_address, *tls, "--signatures", str(self.signatures)]
            self.gateway = self._spawn("gateway", gw, self.dir / "gateway-home")
            self._wait_listening(self.gateway, self.port)

    def stop_superlink(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop the SuperLink and what it spawned (the ServerApp of a running run); SuperNodes and gateway stay."""
        if self.superlink is not None:
            tree = _tree(self.superlink.popen.pid)
            _signal_tree([self.superlink.popen.pid], sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.superlink.popen.wait(timeout=10)
            _signal_tree(tree, signal.SIGKILL)
            self.superlink.popen.wait()
            self.superlink = None

    def restart_superlink(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop the SuperLink (SIGKILL by default: a crash) and start it again on the same port and database."""
        self.stop_superlink(sig)
        self.start_superlink()

    def register(self, i: int) -> None:
        """``flwr supernode register certs/node-I.pub``: the SuperLink will accept SuperNode ``i``'s key."""
        assert self.certs is not None
        self.flwr("supernode", "register", str(self.certs.node_keys[i][1]), self.connection, "--name", f"node-{i}")

    def restart(self, i: int) -> int:
        """Start SuperNode ``i`` again (after :meth:`kill`) with its registered key; returns its node id.

        A SuperNode killed without a goodbye stays online at the SuperLink until its heartbeats lapse, and the
        SuperLink refuses to activate its key again until then ("Failed to activate SuperNode"): such a start
        is retried, every 2 s, for up to :data:`NODE_OFFLINE_AFTER` + ``startup_timeout`` seconds."""
        if self.nodes[i] is None:
            deadline = time.monotonic() + NODE_OFFLINE_AFTER + self.startup_timeout
            while True:
                self.nodes[i] = self._start_node(i)
                try:
                    self.node_id[i] = self._wait_node(i)
                    break
                except FederationError as e:
                    if "Failed to activate SuperNode" not in str(e) or time.monotonic() > deadline:
                        raise
                    self.kill(i)  # reaps the exited SuperNode and its warm worker
                    time.sleep(2.0)
        return self.node_id[i]

    def _start_node(self, i: int) -> _Proc:
        assert self.certs is not None
        launcher = [_tool("flower-supernode")] if self.node_poll is None and not self.worker_thread else [
            sys.executable, "-m", "fedfuse.flower.supernode", "--idle-poll", str(self.node_poll or 3.0)]
        if self.warm and self.worker_thread:
            launcher.append("--worker-thread")
            if self.worker_poll is not None:
                launcher += ["--worker-poll", str(self.worker_poll)]
            if self.any_app:
                launcher.append("--worker-any-app")
        cmd = [*launcher, "--superlink", self.address, "--root-certificates", str(self.certs.ca_cert),
               "--host", "127.0.0.1", "--port", str(free_port())]
        if self.auth:
            cmd += ["--auth-supernode-private-key", str(self.certs.node_keys[i][0])]
        if self.signed:
            cmd += ["--trusted-entities", str(self.trusted_entities)]
        if self.node_config[i]:
            cmd += ["--node-config", self.node_config[i]]
        runtime = cmd[cmd.index("--port") + 1]
        if self.warm:
            cmd += ["--isolation", "process"]
        proc = self._spawn(f"supernode-{i}", cmd, self.dir / f"supernode-{i}-home")
        if self.warm and not self.worker_thread:  # the SuperNode launches no ClientApp process: a worker claims tasks
            worker = [sys.executable, "-m", "fedfuse.flower.worker", "--runtime-api-address", f"127.0.0.1:{runtime}",
                      "--parent-pid", str(proc.popen.pid)]
            if self.worker_poll is not None:
                worker += ["--poll", str(self.worker_poll)]
            if self.any_app:
                worker.append("--any-app")
            extra = {"FEDFUSE_AUDIT_OPEN": str(self.logs / f"worker-{i}.opened")} if self.audit_open else {}
            self.workers[i] = self._spawn(f"worker-{i}", worker, self.dir / f"supernode-{i}-home", extra)
        return proc

    @property
    def node_data(self) -> list[Path]:
        """The ``data`` directory of each SuperNode's node config (node-local data), resolved."""
        out = []
        for conf in self.node_config:
            found = re.search(r"""data=(?:'([^']*)'|"([^"]*)")""", conf or "")
            out.append(Path(found.group(1) or found.group(2)).resolve() if found else Path())
        return out

    def opened(self, i: int) -> list[str]:
        """Paths worker ``i`` opened so far (``audit_open=True``)."""
        path = self.logs / f"worker-{i}.opened"
        return path.read_text().splitlines() if path.exists() else []

    def _wait_node(self, i: int) -> int:
        """Wait until SuperNode ``i`` is connected: it logs ``SuperNode ID: N`` once the SuperLink accepted it
        (TLS handshake and, with ``auth``, its signature); returns N."""
        proc = self.nodes[i]
        assert proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            text = proc.log.read_bytes()[proc.offset:].decode(errors="replace")
            found = re.search(r"SuperNode ID: (\d+)", text)
            if found:
                return int(found.group(1))
            if proc.popen.poll() is not None:
                raise FederationError(f"{proc.name} exited with {proc.popen.returncode}:\n{_tail(proc.log)}")
            if time.monotonic() > deadline:
                raise FederationError(f"{proc.name} not connected after {self.startup_timeout}s:\n{_tail(proc.log)}")
            time.sleep(0.2)

    def _spawn(self, name: str, cmd: list[str], home: Path, extra: Mapping[str, str] | None = None) -> _Proc:
        home.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        env = dict(self._env, FLWR_HOME=str(home), **(extra or {}))
        with log.open("ab") as fh:
            offset = fh.tell()
            popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=home, start_new_session=True)
        return _Proc(name, popen, log, offset)

    def _wait_listening(self, proc: _Proc, port: int) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise FederationError(f"{proc.name} exited with {proc.popen.returncode}:\n{_tail(proc.log)}")
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise FederationError(f"{proc.name} did not listen on {port} within {self.startup_timeout}s:\n"
                              f"{_tail(proc.log)}")

    def node_ids(self) -> list[int]:
        """Node ids of the SuperNodes the SuperLink lists as online (``flwr supernode list``; a killed SuperNode
        stays listed until its heartbeats are missed, ~1 min)."""
        rows = self.flwr_json("supernode", "list", self.connection).get("nodes", [])
        return [int(r["node-id"]) for r in rows if r.get("status") == "online"]

    def kill(self, node_index: int) -> None:
        """SIGKILL SuperNode ``node_index`` and every process it spawned (a device that dies: no goodbye)."""
        proc, worker = self.nodes[node_index], self.workers[node_index]
        for p in (proc, worker):
            if p is not None:
                _signal_tree(_tree(p.popen.pid), signal.SIGKILL)
                p.popen.wait()
        self.nodes[node_index] = self.workers[node_index] = None

    def stop(self) -> None:
        """Terminate the SuperNodes, then the SuperLink (SIGTERM; SIGKILL to what is left after 10 s)."""
        for stream in self._streams.values():  # `flwr run --stream` of runs nobody waited for
            _signal_tree(_tree(stream.pid), signal.SIGKILL)
            stream.wait()
        self._streams.clear()
        nodes = [p for p in self.nodes + self.workers if p is not None]
        for procs in (nodes, [p for p in (self.gateway, self.superlink) if p is not None]):
            trees = [_tree(p.popen.pid) for p in procs]
            for p in procs:
                _signal_tree([p.popen.pid], signal.SIGTERM)
            deadline = time.monotonic() + 10
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            for tree in trees:  # stragglers: SuperExec and app processes run in their own sessions
                _signal_tree(tree, signal.SIGKILL)
            for p in procs:
                p.popen.wait()
        self.nodes = [None] * len(self.nodes)
        self.workers = [None] * len(self.workers)
        self.superlink = self.gateway = None

    # -- the flwr CLI ------------------------------------------------------------------------------------------

    def flwr(self, *args: str, timeout: float = 120.0) -> str:
        """Run ``flwr ARGS`` against this federation (``FLWR_HOME`` = the CLI home); returns stdout."""
        env = dict(self._env, FLWR_HOME=str(self.home), COLUMNS="200", NO_COLOR="1")
        res = subprocess.run([_tool("flwr"), *args], capture_output=True, text=True, env=env, timeout=timeout,
                             stdin=subprocess.DEVNULL)
        with (self.logs / "flwr-cli.log").open("a") as fh:
            fh.write(f"$ flwr {' '.join(args)}\n{res.stdout}{res.stderr}\n")
        if res.returncode != 0:
            raise FederationError(f"flwr {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res.stdout

    def flwr_json(self, *args: str) -> dict[str, Any]:
        """``flwr ARGS --format json`` parsed (the JSON object is the last thing flwr prints)."""
        out = self.flwr(*args, "--format", "json")
        start = out.find("{")
        if start < 0:
            raise FederationError(f"no JSON in the output of flwr {' '.join(args)}:\n{out}")
        return json.loads(out[start:])

    def sign(self, app: str | Path) -> Path:
        """Sign the bundle ``flwr run APP`` will upload with the operator's key (``signed=True``)."""
        return sign_fab(build_fab(Path(app)), self.signing_key, self.signatures)

    def run(self, app: str | Path, run_config: Mapping[str, Any] | None = None, timeout: float = 120.0,
            federation_config: Mapping[str, Any] | None = None, sign: bool = True) -> int:
        """Submit ``app`` with ``flwr run APP <connection> --stream``; returns the run id once the SuperLink has
        accepted it.  The ``flwr`` process keeps streaming the ServerApp's log to ``logs/run-ID.log`` until the run
        ends, which is what :meth:`wait` waits for (no status polling).  With ``signed=True`` the bundle is signed
        first (``sign=False``: submitted unsigned)."""
        if self.signed and sign:
            self.sign(app)
        args = ["run", str(app), self.connection, "--stream"]
        for k, v in (run_config or {}).items():
            args += ["--run-config", f"{k}={toml_value(v)}"]
        if federation_config:  # the simulation runtime's settings (num-supernodes, client resources, Ray)
            args += ["--federation-config", " ".join(f"{k}={toml_value(v)}" for k, v in federation_config.items())]
        log = self.logs / f"flwr-run-{time.monotonic_ns()}.log"
        env = dict(self._env, FLWR_HOME=str(self.home), COLUMNS="200", NO_COLOR="1")
        with log.open("wb") as fh:
            popen = subprocess.Popen([_tool("flwr"), *args], stdout=fh, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(r"Successfully started run (\d+)", log.read_text(errors="replace"))
            if found:
                run_id = int(found.group(1))
                self._streams[run_id] = popen
                final = self.logs / f"run-{run_id}.log"
                log.rename(final)  # the open file keeps receiving the stream under its new name
                return run_id
            if popen.poll() is not None or time.monotonic() > deadline:
                _signal_tree(_tree(popen.pid), signal.SIGKILL)
                popen.wait()
                raise FederationError(f"flwr run {app} did not start a run:\n{_tail(log)}")
            time.sleep(0.2)

    def streaming(self, run_id: int) -> bool:
        """Whether ``flwr run --stream`` of ``run_id`` still runs (the run has not ended)."""
        stream = self._streams.get(run_id)
        return stream is not None and stream.poll() is None

    def status(self, run_id: int) -> str:
        """The run's status as ``flwr list`` shows it, e.g. ``running`` or ``finished:completed``."""
        res = self.flwr_json("list", self.connection, "--run-id", str(run_id))
        runs = res.get("runs", [])
        return str(runs[0]["status"]) if runs else "unknown"

    def wait(self, run_id: int, timeout: float = 300.0) -> str:
        """Block until the run finishes; returns its final status, e.g. ``finished:completed`` (raises on timeout).

        Waits for the run's log stream to end (the SuperLink closes it when the run finishes), then asks the
        SuperLink for the status; a stream that ends early falls back to polling every 2 s."""
        deadline = time.monotonic() + timeout
        stream = self._streams.pop(run_id, None)
        if stream is not None:
            try:
                stream.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_tree(_tree(stream.pid), signal.SIGKILL)
                stream.wait()
                raise FederationError(f"run {run_id} not finished after {timeout}s:\n"
                                      f"{_tail(self.logs / f'run-{run_id}.log')}") from None
        while True:
            status = self.status(run_id)
            if status.startswith("finished"):
                return status
            if time.monotonic() > deadline:
                raise FederationError(f"run {run_id} not finished after {timeout}s (status {status})")
            time.sleep(2.0)


def _tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (from ``/proc``; just ``[pid]`` where there is none)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if proc.is_dir():
        for d in proc.iterdir():
            if not d.name.isdigit():
                continue
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _signal_tree(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
