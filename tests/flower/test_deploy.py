"""A real Flower deployment on loopback: TLS SuperLink, two authenticated SuperNodes, ``flwr run`` of fedfuse's app.

The deployment tests run fedfuse's own ServerApp/ClientApp (:mod:`fedfuse.flower.app`) for a 3-round FedAvg on
the bundled digits through real Flower processes, and compare the run's ``metrics.jsonl`` with the in-process
engine's.  Each SuperNode holds only its own client's data (a bundle of ``fedfuse export-partitions --nodes``)
and runs its messages in a warm ClientApp worker (``--isolation process`` + :mod:`fedfuse.flower.worker`); a round
still waits for Flower's 3 s SuperNode poll.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")

import fedfuse
from fedfuse.flower.deploy import make_certificates, write_app
from fedfuse.flower.federation import LocalFederation

CONFIG = """\
algorithm: fedavg
dataset: digits
clients: 2
clients_per_round: 2
rounds: 3
eval_every: 3
threads: 1
plots: false
seed: 3
model_options:
  widths: [16]
"""

def _env() -> dict[str, str]:
    """PYTHONPATH for the Flower processes: this checkout's src (the editable install may point elsewhere)."""
    src = str(Path(fedfuse.__file__).resolve().parents[1])
    return {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}


def _fedfuse_app(tmp_path: Path, round_timeout: float, min_nodes: int = 2, config: str = CONFIG) -> tuple[Path, Path]:
    """``fedfuse flower-app``'s project for ``config``: the ServerApp writes its run into ``out``."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config)
    out = tmp_path / "out"
    return write_app(tmp_path / "app", cfg, out=out, round_timeout=round_timeout, min_nodes=min_nodes), out


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _in_process(tmp_path: Path) -> list[dict]:
    """The same config run by fedfuse's in-process engine (sequential executor), as metrics.jsonl records."""
    from fedfuse.config import make_config
    from fedfuse.runner import experiment

    cfg = tmp_path / "config.yaml"
    experiment(make_config(str(cfg), out=str(tmp_path / "ref"), executor="sequential")).run()
    return _metrics(tmp_path / "ref")


def _finished(fed: LocalFederation, run_id: int, timeout: float) -> None:
    status = fed.wait(run_id, timeout=timeout)
    assert status == "finished:completed", (fed.logs / f"run-{run_id}.log").read_text()[-3000:]


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, host: str) -> str:
    """One TLS handshake over loopback; returns the TLS version (raises ssl.SSLError if the client rejects)."""
    with socket.create_server(("127.0.0.1", 0)) as srv, \
            socket.create_connection(("127.0.0.1", srv.getsockname()[1])) as raw:
        conn, _ = srv.accept()

        def serve() -> None:
            with contextlib.suppress(ssl.SSLError, OSError):
                server_ctx.wrap_socket(conn, server_side=True).close()

        t = threading.Thread(target=serve)
        t.start()
        try:
            with client_ctx.wrap_socket(raw, server_hostname=host) as tls:
                return str(tls.version())
        finally:
            t.join()
            conn.close()


def test_certificates_verify_loopback_server(tmp_path: Path) -> None:
    """The server certificate chains to the CA and names 127.0.0.1 and localhost (Python's TLS client verifies it
    against a TLS server using the generated key); another CA is rejected; node keys are OpenSSH EC P-384."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    certs = make_certificates(tmp_path / "certs", hosts=["10.1.2.3", "link.example"], nodes=2)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(certs.server_cert, certs.server_key)
    client_ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
    for host in ("127.0.0.1", "localhost", "10.1.2.3", "link.example"):
        assert _handshake(server_ctx, client_ctx, host) in ("TLSv1.2", "TLSv1.3")
    with pytest.raises(ssl.SSLCertVerificationError):  # a name the certificate does not carry
        _handshake(server_ctx, client_ctx, "10.9.9.9")
    other = ssl.create_default_context(cafile=str(make_certificates(tmp_path / "other").ca_cert))
    with pytest.raises(ssl.SSLCertVerificationError):  # a CA that did not sign it
        _handshake(server_ctx, other, "127.0.0.1")
    assert len(certs.node_keys) == 2
    for private, public in certs.node_keys:
        key = load_ssh_private_key(private.read_bytes(), None)
        pub = load_ssh_public_key(public.read_bytes())
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        assert key.public_key().public_numbers() == pub.public_numbers()
        assert oct(private.stat().st_mode & 0o777) == "0o600"


@pytest.fixture(scope="module")
def _bundles(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """CONFIG's two clients exported one per node (``fedfuse export-partitions --nodes 2``)."""
    from fedfuse.config import make_config
    from fedfuse.engine.loop import build_federation
    from fedfuse.flower.node_data import write_node_bundles

    root = tmp_path_factory.mktemp("bundles")
    (root / "config.yaml").write_text(CONFIG)
    return write_node_bundles(build_federation(make_config(str(root / "config.yaml"))), root / "nodes", 2)


