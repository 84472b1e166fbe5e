"""A real Flower deployment on loopback: TLS SuperLink, two authenticated SuperNodes, ``flwr run``, a dead SuperNode.

The harness (:mod:`fedfuse.flower.deploy`) is exercised with a tiny Flower app written here: its ServerApp sends one
"train" message per round to every node and writes one JSON line per round (sent / replied / which nodes); its
ClientApp replies with its node id.  The round timeout is the app's dropout policy: a round completes with the
replies that arrived in time.
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

pytest.importorskip("flwr")

import fedfuse
from fedfuse.flower.deploy import LocalFederation, make_certificates, write_app

TINY_APP = '''
"""Tiny Flower app: ROUNDS rounds of "train" to all nodes; one JSON line per round in OUT/rounds.jsonl."""
import json
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    out = Path(str(cfg["out"]))
    out.mkdir(parents=True, exist_ok=True)
    timeout = float(cfg["round-timeout"]) or None
    nodes = sorted(grid.get_node_ids())
    with (out / "rounds.jsonl").open("w") as fh:
        for r in range(1, int(cfg["rounds"]) + 1):
            (out / "round").write_text(str(r))  # the round in flight, for the test that kills a node
            msgs = [Message(RecordDict({"cfg": ConfigRecord({"round": r})}), dst_node_id=n, message_type="train")
                    for n in nodes]
            t0 = time.monotonic()
            replies = list(grid.send_and_receive(msgs, timeout=timeout))
            ok = [m for m in replies if not m.has_error()]
            line = {"round": r, "sent": len(msgs), "replies": len(ok),
                    "nodes": sorted(int(m.content["res"]["node"]) for m in ok),
                    "rounds": sorted(int(m.content["res"]["round"]) for m in ok),
                    "seconds": round(time.monotonic() - t0, 2)}
            fh.write(json.dumps(line) + "\\n")
            fh.flush()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    res = ConfigRecord({"node": context.node_id, "round": int(msg.content["cfg"]["round"])})
    return Message(RecordDict({"res": res}), reply_to=msg)
'''


def _env() -> dict[str, str]:
    """PYTHONPATH for the Flower processes: this checkout's src (the editable install may point elsewhere)."""
    src = str(Path(fedfuse.__file__).resolve().parents[1])
    return {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}


def _tiny_app(tmp_path: Path, round_timeout: float) -> tuple[Path, Path]:
    app, out = tmp_path / "app", tmp_path / "out"
    app.mkdir()
    (app / "tinyapp.py").write_text(TINY_APP)
    write_app(app, None, serverapp="tinyapp:server_app", clientapp="tinyapp:client_app", out=out,
              round_timeout=round_timeout, run_config={"rounds": 3}, dependencies=["flwr>=1.40,<1.42"])
    return app, out


def _rounds(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


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
def _federation(tmp_path_factory: pytest.TempPathFactory):
    """One TLS SuperLink + two authenticated SuperNodes for the module (start-up costs ~15 s on 2 busy cores)."""
    with LocalFederation(tmp_path_factory.mktemp("fed"), nodes=2, auth=True, env=_env()) as fed:
        yield fed


@pytest.fixture
def federation(_federation: LocalFederation) -> LocalFederation:
    """The module's federation with every SuperNode running (a test that killed one gets it back)."""
    for i in range(_federation.num_nodes):
        _federation.restart(i)
    return _federation


def test_flwr_run_three_rounds_over_tls(federation: LocalFederation, tmp_path: Path) -> None:
    """flwr run on a TLS SuperLink with two registered SuperNodes: every round reaches and hears from both."""
    app, out = _tiny_app(tmp_path, round_timeout=120.0)
    run_id = federation.run(app)
    assert federation.wait(run_id, timeout=180) == "finished:completed"
    rounds = _rounds(out)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert r["sent"] == 2 and r["replies"] == 2
        assert r["nodes"] == sorted(federation.node_id)  # both authenticated SuperNodes answered
        assert r["rounds"] == [r["round"]] * 2  # each reply answers this round's message
    link_log = (federation.logs / "superlink.log").read_text()
    assert "SuperNode authentication is disabled" not in link_log


def test_dead_supernode_in_round_two_run_completes(federation: LocalFederation, tmp_path: Path) -> None:
    """SIGKILL one SuperNode while round 2 is in flight: round 2 closes at the timeout with the survivor's reply,
    round 3 runs with the survivor, and the run finishes."""
    timeout = 15.0  # a round takes 6-12 s here (Flower's 3 s polls on both sides, a ClientApp process per message)
    app, out = _tiny_app(tmp_path, round_timeout=timeout)
    run_id = federation.run(app)
    deadline = time.monotonic() + 120
    while not ((out / "round").exists() and (out / "round").read_text() == "2"):
        assert time.monotonic() < deadline, "round 2 never started"
        time.sleep(0.05)
    federation.kill(1)
    assert federation.wait(run_id, timeout=180) == "finished:completed"
    rounds = _rounds(out)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert rounds[0]["replies"] == 2 and rounds[0]["nodes"] == sorted(federation.node_id)
    for r in rounds[1:]:
        assert r["sent"] == 2  # the SuperLink still lists the dead node (missed heartbeats take ~1 min)
        assert r["nodes"] == [federation.node_id[0]]  # only the survivor answered
        assert r["seconds"] <= timeout + 6  # the round closed at its timeout (+ one 3 s poll), not never


def test_flower_app_command_writes_app_and_prints_commands(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`fedfuse flower-app DIR --config C` writes a valid Flower app whose run config points at a copy of C."""
    import tomllib

    from fedfuse.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("algorithm: fedavg\ndataset: digits\nrounds: 3\n")
    assert main(["flower-app", str(tmp_path / "app"), "--config", str(cfg), "--superlink", "10.0.0.5:9093",
                 "--certificates", str(tmp_path / "certs")]) == 0
    printed = capsys.readouterr().out
    pyproject = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())
    app = pyproject["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "fedfuse.flower.app:server_app",
                                 "clientapp": "fedfuse.flower.app:client_app"}
    copy = Path(app["config"]["fedfuse-config"])
    assert copy.read_text() == cfg.read_text() and copy.parent == (tmp_path / "app").resolve()
    conn = tomllib.loads((tmp_path / "app" / ".flwr" / "config.toml").read_text())["superlink"]
    assert conn["default"] == "fedfuse" and conn["fedfuse"]["address"] == "10.0.0.5:9093"
    assert Path(conn["fedfuse"]["root-certificates"]).read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    for command in ("flower-superlink", "flower-supernode", "flwr supernode register", "flwr run"):
        assert command in printed
    assert "10.0.0.5:9093" in printed and "--disable-runtime-dependency-installation" in printed
