"""Deploy a fedfuse experiment on a real Flower federation (flwr 1.40-1.41 deployment runtime).

Three pieces, usable from tests and from ``fedfuse flower-app``:

* :func:`make_certificates` — a CA, a TLS server certificate for the SuperLink (``127.0.0.1``/``localhost`` plus any
  hosts given) and, for SuperNode authentication, one EC P-384 key pair per SuperNode in OpenSSH format.
* :func:`write_app` — a Flower app project (``pyproject.toml``) whose ServerApp/ClientApp are fedfuse's, plus a
  SuperLink connection in ``DIR/.flwr/config.toml`` (flwr ≥ 1.40 reads connections from ``$FLWR_HOME/config.toml``,
  not from ``pyproject.toml``), so that ``FLWR_HOME=DIR/.flwr flwr run DIR <connection>`` submits the run.
* :class:`LocalFederation` — a TLS SuperLink and N SuperNodes on loopback, as subprocesses on free ports, logs to
  files, SuperNodes registered (node authentication) before they connect, ``kill(i)`` to simulate a dead device.

How flwr 1.41 wires a deployment (read from ``flower-superlink --help`` / ``flower-supernode --help`` and flwr's CLI):
one SuperLink port (``--host``/``--port``) serves the Fleet, Control and Runtime HTTP APIs over TLS
(``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile``); a SuperNode dials it with ``--superlink HOST:PORT
--root-certificates CA`` and serves its own local Runtime API on ``--port``; with ``--enable-supernode-auth`` the
SuperLink only accepts SuperNodes whose public key was registered with ``flwr supernode register KEY.pub``, and a
SuperNode signs with ``--auth-supernode-private-key``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import ipaddress
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

FLOWER_REQUIREMENT = "flwr[simulation]>=1.40,<1.42"
DEFAULT_CONNECTION = "fedfuse"
DEFAULT_PORT = 9093
SERVERAPP = "fedfuse.flower.app:server_app"
CLIENTAPP = "fedfuse.flower.app:client_app"
CONFIG_COPY = "fedfuse-config.yaml"


# --------------------------------------------------------------------------------------------------------------------
# certificates and node keys


@dataclass(frozen=True)
class Certificates:
    """Paths written by :func:`make_certificates`."""

    dir: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[tuple[Path, Path], ...] = ()  # (private OpenSSH key, public OpenSSH key) per SuperNode


def _write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def make_certificates(dir: str | Path, hosts: Sequence[str] = (), nodes: int = 0, days: int = 365) -> Certificates:
    """Write a self-signed CA, a SuperLink server certificate signed by it and ``nodes`` node-auth key pairs.

    The server certificate's subject alternative names are ``127.0.0.1``, ``localhost`` and ``hosts`` (IP
    addresses or DNS names of the SuperLink machine).  Files: ``ca.crt``, ``ca.key``, ``server.pem``,
    ``server.key``, ``node-I`` and ``node-I.pub`` (OpenSSH, EC P-384 — what ``flwr supernode register`` accepts).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.UTC) - _dt.timedelta(minutes=5)
    until = now + _dt.timedelta(days=days)
    pem_key = {"encoding": serialization.Encoding.PEM, "format": serialization.PrivateFormat.PKCS8,
               "encryption_algorithm": serialization.NoEncryption()}

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedfuse"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "fedfuse test CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    names: list[x509.GeneralName] = []
    for host in ("127.0.0.1", "localhost", *hosts):
        try:
            entry: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            entry = x509.DNSName(host)
        if entry not in names:
            names.append(entry)
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "localhost")]))
        .issuer_name(ca_name).public_key(server_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                     crl_sign=False, content_commitment=False, data_encipherment=False,
                                     key_agreement=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    paths = Certificates(out, out / "ca.crt", out / "ca.key", out / "server.pem", out / "server.key",
                         tuple((out / f"node-{i}", out / f"node-{i}.pub") for i in range(nodes)))
    paths.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(paths.ca_key, ca_key.private_bytes(**pem_key))
    paths.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(paths.server_key, server_key.private_bytes(**pem_key))
    for private, public in paths.node_keys:
        key = ec.generate_private_key(ec.SECP384R1())
        _write_private(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                  serialization.NoEncryption()))
        public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                         serialization.PublicFormat.OpenSSH) + b"\n")
    return paths