@pytest.fixture(scope="module")
def _federation(tmp_path_factory: pytest.TempPathFactory, _bundles: list[Path]):
    """One TLS SuperLink + two authenticated SuperNodes for the module, deployed as docs/deploy.md does: the
    SuperLink on its own loopback port (runs are submitted there), the SuperNodes dialing the Fleet API gateway and
    running only bundles signed by the operator's key (``--trusted-entities``).  Each holds only its own client's
    data and is served by a warm ClientApp worker that records every file it opens (start-up ~15 s on 2 busy
    cores)."""
    root = tmp_path_factory.mktemp("fed")
    with LocalFederation(root, nodes=2, auth=True, env=_env(), warm=True, audit_open=True, gateway=True,
                         signed=True, node_config=[f"data='{b}'" for b in _bundles]) as fed:
        yield fed


@pytest.fixture
def federation(_federation: LocalFederation) -> LocalFederation:
    """The module's federation with every SuperNode running (a test that killed one gets it back)."""
    for i in range(_federation.num_nodes):
        _federation.restart(i)
    return _federation


def test_supernodes_with_an_unregistered_key_or_a_foreign_ca_are_refused(federation: LocalFederation,
                                                                       tmp_path: Path) -> None:
    """Node authentication and TLS are enforced: a SuperNode whose key was never registered is refused by the
    SuperLink, and one that trusts another CA refuses the SuperLink's certificate; both exit with an error."""
    import shutil
    import subprocess

    from fedfuse.flower.federation import free_port

    rogue = make_certificates(tmp_path / "rogue", nodes=1)
    assert federation.certs is not None
    cases = {"unregistered-key": (federation.certs.ca_cert, rogue.node_keys[0][0]),
             "foreign-ca": (rogue.ca_cert, federation.certs.node_keys[0][0])}
    procs = {}
    for name, (ca, key) in cases.items():
        with (tmp_path / f"{name}.log").open("wb") as log:
            procs[name] = subprocess.Popen(
                [shutil.which("flower-supernode") or "flower-supernode", "--superlink", federation.address,
                 "--root-certificates", str(ca), "--auth-supernode-private-key", str(key),
                 "--port", str(free_port()), "--max-retries", "1"],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **_env(), "FLWR_HOME": str(tmp_path / name)})
    for name, proc in procs.items():
        try:
            assert proc.wait(timeout=120) != 0, name
        finally:
            proc.kill()
    assert "SuperNode ID" not in (tmp_path / "unregistered-key.log").read_text()
    assert "No SuperNode found with the given public key" in (federation.logs / "superlink.log").read_text()
    assert "CERTIFICATE_VERIFY_FAILED" in (tmp_path / "foreign-ca.log").read_text()


@pytest.mark.slow
def test_fedfuse_app_three_rounds_over_tls_equals_in_process(federation: LocalFederation, tmp_path: Path) -> None:
    """flwr run of fedfuse's app on a TLS SuperLink with two registered SuperNodes: 3 FedAvg rounds, both clients
    answer every round, and metrics.jsonl equals the in-process engine's run of the same config (timing aside)."""
    from fedfuse.engine.loop import strip_timing

    app, out = _fedfuse_app(tmp_path, round_timeout=0.0)  # no timeout: every reply is waited for
    run_id = federation.run(app)
    _finished(federation, run_id, timeout=600)
    got = _metrics(out)
    assert [r["round"] for r in got] == [1, 2, 3]
    assert all(r["replied"] == 2 and r["dropped"] == [] for r in got)
    assert got[-1]["global_accuracy"] > 0.5 and got[-1]["personal_accuracy"] is not None
    assert [strip_timing(r) for r in got] == [strip_timing(r) for r in _in_process(tmp_path)]
    assert "SuperNode authentication is disabled" not in (federation.logs / "superlink.log").read_text()
    # each node's warm worker ran every message in one process and read only its own client's bundle
    for i, b in enumerate(federation.node_data):
        opened = [Path(p).resolve() for p in federation.opened(i)]
        other = federation.node_data[1 - i]
        assert any(p.is_relative_to(b) for p in opened) and not any(p.is_relative_to(other) for p in opened)
        assert "node data" in (federation.logs / f"worker-{i}.log").read_text()


