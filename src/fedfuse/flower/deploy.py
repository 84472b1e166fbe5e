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

The deployment :func:`prepare_deployment` writes (``fedfuse flower-app``; who is trusted with what: docs/deploy.md,
*Trust model*): no flag authenticates a Control API caller, so the SuperLink listens on the server's loopback and
devices dial :mod:`fedfuse.flower.gateway`, which forwards the Fleet API only; the app bundle is signed at build
(:func:`sign_fab`, Ed25519 as ``flwr app review`` signs) and devices run ``flower-supernode --trusted-entities``
with the operator's public key (:func:`write_trusted_entities`); the warm worker runs fedfuse's bundles only
(:func:`check_fedfuse_bundle`).
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
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
DEFAULT_ADMIN_PORT = 9091  # the SuperLink's own port, on loopback only: the Control API (runs) lives there
TRUSTED_ENTITIES = "trusted-entities.yaml"
SIGNING_KEY = "operator-signing"
#: ``fedfuse flower-app --round-timeout``'s default: about twice the first round measured for docs/deploy.md's study
#: (283 s on a device with 2 clients of MNIST, default CNN, one thread, on a loaded machine; benchmarks/first_round.py)
DEFAULT_ROUND_TIMEOUT = 600.0


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


def make_signing_key(path: str | Path) -> str:
    """Write an Ed25519 key pair in OpenSSH format, ``path`` (private, 0600) and ``path.pub`` — the key that signs
    app bundles (what ``flwr app review`` signs with; ``ssh-keygen -t ed25519`` makes the same).  Returns the
    public key line."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = ed25519.Ed25519PrivateKey.generate()
    _write_private(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode() + " fedfuse-operator"
    path.with_name(path.name + ".pub").write_text(public + "\n")
    return public


def signing_public_key(private_key: str | Path) -> str:
    """The OpenSSH public key line of an Ed25519 OpenSSH private key (what ``--trusted-entities`` lists)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = serialization.load_ssh_private_key(Path(private_key).read_bytes(), None)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ValueError(f"{private_key}: not an Ed25519 key (flower-supernode --trusted-entities needs Ed25519)")
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def public_key_id(public_line: str) -> str:
    """The id a signing key is listed under in ``--trusted-entities`` (``fpk_`` + a digest of the key)."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_ssh_public_key(public_line.strip().encode())
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "fpk_" + hashlib.sha256(raw).hexdigest()[:32]


def write_trusted_entities(path: str | Path, public_lines: Sequence[str]) -> Path:
    """The YAML file of ``flower-supernode --trusted-entities``: key id -> ``ssh-ed25519 ...`` public key."""
    import yaml

    path = Path(path)
    path.write_text(yaml.safe_dump({public_key_id(line): line.strip() for line in public_lines}, sort_keys=True))
    return path


def sign_fab(fab: bytes, private_key: str | Path, signatures: str | Path) -> Path:
    """Sign an app bundle with an Ed25519 OpenSSH private key and add the record to ``signatures/<sha256>.json``.

    The record is Flower's (``flwr app review``): ``signature`` = Ed25519 over the 8-byte big-endian ``signed_at``
    followed by SHA-256 of the bundle, base64url; the gateway (:mod:`fedfuse.flower.gateway`) hands it to the
    SuperNodes with the bundle and a SuperNode with ``--trusted-entities`` verifies it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = serialization.load_ssh_private_key(Path(private_key).read_bytes(), None)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ValueError(f"{private_key}: not an Ed25519 key (flower-supernode --trusted-entities needs Ed25519)")
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    signed_at = int(_dt.datetime.now(_dt.UTC).timestamp())
    digest = hashlib.sha256(fab).digest()
    signature = key.sign(signed_at.to_bytes(8, "big") + digest)
    record = {"public_key_id": public_key_id(public.decode()), "signed_at": signed_at,
              "signature": base64.urlsafe_b64encode(signature).rstrip(b"=").decode("ascii")}
    out = Path(signatures)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{digest.hex()}.json"
    have = [r for r in (json.loads(path.read_text()) if path.exists() else [])
            if r["public_key_id"] != record["public_key_id"]]
    path.write_text(json.dumps([*have, record], indent=1) + "\n")
    return path


def build_fab(app: str | Path) -> bytes:
    """The app bundle ``flwr run APP`` uploads (flwr's own deterministic builder: same files, same bytes)."""
    from flwr.cli.build import build_fab_from_disk

    return build_fab_from_disk(Path(app))