def certificate_hosts(cert: str | Path) -> list[str]:
    """The IP addresses and DNS names a PEM certificate is valid for (its subject alternative names)."""
    from cryptography import x509

    c = x509.load_pem_x509_certificate(Path(cert).read_bytes())
    san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] + san.get_values_for_type(x509.DNSName)


# --------------------------------------------------------------------------------------------------------------------
# the Flower app project


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    raise TypeError(f"unsupported TOML value {v!r}")


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)  # bare only where TOML allows it


def _toml_table(name: str, items: Mapping[str, Any]) -> str:
    lines = [f"[{name}]"] + [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in items.items()]
    return "\n".join(lines) + "\n"


def write_connection(home: str | Path, superlink: str, root_certificates: str | Path | None = None,
                     name: str = DEFAULT_CONNECTION, insecure: bool = False) -> Path:
    """Write ``HOME/config.toml`` with one SuperLink connection ``name`` (made the default); returns its path.

    ``flwr run APP NAME`` with ``FLWR_HOME=HOME`` then talks to ``superlink`` (``host:port``) over TLS, trusting
    ``root_certificates`` (omit it to trust the system store; ``insecure=True`` for plain HTTP).
    """
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    conn: dict[str, Any] = {"address": superlink}
    if insecure:
        conn["insecure"] = True
    elif root_certificates is not None:
        conn["root-certificates"] = str(Path(root_certificates).resolve())
    path = home / "config.toml"
    path.write_text(_toml_table("superlink", {"default": name}) + "\n" + _toml_table(f"superlink.{name}", conn))
    return path


def write_app(dir: str | Path, config_path: str | Path | None, *, superlink: str = f"127.0.0.1:{DEFAULT_PORT}",
              root_certificates: str | Path | None = None, insecure: bool = False,
              connection: str = DEFAULT_CONNECTION, out: str | Path | None = None, round_timeout: float = 0.0,
              min_nodes: int = 1, name: str = "fedfuse-app", publisher: str = "fedfuse", serverapp: str = SERVERAPP,
              clientapp: str = CLIENTAPP, run_config: Mapping[str, Any] | None = None,
              dependencies: Sequence[str] = ("fedfuse", FLOWER_REQUIREMENT)) -> Path:
    """Write a Flower app project into ``dir`` and a SuperLink connection into ``dir/.flwr``; returns ``dir``.

    ``pyproject.toml`` names fedfuse's ServerApp and ClientApp and carries ``[tool.flwr.app.config]``:
    ``fedfuse-config`` (absolute path of a copy of ``config_path`` written to ``dir/fedfuse-config.yaml``; the
    ServerApp reads it on the SuperLink's machine), ``out`` (run directory there), ``round-timeout`` (seconds each
    round waits for replies; 0 = forever) and ``min-nodes`` (SuperNodes to wait for before round 1), plus
    ``run_config``.  ``config_path=None`` writes no fedfuse config (for other apps).  ``.gitignore`` keeps
    ``.flwr/``, ``certs/`` and an ``out`` inside ``dir`` out of the bundle ``flwr run`` uploads (and out of git).
    Submit with ``FLWR_HOME=dir/.flwr flwr run dir <connection>``.
    """
    app = Path(dir).resolve()
    app.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {}
    if config_path is not None:
        copy = app / CONFIG_COPY
        if Path(config_path).resolve() != copy:
            shutil.copyfile(config_path, copy)
        cfg["fedfuse-config"] = str(copy)
    cfg["out"] = str(Path(out).resolve()) if out else ""
    cfg["round-timeout"] = float(round_timeout)
    cfg["min-nodes"] = int(min_nodes)
    cfg.update(run_config or {})
    deps = ", ".join(json.dumps(d) for d in dependencies)
    text = (
        "# A Flower app running a fedfuse experiment (written by `fedfuse flower-app`).\n"
        "# Submit it with:  FLWR_HOME=.flwr flwr run . " + connection + "\n\n"
        + "[build-system]\nrequires = [\"hatchling\"]\nbuild-backend = \"hatchling.build\"\n\n"
        + _toml_table("project", {"name": name, "version": "1.0.0",
                                  "description": "fedfuse experiment as a Flower app",
                                  "license": "Apache-2.0"})
        + f"dependencies = [{deps}]\n\n"
        + _toml_table("tool.flwr.app", {"publisher": publisher}) + "\n"
        + _toml_table("tool.flwr.app.components", {"serverapp": serverapp, "clientapp": clientapp}) + "\n"
        + _toml_table("tool.flwr.app.config", cfg)
    )
    (app / "pyproject.toml").write_text(text)
    write_connection(app / ".flwr", superlink, root_certificates, connection, insecure)
    ignore = [".flwr/", "certs/"]  # flwr run builds the app bundle from DIR minus .gitignore: no keys, no outputs
    if out and Path(out).resolve().is_relative_to(app):
        ignore.append(Path(out).resolve().relative_to(app).as_posix() + "/")
    gitignore = app / ".gitignore"
    have = gitignore.read_text().splitlines() if gitignore.exists() else []
    gitignore.write_text("\n".join(have + [line for line in ignore if line not in have]) + "\n")
    return app