@pytest.mark.slow
def test_fedfuse_app_survives_a_dead_supernode_in_round_two(federation: LocalFederation, tmp_path: Path) -> None:
    """SIGKILL the SuperNode serving client 1 as round 2 starts: round 2 closes at the round timeout with client 1
    a dropout, rounds 3 and the final evaluation run on the survivor, and the run completes."""
    timeout = 45.0  # a round takes 10-30 s here (a ClientApp process per message on 2 busy cores)
    # min-nodes 1: FlowerExecutor waits for min-nodes before *every* call (up to 120 s), so with 2 it would stall
    # each call once the dead node is offline.  Both SuperNodes are connected before the run is submitted.
    app, out = _fedfuse_app(tmp_path, round_timeout=timeout, min_nodes=1)
    run_id = federation.run(app)
    deadline = time.monotonic() + 400
    while not _metrics(out):  # round 1 written: round 2's messages are on their way
        assert time.monotonic() < deadline, (federation.logs / f"run-{run_id}.log").read_text()[-3000:]
        time.sleep(0.05)
    # node-local data: SuperNode 1 holds bundle node-1, i.e. client 1 (export-partitions --nodes puts c on c % n)
    assert federation.node_data[1].name == "node-1"
    federation.kill(1)
    _finished(federation, run_id, timeout=600)
    got = _metrics(out)
    assert [r["round"] for r in got] == [1, 2, 3]
    assert got[0]["replied"] == 2 and got[0]["dropped"] == []
    assert got[1]["replied"] == 1 and got[1]["dropped"] == [1]  # the dead node's client, nothing else
    assert 0 not in got[2]["dropped"] and got[2]["replied"] >= 1  # the survivor keeps training
    assert got[1]["seconds"] < timeout + 30  # round 2 ended at its timeout, not when the node came back
    assert got[-1]["global_accuracy"] is not None and got[-1]["total_dropped"] >= 1


SECAGG_CONFIG = CONFIG.replace("clients: 2\nclients_per_round: 2", "clients: 3\nclients_per_round: 3") \
    + "secagg: true\n"


@pytest.mark.slow
def test_secagg_plus_deployment_equals_the_run_without_it(tmp_path: Path) -> None:
    """secagg=true on the TLS deployment: every round runs SecAgg+ between three SuperNodes (fedfuse.flower.secure;
    fewer nodes are refused: a sum over one or two reveals them).  The run equals fedfuse's simulated SecAgg bit for
    bit (the same ring sum) and the run without secure aggregation within the fixed-point step (same accuracies
    here).  Its own federation of three devices, one client each, deployed like the module's."""
    import torch

    from fedfuse.config import make_config
    from fedfuse.engine.loop import build_federation
    from fedfuse.flower.node_data import write_node_bundles
    from fedfuse.runner import experiment

    (tmp_path / "bundle.yaml").write_text(SECAGG_CONFIG)
    bundles = write_node_bundles(build_federation(make_config(str(tmp_path / "bundle.yaml"))), tmp_path / "nodes", 3)
    app, out = _fedfuse_app(tmp_path, round_timeout=0.0, min_nodes=3, config=SECAGG_CONFIG)
    with LocalFederation(tmp_path / "fed", nodes=3, auth=True, env=_env(), warm=True, gateway=True, signed=True,
                         node_config=[f"data='{b}'" for b in bundles]) as federation:
        run_id = federation.run(app)
        _finished(federation, run_id, timeout=900)
    got = _metrics(out)
    assert [r["round"] for r in got] == [1, 2, 3]
    assert all(r["replied"] == 3 and r["secagg_nodes"] == 3 and r["secagg_clients"] == 3 for r in got)
    simulated = _in_process(tmp_path)  # the same config in-process: simulated SecAgg
    (tmp_path / "plain.yaml").write_text(SECAGG_CONFIG.replace("secagg: true\n", ""))
    experiment(make_config(str(tmp_path / "plain.yaml"), out=str(tmp_path / "plain"), executor="sequential")).run()
    plain = _metrics(tmp_path / "plain")
    for key in ("global_accuracy", "global_loss", "personal_accuracy", "train_loss"):
        assert [r.get(key) for r in got] == [r.get(key) for r in simulated], key
    for a, b in zip(got, plain, strict=True):
        assert abs((a.get("global_accuracy") or 0) - (b.get("global_accuracy") or 0)) <= 0.01
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-4)
    deployed = torch.load(out / "model_final.pt", weights_only=True)
    reference = torch.load(tmp_path / "plain" / "model_final.pt", weights_only=True)
    for k, v in reference["state"].items():
        if v.is_floating_point():
            assert torch.allclose(deployed["state"][k].double(), v.double(), atol=1e-5), k