#: Files a bundle must not carry to pass as a fedfuse app: code that would run, or shadow fedfuse, on a device.
CODE_SUFFIXES = (".py", ".pyc", ".pyd", ".pyi", ".so", ".pth", ".dylib", ".dll", ".whl", ".egg", ".zip")


def installed_fedfuse() -> str:
    """The installed fedfuse's version (its package metadata; ``0+unknown`` for a source tree on ``sys.path``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedfuse")
    except PackageNotFoundError:
        return "0+unknown"


def fedfuse_requirement() -> str:
    """The app's requirement on fedfuse: this fedfuse's exact version (``fedfuse==0.1.0``), which every device must
    run — the operator's wheel (docs/deploy.md, *Installing fedfuse on a device*)."""
    found = installed_fedfuse()
    return "fedfuse" if found == "0+unknown" else f"fedfuse=={found}"


def check_fedfuse_bundle(fab: bytes) -> None:
    """Refuse (``PermissionError``) an app bundle that is not a fedfuse app: its ClientApp must be fedfuse's
    (``fedfuse.flower.app:...``, run from the installed fedfuse), it may carry no code (a module of its own, or
    one that would shadow fedfuse's), and a ``fedfuse==VERSION`` requirement must name the installed version (a
    device running other fedfuse code would not compute what the operator's run computes).  The warm worker checks
    every bundle before installing it."""
    import io
    import tomllib
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(fab)) as z:
            names = z.namelist()
            project = tomllib.loads(z.read("pyproject.toml").decode())
            components = project["tool"]["flwr"]["app"]["components"]
    except (zipfile.BadZipFile, KeyError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise PermissionError(f"not a fedfuse app bundle: {e}") from None
    for dep in project.get("project", {}).get("dependencies", []):
        pinned = re.fullmatch(r"\s*fedfuse\s*==\s*([^\s;,]+)\s*", str(dep))
        if pinned and pinned.group(1) != installed_fedfuse():
            raise PermissionError(f"the app was built for fedfuse {pinned.group(1)}, and this device runs fedfuse "
                                  f"{installed_fedfuse()}: install the operator's wheel (pip install "
                                  f"'fedfuse-{pinned.group(1)}-py3-none-any.whl[flower]')")
    client = str(components.get("clientapp", ""))
    if not client.startswith("fedfuse.flower.app:"):
        raise PermissionError(f"not a fedfuse app: its ClientApp is {client!r}")
    code = [n for n in names if n.lower().endswith(CODE_SUFFIXES)]
    if code:
        raise PermissionError(f"not a fedfuse app: the bundle carries code ({', '.join(sorted(code)[:5])})")


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
              dependencies: Sequence[str] | None = None) -> Path:
    """Write a Flower app project into ``dir`` and a SuperLink connection into ``dir/.flwr``; returns ``dir``.

    ``pyproject.toml`` names fedfuse's ServerApp and ClientApp and carries ``[tool.flwr.app.config]``:
    ``fedfuse-config`` (absolute path of a copy of ``config_path`` written to ``dir/fedfuse-config.yaml``; the
    ServerApp reads it on the SuperLink's machine), ``out`` (run directory there), ``round-timeout`` (seconds each
    round waits for replies; 0 = forever) and ``min-nodes`` (SuperNodes to wait for before round 1), plus
    ``run_config``.  ``config_path=None`` writes no fedfuse config (for other apps).  ``.gitignore`` keeps
    ``.flwr/``, ``certs/`` and an ``out`` inside ``dir`` out of the bundle ``flwr run`` uploads (and out of git).
    ``dependencies`` default to this fedfuse's exact version (:func:`fedfuse_requirement`) and Flower.
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
    if config_path is not None:  # `flwr run ... --run-config 'resume=true'` continues from the last checkpoint
        cfg["resume"] = False
    cfg.update(run_config or {})
    if dependencies is None:
        dependencies = (fedfuse_requirement(), FLOWER_REQUIREMENT)
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
    # flwr run builds the app bundle from DIR minus .gitignore: no keys, no state, no signatures, no outputs
    ignore = [".flwr/", "certs/", "signatures/", "state/", TRUSTED_ENTITIES]
    if out and Path(out).resolve().is_relative_to(app):
        ignore.append(Path(out).resolve().relative_to(app).as_posix() + "/")
    gitignore = app / ".gitignore"
    have = gitignore.read_text().splitlines() if gitignore.exists() else []
    gitignore.write_text("\n".join(have + [line for line in ignore if line not in have]) + "\n")
    return app


# --------------------------------------------------------------------------------------------------------------------
# `fedfuse flower-app`


@dataclass(frozen=True)
class Deployment:
    """What ``fedfuse flower-app`` wrote: the app, its certificates and the trust files around it."""

    app: Path
    certs: Certificates
    superlink: str  # device-facing HOST:PORT (the gateway)
    admin_port: int  # the SuperLink's loopback port (Control API: runs are submitted there)
    signing_key: Path  # the operator's Ed25519 key; its .pub is in the trusted entities
    trusted_entities: Path
    signatures: Path
    database: Path
    connection: str = DEFAULT_CONNECTION


def deployment_commands(d: Deployment, node: str = "node-0", node_data: str = "/data/node-0") -> dict[str, list[str]]:
    """The commands of a deployment, by machine: ``A`` (server: SuperLink on loopback, the device-facing gateway,
    the registration of a device's public key), ``B`` (a device: its own key, then one command that runs the
    SuperNode — verifying bundles against the operator's key — and its warm ClientApp worker) and ``run``."""
    app, certs = d.app.resolve(), d.certs
    home = f"FLWR_HOME={app / '.flwr'}"
    tls = f"--ssl-ca-certfile {certs.ca_cert} --ssl-certfile {certs.server_cert} --ssl-keyfile {certs.server_key}"
    port = d.superlink.rsplit(":", 1)[1]
    a = [f"flower-superlink {tls} --host 127.0.0.1 --port {d.admin_port} --database {d.database} "
         "--disable-runtime-dependency-installation --enable-supernode-auth",
         f"python -m fedfuse.flower.gateway --listen 0.0.0.0:{port} --superlink 127.0.0.1:{d.admin_port} {tls} "
         f"--signatures {d.signatures}",
         f"{home} flwr supernode register {node}.pub {d.connection}"]
    b = [f"ssh-keygen -t ecdsa -b 384 -N '' -f {node}",
         f"python -m fedfuse.flower.supernode --worker --superlink {d.superlink} --root-certificates ca.crt "
         f"--trusted-entities {TRUSTED_ENTITIES} --auth-supernode-private-key {node} --isolation process "
         f"--port 9094 --node-config \"data='{node_data}'\""]
    return {"A": a, "B": b, "run": [f"{home} flwr run {app} {d.connection} --stream"]}


def prepare_deployment(dir: str | Path, config: str | Path, superlink: str, *, admin_port: int = DEFAULT_ADMIN_PORT,
                       certificates: str | Path | None = None, signing_key: str | Path | None = None,
                       nodes: int = 0, **app_options: Any) -> Deployment:
    """Write the app (:func:`write_app`, connected to the SuperLink's loopback ``admin_port``), TLS certificates
    for the ``superlink`` host (reused if ``certificates`` has them), the operator's signing key (generated if
    missing), ``trusted-entities.yaml`` for the devices, and sign the app bundle exactly as ``flwr run`` will
    build it.  ``nodes`` > 0 also generates that many SuperNode key pairs here (trying it on one machine; real
    devices make their own)."""
    from fedfuse.config import ConfigError

    host = superlink.rsplit(":", 1)[0].strip("[]")
    app_dir = Path(dir).resolve()
    cert_dir = (Path(certificates) if certificates else app_dir / "certs").resolve()
    if (cert_dir / "ca.crt").exists():
        names = certificate_hosts(cert_dir / "server.pem")
        if host not in names:
            raise ConfigError(f"certificates in {cert_dir}: server.pem is for {', '.join(names)}, not {host}; "
                              "give a new CERTDIR to generate certificates for it")
        keys = sorted(cert_dir.glob("node-*.pub"), key=lambda p: int(p.stem.split("-")[1]))
        certs = Certificates(cert_dir, cert_dir / "ca.crt", cert_dir / "ca.key", cert_dir / "server.pem",
                             cert_dir / "server.key", tuple((k.with_suffix(""), k) for k in keys))
    else:
        certs = make_certificates(cert_dir, hosts=[host], nodes=nodes)
    key = Path(signing_key).resolve() if signing_key else cert_dir / SIGNING_KEY
    if not key.exists():
        make_signing_key(key)
    app = write_app(app_dir, config, superlink=f"127.0.0.1:{admin_port}", root_certificates=certs.ca_cert,
                    **app_options)
    trusted = write_trusted_entities(app / TRUSTED_ENTITIES, [signing_public_key(key)])
    sign_fab(build_fab(app), key, app / "signatures")
    (app / "state").mkdir(exist_ok=True)  # the SuperLink's --database (kept out of the bundle by .gitignore)
    return Deployment(app, certs, superlink, admin_port, key, trusted, app / "signatures",
                      app / "state" / "superlink.db")


def add_flower_app_parser(sub: Any) -> None:
    """Register ``fedfuse flower-app`` on the CLI's subparsers."""
    p = sub.add_parser("flower-app", help="write and sign a Flower app (flwr run) for a config; print the "
                       "deployment commands",
                       description="Write DIR/pyproject.toml (a Flower app whose ServerApp and ClientApp run the "
                                   "fedfuse experiment in CONFIG), DIR/.flwr/config.toml (the operator's "
                                   "connection to the SuperLink's loopback port), TLS certificates, the operator's "
                                   "signing key, DIR/trusted-entities.yaml for the devices and the app bundle's "
                                   "signature, then print the commands of the deployment.  Run it again after "
                                   "changing anything in DIR: devices run only the bundle that was signed.")
    p.add_argument("dir", metavar="DIR", help="app directory to write")
    p.add_argument("--config", required=True, metavar="CONFIG.yaml", help="fedfuse config of the experiment")
    p.add_argument("--superlink", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help="device-facing address of the server (the Fleet API gateway; default %(default)s)")
    p.add_argument("--admin-port", type=int, default=DEFAULT_ADMIN_PORT,
                   help="the SuperLink's port on the server's loopback, where runs are submitted "
                        "(default %(default)s)")
    p.add_argument("--certificates", default=None, metavar="CERTDIR",
                   help="use the CA/server certificates in CERTDIR; generated there (for the --superlink host) if "
                        "CERTDIR/ca.crt is missing (default DIR/certs)")
    p.add_argument("--signing-key", default=None, metavar="KEY",
                   help="the operator's Ed25519 OpenSSH key that signs the app (generated if missing; default "
                        "CERTDIR/operator-signing)")
    p.add_argument("--nodes", type=int, default=0, help="also generate this many SuperNode key pairs here, for a "
                   "trial on one machine (default %(default)s: each device makes its own with ssh-keygen)")
    p.add_argument("--out", default=None, help="output directory of the run on the SuperLink's machine")
    p.add_argument("--round-timeout", type=float, default=DEFAULT_ROUND_TIMEOUT,
                   help="seconds a round waits for replies before it continues without them (0 = forever; default "
                        "%(default)s: twice a device's measured first round, docs/deploy.md 'Round timeout')")
    p.add_argument("--min-nodes", type=int, default=1, help="SuperNodes to wait for before the first round")
    p.set_defaults(func=cmd_flower_app)


def cmd_flower_app(args: Any) -> int:
    """``fedfuse flower-app``: validate the config, write and sign the app, print the commands."""
    import fedfuse.algorithms  # noqa: F401  (registers the algorithms the config is checked against)
    from fedfuse.config import RunConfig, apply, load_yaml, validate

    validate(apply(RunConfig(), load_yaml(args.config)))
    d = prepare_deployment(args.dir, args.config, args.superlink, admin_port=args.admin_port,
                           certificates=args.certificates, signing_key=args.signing_key, nodes=args.nodes,
                           out=args.out, round_timeout=args.round_timeout, min_nodes=args.min_nodes)
    cmds = deployment_commands(d)
    print(f"Flower app written to {d.app} and signed with {d.signing_key} (certificates in {d.certs.dir}).\n"
          "fedfuse and flwr must be installed on every machine (pip install 'fedfuse[flower]').\n")
    print(f"Server (the SuperLink on 127.0.0.1:{d.admin_port}, runs are submitted there only; devices reach the "
          f"gateway at {d.superlink}, which serves the Fleet API alone); register each device's public key:")
    print("\n".join(f"  {c}" for c in cmds["A"]))
    print(f"\nEach device (copy ca.crt and {TRUSTED_ENTITIES} from the server, and its own data only: e.g. node-0/ "
          "of `fedfuse export-partitions --nodes N --out DIR`). It makes its own key and sends only node-0.pub to "
          "the operator; the second command runs the SuperNode and its warm ClientApp worker, which exits with it:")
    print("\n".join(f"  {c}" for c in cmds["B"]))
    print("\nServer, once the devices are up (streams the ServerApp's log; add --run-config 'resume=true' to "
          "continue a run from its last checkpoint):")
    print("\n".join(f"  {c}" for c in cmds["run"]))
    if d.certs.node_keys:
        print(f"\nNode key pairs for a trial on this machine: {d.certs.dir}/node-I(.pub), I < "
              f"{len(d.certs.node_keys)}.")
    return 0