# --------------------------------------------------------------------------------------------------------------------
# a local federation of subprocesses


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
    """

    def __init__(self, dir: str | Path, nodes: int = 2, *, auth: bool = True, env: Mapping[str, str] | None = None,
                 connection: str = DEFAULT_CONNECTION, node_config: Sequence[str] | None = None,
                 startup_timeout: float = 60.0, warm: bool = False, worker_poll: float | None = None,
                 node_poll: float | None = None, audit_open: bool = False, simulation: bool = False) -> None:
        self.dir = Path(dir).resolve()
        self.num_nodes = nodes
        self.auth = auth
        self.connection = connection
        self.node_config = list(node_config) if node_config is not None else [
            f"partition-id={i} num-partitions={nodes}" for i in range(nodes)]
        self.startup_timeout = startup_timeout
        self.warm = warm
        self.worker_poll = worker_poll
        self.node_poll = node_poll  # SuperNode idle poll (fedfuse.flower.supernode); None: Flower's 3 s
        self.audit_open = audit_open  # warm workers record every file they open (logs/worker-I.opened)
        self.simulation = simulation  # a plain-HTTP loopback SuperLink in simulation mode, no SuperNodes
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
        """The SuperLink's ``host:port`` (Fleet, Control and Runtime APIs share it)."""
        return f"127.0.0.1:{self.port}"

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
            cmd = [_tool("flower-superlink"), "--insecure", "--simulation", "--host", "127.0.0.1", "--port",
                   str(self.port), "--disable-runtime-dependency-installation"]
            self.superlink = self._spawn("superlink", cmd, self.dir / "superlink-home")
            self._wait_listening(self.superlink, self.port)
            return
        self.certs = make_certificates(self.dir / "certs", nodes=self.num_nodes if self.auth else 0)
        write_connection(self.home, self.address, self.certs.ca_cert, self.connection)
        cmd = [_tool("flower-superlink"), "--ssl-ca-certfile", str(self.certs.ca_cert),
               "--ssl-certfile", str(self.certs.server_cert), "--ssl-keyfile", str(self.certs.server_key),
               "--host", "127.0.0.1", "--port", str(self.port), "--disable-runtime-dependency-installation"]
        if self.auth:
            cmd.append("--enable-supernode-auth")
        self.superlink = self._spawn("superlink", cmd, self.dir / "superlink-home")
        self._wait_listening(self.superlink, self.port)
        if self.auth:  # registrations run side by side: each `flwr` call is a Python start-up
            with ThreadPoolExecutor(self.num_nodes) as pool:
                list(pool.map(self.register, range(self.num_nodes)))
        self.nodes = [self._start_node(i) for i in range(self.num_nodes)]
        self.node_id = [self._wait_node(i) for i in range(self.num_nodes)]

    def register(self, i: int) -> None:
        """``flwr supernode register certs/node-I.pub``: the SuperLink will accept SuperNode ``i``'s key."""
        assert self.certs is not None
        self.flwr("supernode", "register", str(self.certs.node_keys[i][1]), self.connection, "--name", f"node-{i}")

    def restart(self, i: int) -> int:
        """Start SuperNode ``i`` again (after :meth:`kill`) with its registered key; returns its node id."""
        if self.nodes[i] is None:
            self.nodes[i] = self._start_node(i)
            self.node_id[i] = self._wait_node(i)
        return self.node_id[i]

    def _start_node(self, i: int) -> _Proc:
        assert self.certs is not None
        launcher = [_tool("flower-supernode")] if self.node_poll is None else [
            sys.executable, "-m", "fedfuse.flower.supernode", "--idle-poll", str(self.node_poll)]
        cmd = [*launcher, "--superlink", self.address, "--root-certificates", str(self.certs.ca_cert),
               "--host", "127.0.0.1", "--port", str(free_port())]
        if self.auth:
            cmd += ["--auth-supernode-private-key", str(self.certs.node_keys[i][0])]
        if self.node_config[i]:
            cmd += ["--node-config", self.node_config[i]]
        runtime = cmd[cmd.index("--port") + 1]
        if self.warm:
            cmd += ["--isolation", "process"]
        proc = self._spawn(f"supernode-{i}", cmd, self.dir / f"supernode-{i}-home")
        if self.warm:  # the SuperNode launches no ClientApp process: a warm worker claims its tasks
            worker = [sys.executable, "-m", "fedfuse.flower.worker", "--runtime-api-address", f"127.0.0.1:{runtime}",
                      "--parent-pid", str(proc.popen.pid)]
            if self.worker_poll is not None:
                worker += ["--poll", str(self.worker_poll)]
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
        for procs in (nodes, [self.superlink] if self.superlink else []):
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
        self.superlink = None

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

    def run(self, app: str | Path, run_config: Mapping[str, Any] | None = None, timeout: float = 120.0,
            federation_config: Mapping[str, Any] | None = None) -> int:
        """Submit ``app`` with ``flwr run APP <connection> --stream``; returns the run id once the SuperLink has
        accepted it.  The ``flwr`` process keeps streaming the ServerApp's log to ``logs/run-ID.log`` until the run
        ends, which is what :meth:`wait` waits for (no status polling)."""
        args = ["run", str(app), self.connection, "--stream"]
        for k, v in (run_config or {}).items():
            args += ["--run-config", f"{k}={_toml_value(v)}"]
        if federation_config:  # the simulation runtime's settings (num-supernodes, client resources, Ray)
            args += ["--federation-config", " ".join(f"{k}={_toml_value(v)}" for k, v in federation_config.items())]
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

    def logs_of(self, run_id: int) -> str:
        """The run's ServerApp log as the SuperLink stored it (``flwr log RUN --show``)."""
        return self.flwr("log", str(run_id), self.connection, "--show")


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