def test_flower_app_command_writes_app_and_prints_commands(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`fedfuse flower-app DIR --config C` writes a valid Flower app whose run config points at a copy of C and
    declares `resume`, connects the operator's flwr to the SuperLink's loopback port, signs the exact bundle
    `flwr run` builds (verified by Flower's own check against the trusted-entities file it wrote for the
    devices) and prints the deployment's commands: SuperLink on loopback with a database, the gateway on the
    device-facing address, devices making their own keys and verifying bundles."""
    import tomllib

    import yaml
    from flwr.common.config import fuse_dicts
    from flwr.supercore.fab import Fab
    from flwr.supernode.start_client_internal import _verify_fab

    from fedfuse.cli import main
    from fedfuse.flower.deploy import build_fab
    from fedfuse.flower.gateway import verification_records

    cfg = tmp_path / "c.yaml"
    cfg.write_text("algorithm: fedavg\ndataset: digits\nrounds: 3\n")
    assert main(["flower-app", str(tmp_path / "app"), "--config", str(cfg), "--superlink", "10.0.0.5:9093",
                 "--certificates", str(tmp_path / "certs")]) == 0
    printed = capsys.readouterr().out
    from flwr.cli.config_utils import load_and_validate

    _, warnings = load_and_validate(tmp_path / "app" / "pyproject.toml")  # flwr's own check (imports the apps)
    assert warnings == []
    pyproject = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())
    app = pyproject["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "fedfuse.flower.app:server_app",
                                 "clientapp": "fedfuse.flower.app:client_app"}
    copy = Path(app["config"]["fedfuse-config"])
    assert copy.read_text() == cfg.read_text() and copy.parent == (tmp_path / "app").resolve()
    # what the SuperLink checks `--run-config` with: an undeclared key is refused ("Invalid run configuration")
    assert fuse_dicts(dict(app["config"]), {"resume": True}, check_keys=True)["resume"] is True
    with pytest.raises(ValueError, match="not present"):
        fuse_dicts(dict(app["config"]), {"resumee": True}, check_keys=True)
    conn = tomllib.loads((tmp_path / "app" / ".flwr" / "config.toml").read_text())["superlink"]
    assert conn["default"] == "fedfuse" and conn["fedfuse"]["address"] == "127.0.0.1:9091"
    assert Path(conn["fedfuse"]["root-certificates"]).read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    fab = build_fab(tmp_path / "app")  # the bundle `flwr run` uploads
    trusted = yaml.safe_load((tmp_path / "app" / "trusted-entities.yaml").read_text())
    records = verification_records(tmp_path / "app" / "signatures", fab)
    assert records["valid_license"] and _verify_fab(Fab("h", fab, records), trusted)
    assert not list((tmp_path / "certs").glob("node-*"))  # devices make their own keys
    for command in ("flower-superlink", "--host 127.0.0.1 --port 9091", "--database", "--enable-supernode-auth",
                    "python -m fedfuse.flower.gateway --listen 0.0.0.0:9093 --superlink 127.0.0.1:9091",
                    "flwr supernode register node-0.pub", "ssh-keygen -t ecdsa -b 384",
                    "python -m fedfuse.flower.supernode --worker --superlink 10.0.0.5:9093",
                    "--trusted-entities trusted-entities.yaml", "--isolation process", "--node-config \"data=",
                    "flwr run", "resume=true"):
        assert command in printed, command
    assert "--disable-runtime-dependency-installation" in printed and "0.0.0.0:909" not in printed.replace(
        "--listen 0.0.0.0:9093", "")


def test_app_bundle_holds_the_config_but_no_keys_or_outputs(tmp_path: Path) -> None:
    """What `flwr run` uploads (the FAB, built by flwr's own builder): pyproject and the config copy; not the
    certificates and keys, the CLI's connection file, or an output directory placed inside the app."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    app = write_app(tmp_path / "app", cfg, out=tmp_path / "app" / "runs" / "r1")
    make_certificates(app / "certs", nodes=1)
    (app / "runs" / "r1").mkdir(parents=True)
    (app / "runs" / "r1" / "metrics.jsonl").write_text("{}\n")
    names = set(zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app))).namelist())
    assert {"pyproject.toml", "fedfuse-config.yaml"} <= names
    assert not any(n.startswith(("certs/", ".flwr/", "runs/")) for n in names), names


