"""Deploy a fedfuse experiment on a real Flower federation (flwr 1.40-1.41 deployment runtime).

Two pieces, used by ``fedfuse flower-app`` and by :class:`~fedfuse.flower.federation.LocalFederation` (a local
federation of subprocesses, in its own module):

* :func:`make_certificates` — a CA, a TLS server certificate for the SuperLink (``127.0.0.1``/``localhost`` plus any
  hosts given) and, for SuperNode authentication, one EC P-384 key pair per SuperNode in OpenSSH format.
* :func:`write_app` — a Flower app project (``pyproject.toml``) whose ServerApp/ClientApp are fedfuse's, plus a
  SuperLink connection in ``DIR/.flwr/config.toml`` (flwr ≥ 1.40 reads connections from ``$FLWR_HOME/config.toml``,
  not from ``pyproject.toml``), so that ``FLWR_HOME=DIR/.flwr flwr run DIR <connection>`` submits the run.

How flwr 1.41 wires a deployment (read from ``flower-superlink --help`` / ``flower-supernode --help`` and flwr's CLI):
one SuperLink port (``--host``/``--port``) serves the Fleet, Control and Runtime HTTP APIs over TLS
(``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile``); a SuperNode dials it with ``--superlink HOST:PORT
--root-certificates CA`` and serves its own local Runtime API on ``--port``; with ``--enable-supernode-auth`` the
SuperLink only accepts SuperNodes whose public key was registered with ``flwr supernode register KEY.pub``, and a
SuperNode signs with ``--auth-supernode-private-key``.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import json
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
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


def toml_value(v: Any) -> str:
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
    lines = [f"[{name}]"] + [f"{_toml_key(k)} = {toml_value(v)}" for k, v in items.items()]
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