# --------------------------------------------------------------------------------------------------------------------
# `fedfuse flower-app`


def deployment_commands(app: str | Path, certs: Certificates, superlink: str, connection: str = DEFAULT_CONNECTION,
                        node: int = 0, node_data: str = "/path/to/node-0") -> dict[str, list[str]]:
    """The commands that start a two-machine federation: the SuperLink and ``flwr`` on machine A (where ``app``
    and ``certs`` are), one SuperNode on machine B (which needs ``ca.crt``, its node key and its own data —
    ``node_data``, e.g. a bundle of ``fedfuse export-partitions --nodes`` — copied over) with its warm ClientApp
    worker (``--isolation process``: the worker runs every message in one long-lived process)."""
    app = Path(app).resolve()
    port = superlink.rsplit(":", 1)[1]
    home = f"FLWR_HOME={app / '.flwr'}"
    auth = bool(certs.node_keys)
    link = (f"flower-superlink --ssl-ca-certfile {certs.ca_cert} --ssl-certfile {certs.server_cert} "
            f"--ssl-keyfile {certs.server_key} --host 0.0.0.0 --port {port} "
            "--disable-runtime-dependency-installation" + (" --enable-supernode-auth" if auth else ""))
    a = [link]
    if auth:
        a.append(f"{home} flwr supernode register {certs.node_keys[node][1]} {connection}")
    b = [f"flower-supernode --superlink {superlink} --root-certificates ca.crt"
         + (f" --auth-supernode-private-key {certs.node_keys[node][0].name}" if auth else "")
         + f" --isolation process --port 9094 --node-config \"data='{node_data}'\"",
         "python -m fedfuse.flower.worker --runtime-api-address 127.0.0.1:9094"]
    return {"A": a, "B": b, "run": [f"{home} flwr run {app} {connection} --stream"]}