# --------------------------------------------------------------------------------------------------------------------
# the trust model: only the operator submits runs; devices run only bundles the operator signed

PROBE_APP = '''\
"""A third-party Flower app: its ClientApp leaves a mark where it runs (what a payload on a device would do)."""
import json
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server_app = ServerApp()
client_app = ClientApp()


@client_app.query()
def payload(msg: Message, context: Context) -> Message:
    marks = Path(str(context.run_config["marks"]))
    (marks / f"ran-on-{context.node_id}").write_text("payload ran")
    return Message(RecordDict({"r": ConfigRecord({"ok": 1})}), reply_to=msg)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    nodes, deadline = [], time.time() + 60
    while len(nodes) < int(context.run_config["nodes"]) and time.time() < deadline:
        nodes = list(grid.get_node_ids())
        time.sleep(0.5)
    msgs = [Message(RecordDict({"q": ConfigRecord({"x": 1})}), dst_node_id=n, message_type="query") for n in nodes]
    replies = grid.send_and_receive(msgs, timeout=120)
    out = [{"node": r.metadata.src_node_id, "error": r.error.code if r.has_error() else None} for r in replies]
    (Path(str(context.run_config["marks"])) / "replies.json").write_text(json.dumps(out))
'''


def _probe_app(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A third-party app (not fedfuse's) whose ClientApp writes ``marks/ran-on-NODE``; returns (app, marks)."""
    marks = tmp_path / f"marks-{name}"
    marks.mkdir()
    app = write_app(tmp_path / name, None, serverapp="probe_app:server_app", clientapp="probe_app:client_app",
                    run_config={"marks": str(marks), "nodes": 2}, dependencies=("flwr",), name=f"probe-{name}")
    (app / "probe_app.py").write_text(PROBE_APP)
    return app, marks


def test_gateway_forwards_only_the_fleet_api() -> None:
    """The gateway's routes are flwr's Fleet router's (what a SuperNode calls) and nothing of the Control API
    (``flwr run``, ``flwr stop``, ``flwr supernode register``) or the Runtime API (the ServerApp's)."""
    from flwr.superlink.routers.control.router import router as control
    from flwr.superlink.routers.fleet.router import router as fleet

    from fedfuse.flower.gateway import fleet_routes

    routes = fleet_routes()
    assert {"/v1/fleet/register-node", "/v1/fleet/pull-messages", "/v1/fleet/push-messages",
            "/v1/fleet/get-fab", "/v1/fleet/pull-object", "/v1/fleet/push-object"} <= routes
    assert routes == {r.path for r in fleet.routes}
    control_paths = {r.path for r in control.routes}
    assert "/v1/control/start-run" in control_paths and not routes & control_paths
    assert all(r.startswith("/v1/fleet/") for r in routes)


def test_signature_records_verify_with_flowers_own_check(tmp_path: Path) -> None:
    """What a SuperNode started with --trusted-entities does with a bundle (flwr's own ``_verify_fab`` on the
    verifications the gateway attaches): the operator's signature verifies; an unsigned bundle, a signature by
    another key filed under the operator's key id, and the operator's genuine signature of another bundle do not."""
    import base64
    import hashlib

    import yaml
    from flwr.supercore.fab import Fab
    from flwr.supernode.start_client_internal import _verify_fab

    from fedfuse.flower.deploy import make_signing_key, public_key_id, sign_fab, write_trusted_entities
    from fedfuse.flower.gateway import attach_signatures, verification_records

    operator = make_signing_key(tmp_path / "op" / "key")
    trusted = yaml.safe_load(write_trusted_entities(tmp_path / "te.yaml", [operator]).read_text())
    assert list(trusted) == [public_key_id(operator)] and trusted[public_key_id(operator)].startswith("ssh-ed25519")
    assert oct((tmp_path / "op" / "key").stat().st_mode & 0o777) == "0o600"
    sigs = tmp_path / "sigs"
    fab, other = b"PK\x03\x04 the operator's bundle", b"PK\x03\x04 someone else's bundle"

    def verified(content: bytes) -> bool:
        records = verification_records(sigs, content)
        return bool(records.get("valid_license")) and _verify_fab(Fab("h", content, records), trusted)

    assert verification_records(sigs, fab) == {} and not verified(fab)  # unsigned: nothing attached
    path = sign_fab(fab, tmp_path / "op" / "key", sigs)
    assert verified(fab)
    # a replay: the operator's record for `fab` filed under `other`'s digest
    (sigs / f"{hashlib.sha256(other).hexdigest()}.json").write_text(path.read_text())
    assert not verified(other)
    # a forgery: an attacker's key signs `fab` and files the record under the operator's key id
    make_signing_key(tmp_path / "attacker" / "key")
    forged = sign_fab(fab, tmp_path / "attacker" / "key", tmp_path / "forged")
    rec = json.loads(forged.read_text())[0]
    rec["public_key_id"] = public_key_id(operator)
    path.write_text(json.dumps([rec]))
    assert base64.urlsafe_b64decode(rec["signature"] + "==") and not verified(fab)
    # the gateway replaces whatever verifications the SuperLink's reply carried with the operator's records
    from flwr.proto.fab_pb2 import Fab as ProtoFab
    from flwr.proto.fab_pb2 import GetFabResponse

    sign_fab(fab, tmp_path / "op" / "key", sigs)
    reply = GetFabResponse(fab=ProtoFab(hash_str="h", content=fab, verifications={"valid_license": "Valid",
                                                                                  "fpk_x": "{}"}))
    got = GetFabResponse.FromString(attach_signatures(reply.SerializeToString(), sigs)).fab
    assert set(got.verifications) == {"valid_license", public_key_id(operator)}


def test_warm_worker_serves_only_fedfuse_app_bundles(tmp_path: Path) -> None:
    """The bundle check of the warm worker: fedfuse's app (as `flwr run` builds it) passes; a third-party ClientApp,
    fedfuse's ClientApp name on a bundle that ships its own `fedfuse/flower/app.py` (shadowing the installed one),
    and a file that is not a bundle are refused."""
    import io
    import zipfile

    from fedfuse.flower.deploy import build_fab, check_fedfuse_bundle

    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    check_fedfuse_bundle(build_fab(write_app(tmp_path / "app", cfg)))
    probe, _ = _probe_app(tmp_path, "probe")
    with pytest.raises(PermissionError, match="its ClientApp is 'probe_app:client_app'"):
        check_fedfuse_bundle(build_fab(probe))
    shadow = write_app(tmp_path / "shadow", cfg)
    (shadow / "fedfuse" / "flower").mkdir(parents=True)
    (shadow / "fedfuse" / "flower" / "app.py").write_text("import os; os.system('echo owned')\n")
    with pytest.raises(PermissionError, match=r"carries code \(fedfuse/flower/app.py\)"):
        check_fedfuse_bundle(build_fab(shadow))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("README", "no pyproject")
    for junk in (b"not a zip", buf.getvalue()):
        with pytest.raises(PermissionError, match="not a fedfuse app bundle"):
            check_fedfuse_bundle(junk)


def _listening(port: int) -> list[str]:
    """Local addresses a TCP socket listens on at ``port`` (from /proc/net/tcp and tcp6)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                    out.append(addr)
    return out


def test_run_submission_on_the_device_facing_address_is_refused(federation: LocalFederation,
                                                                tmp_path: Path) -> None:
    """Anyone on the network holds ca.crt and reaches the device-facing address: `flwr run` of their own app there
    fails, and raw requests to the Control and Runtime APIs get 403 without reaching the SuperLink; the SuperLink
    itself listens on loopback only (the operator's address)."""
    import subprocess

    import httpx

    from fedfuse.flower.deploy import write_connection
    from fedfuse.flower.federation import _tool

    assert federation.certs is not None
    app, marks = _probe_app(tmp_path, "intruder")
    home = tmp_path / "intruder-home"
    write_connection(home, federation.address, federation.certs.ca_cert, "target")

    res = subprocess.run([_tool("flwr"), "run", str(app), "target"],
                         capture_output=True, text=True, env={**os.environ, **_env(), "FLWR_HOME": str(home)},
                         timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "Successfully started run" not in res.stdout
    tls = ssl.create_default_context(cafile=str(federation.certs.ca_cert))
    with httpx.Client(base_url=f"https://{federation.address}", verify=tls) as http:
        for path in ("/v1/control/start-run", "/v1/control/list-runs", "/v1/control/stop-run",
                     "/v1/control/register-supernode", "/v1/control/list-supernodes", "/docs", "/openapi.json"):
            r = http.post(path, content=b"", headers={"content-type": "application/protobuf"})
            assert r.status_code == 403, (path, r.status_code)
        assert http.get("/v1/control/list-runs").status_code == 403
    assert "refused POST /v1/control/start-run" in (federation.logs / "gateway.log").read_text()
    assert "probe-intruder" not in json.dumps(federation.flwr_json("list", federation.connection).get("runs", []))
    assert not any(marks.iterdir())
    assert _listening(federation.admin_port) == ["0100007F"]  # 127.0.0.1, nothing else


@pytest.mark.slow
def test_devices_run_only_bundles_the_operator_signed(federation: LocalFederation, tmp_path: Path) -> None:
    """Even a run that reaches the SuperLink (an attacker on the server host) runs nothing on the devices unless
    the operator's key signed its bundle: an unsigned bundle, one signed by another key under the operator's key
    id, and one carrying the operator's signature of another bundle are refused by every SuperNode (Flower's
    INVALID_FAB reply; the ClientApp never runs).  The same third-party app signed by the operator passes the
    SuperNodes' check and is then refused by the warm workers, which run fedfuse's app only; fedfuse's signed
    app runs on both devices in the other deployment tests of this module."""
    import hashlib

    from flwr.common.constant import ErrorCode

    from fedfuse.flower.deploy import build_fab, make_signing_key, public_key_id, sign_fab

    def submit(app: Path, sign: bool) -> list[dict]:
        run_id = federation.run(app, sign=sign)
        _finished(federation, run_id, timeout=300)
        return json.loads((Path(str(app)).parent / f"marks-{app.name}" / "replies.json").read_text())

    unsigned, marks = _probe_app(tmp_path, "unsigned")
    forged, forged_marks = _probe_app(tmp_path, "forged")
    make_signing_key(tmp_path / "attacker")
    record = json.loads(sign_fab(build_fab(forged), tmp_path / "attacker", tmp_path / "scratch").read_text())[0]
    operator = federation.signing_key.with_name(federation.signing_key.name + ".pub").read_text()
    record["public_key_id"] = public_key_id(operator)  # the attacker's signature, filed as the operator's
    (federation.signatures / f"{hashlib.sha256(build_fab(forged)).hexdigest()}.json").write_text(json.dumps([record]))
    replayed, replayed_marks = _probe_app(tmp_path, "replayed")
    genuine = federation.sign(_probe_app(tmp_path, "decoy")[0])
    (federation.signatures / f"{hashlib.sha256(build_fab(replayed)).hexdigest()}.json").write_text(
        genuine.read_text())
    for app, m in ((unsigned, marks), (forged, forged_marks), (replayed, replayed_marks)):
        replies = submit(app, sign=False)
        assert len(replies) == 2 and all(r["error"] == ErrorCode.INVALID_FAB for r in replies), (app.name, replies)
        assert not any(p.name.startswith("ran-on") for p in m.iterdir()), app.name
    logs = "".join((federation.logs / f"supernode-{i}.log").read_text() for i in range(2))
    assert "FAB verification failed" in logs and "could not be verified" in logs
    signed, signed_marks = _probe_app(tmp_path, "signed")
    replies = submit(signed, sign=True)
    assert [r["error"] for r in replies] == [ErrorCode.CLIENT_APP_RAISED_EXCEPTION] * 2  # the worker's refusal
    assert not any(p.name.startswith("ran-on") for p in signed_marks.iterdir())
    workers = "".join((federation.logs / f"worker-{i}.log").read_text() for i in range(2))
    assert workers.count("not a fedfuse app: its ClientApp is 'probe_app:client_app'") >= 2


def test_supernode_launcher_worker_exits_with_its_supernode(tmp_path: Path) -> None:
    """`python -m fedfuse.flower.supernode --worker` (the documented device command) runs the SuperNode and its
    warm worker; a SuperNode that dies without a goodbye (SIGKILL) takes its worker with it (no orphan)."""
    import signal
    import subprocess
    import sys

    from fedfuse.flower.federation import _tree, free_port

    cmd = [sys.executable, "-m", "fedfuse.flower.supernode", "--worker", "--superlink", f"127.0.0.1:{free_port()}",
           "--insecure", "--isolation", "process", "--port", str(free_port())]  # no SuperLink: it keeps retrying
    with (tmp_path / "node.log").open("wb") as log:
        node = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **_env(), "FLWR_HOME": str(tmp_path)})
    try:
        deadline, workers = time.monotonic() + 120, []
        while not workers:
            assert node.poll() is None and time.monotonic() < deadline, (tmp_path / "node.log").read_text()
            workers = [p for p in _tree(node.pid)[1:]
                       if b"fedfuse.flower.worker" in Path(f"/proc/{p}/cmdline").read_bytes()]
            time.sleep(0.5)
        assert f"--parent-pid\x00{node.pid}".encode() in Path(f"/proc/{workers[0]}/cmdline").read_bytes()
    finally:
        node.send_signal(signal.SIGKILL)
        node.wait()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{workers[0]}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{workers[0]}").exists(), "the worker outlived its SuperNode"


def test_keys_made_with_ssh_keygen_serve_as_device_and_signing_keys(tmp_path: Path) -> None:
    """The documented key steps: a device's `ssh-keygen -t ecdsa -b 384` key is what flower-supernode's
    --auth-supernode-private-key accepts (its own loader), and its .pub what `flwr supernode register` reads; an
    operator's own `ssh-keygen -t ed25519` key given as --signing-key signs the app the devices verify."""
    import argparse
    import shutil
    import subprocess

    import yaml
    from cryptography.hazmat.primitives.serialization import load_ssh_public_key
    from flwr.supercore.fab import Fab
    from flwr.supernode.cli.flower_supernode import _try_setup_client_authentication
    from flwr.supernode.start_client_internal import _verify_fab

    from fedfuse.flower.deploy import build_fab, prepare_deployment
    from fedfuse.flower.gateway import verification_records

    keygen = shutil.which("ssh-keygen")
    if keygen is None:
        pytest.skip("ssh-keygen not installed")
    for kind, name in ((["-t", "ecdsa", "-b", "384"], "node-0"), (["-t", "ed25519"], "operator")):
        subprocess.run([keygen, *kind, "-N", "", "-q", "-f", str(tmp_path / name)], check=True)
    keys = _try_setup_client_authentication(argparse.Namespace(auth_supernode_private_key=str(tmp_path / "node-0"),
                                                               auth_supernode_public_key=None))
    assert keys is not None and keys[0].curve.name == "secp384r1"
    assert load_ssh_public_key((tmp_path / "node-0.pub").read_bytes()).public_numbers() == \
        keys[1].public_numbers()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    d = prepare_deployment(tmp_path / "app", cfg, "10.0.0.5:9093", signing_key=tmp_path / "operator")
    trusted = yaml.safe_load(d.trusted_entities.read_text())
    assert list(trusted.values()) == [" ".join((tmp_path / "operator.pub").read_text().split()[:2])]
    fab = build_fab(d.app)
    assert _verify_fab(Fab("h", fab, verification_records(d.signatures, fab)), trusted)