def add_flower_app_parser(sub: Any) -> None:
    """Register ``fedfuse flower-app`` on the CLI's subparsers."""
    p = sub.add_parser("flower-app", help="write a Flower app (flwr run) for a config; print the deployment commands",
                       description="Write DIR/pyproject.toml (a Flower app whose ServerApp and ClientApp run the "
                                   "fedfuse experiment in CONFIG), DIR/.flwr/config.toml (the SuperLink connection "
                                   "for `flwr run`) and TLS certificates plus SuperNode keys, then print the "
                                   "commands that start a federation on two machines.")
    p.add_argument("dir", metavar="DIR", help="app directory to write")
    p.add_argument("--config", required=True, metavar="CONFIG.yaml", help="fedfuse config of the experiment")
    p.add_argument("--superlink", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help="address the SuperNodes and flwr use to reach the SuperLink (default %(default)s)")
    p.add_argument("--certificates", default=None, metavar="CERTDIR",
                   help="use the CA/server certificates and node keys in CERTDIR; generated there (for the "
                        "--superlink host) if CERTDIR/ca.crt is missing (default DIR/certs)")
    p.add_argument("--nodes", type=int, default=2, help="SuperNode key pairs to generate (0 = no node "
                   "authentication; default %(default)s)")
    p.add_argument("--out", default=None, help="output directory of the run on the SuperLink's machine")
    p.add_argument("--round-timeout", type=float, default=0.0,
                   help="seconds a round waits for replies before it continues without them (0 = forever)")
    p.add_argument("--min-nodes", type=int, default=1, help="SuperNodes to wait for before the first round")
    p.set_defaults(func=cmd_flower_app)


def cmd_flower_app(args: Any) -> int:
    """``fedfuse flower-app``: validate the config, write app + connection + certificates, print the commands."""
    import fedfuse.algorithms  # noqa: F401  (registers the algorithms the config is checked against)
    from fedfuse.config import ConfigError, RunConfig, apply, load_yaml, validate

    validate(apply(RunConfig(), load_yaml(args.config)))
    host = args.superlink.rsplit(":", 1)[0].strip("[]")
    cert_dir = (Path(args.certificates) if args.certificates else Path(args.dir) / "certs").resolve()
    if (cert_dir / "ca.crt").exists():
        names = certificate_hosts(cert_dir / "server.pem")
        if host not in names:
            raise ConfigError(f"certificates in {cert_dir}: server.pem is for {', '.join(names)}, not {host}; "
                              "give a new CERTDIR to generate certificates for it")
        keys = sorted(cert_dir.glob("node-*.pub"), key=lambda p: int(p.stem.split("-")[1]))
        certs = Certificates(cert_dir, cert_dir / "ca.crt", cert_dir / "ca.key", cert_dir / "server.pem",
                             cert_dir / "server.key", tuple((k.with_suffix(""), k) for k in keys))
    else:
        certs = make_certificates(cert_dir, hosts=[host], nodes=args.nodes)
    app = write_app(args.dir, args.config, superlink=args.superlink, root_certificates=certs.ca_cert,
                    out=args.out, round_timeout=args.round_timeout, min_nodes=args.min_nodes)
    cmds = deployment_commands(app, certs, args.superlink)
    auth = "with SuperNode authentication" if certs.node_keys else "without SuperNode authentication"
    print(f"Flower app written to {app} (certificates in {certs.dir.resolve()}, {auth}).\n"
          "fedfuse and flwr must be installed on both machines (pip install 'fedfuse[flower]').\n")
    print(f"Machine A (the SuperLink, reachable at {args.superlink}):")
    print("\n".join(f"  {c}" for c in cmds["A"]))
    copy = "ca.crt" + (f" and {certs.node_keys[0][0].name}" if certs.node_keys else "")
    print(f"\nMachine B (a SuperNode; copy {copy} from {certs.dir.resolve()} first, and its own data: e.g. node-0/ "
          "of `fedfuse export-partitions --nodes N --out DIR`, or a table/image folder with --node-config "
          "\"data='...' client-id=K\"):")
    print("\n".join(f"  {c}" for c in cmds["B"]))
    print("  (the second command is the warm ClientApp worker: it runs every message of the node in one process; "
          "without it, drop --isolation process and Flower starts a ClientApp process per message)")
    print("\nMachine A, once the SuperNodes are up (streams the ServerApp's log):")
    print("\n".join(f"  {c}" for c in cmds["run"]))
    if len(certs.node_keys) > 1:
        print(f"\nMore SuperNodes: register node-I.pub and start each with its node-I key (I < "
              f"{len(certs.node_keys)}).")
    return 0
