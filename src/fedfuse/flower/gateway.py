"""The device-facing front of a SuperLink: Flower's Fleet API only, and the operator's signatures on app bundles.

A flwr 1.41 SuperLink serves three HTTP APIs on **one** port (``--host``/``--port``; ``--control-api-address`` is
deprecated): the Fleet API (``/v1/fleet/...``, what SuperNodes call), the Control API (``/v1/control/...``, what
``flwr run``/``flwr stop``/``flwr supernode register`` call) and the Runtime API (what the ServerApp calls).  TLS
authenticates the SuperLink and ``--enable-supernode-auth`` authenticates SuperNodes on the Fleet API, but no flag
authenticates a Control API caller: whoever reaches that port with ``ca.crt`` can submit a run whose ServerApp runs
on the server host and whose ClientApp runs on every device.

So the SuperLink listens on loopback only (``--host 127.0.0.1``: runs are submitted on the server host, or through
an SSH tunnel to it) and devices reach it through this gateway, which

* terminates TLS with the SuperLink's server certificate (devices keep their ``--root-certificates ca.crt``),
* forwards exactly the Fleet API's routes (``POST /v1/fleet/<rpc>``, the routes of flwr's own Fleet router) to the
  SuperLink, headers and body untouched (SuperNode authentication stays end to end: the SuperLink checks each
  request's signature), and answers everything else — the Control and Runtime APIs, ``/docs``, ``/health`` — with
  403 without contacting the SuperLink,
* attaches the operator's signature records to ``get-fab`` replies: ``SIGNATURES/<sha256 of the bundle>.json``
  (written by :func:`fedfuse.flower.deploy.sign_fab` when ``fedfuse flower-app`` builds the app).  A SuperNode
  started with ``--trusted-entities`` verifies them with Flower's own check (Ed25519 over the bundle's digest, the
  scheme of ``flwr app review``) and refuses a bundle without a valid signature by a listed key.  The gateway
  holds no key: it cannot sign, only pass on what the operator signed.

    python -m fedfuse.flower.gateway --listen 0.0.0.0:9093 --superlink 127.0.0.1:9091 \\
        --ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key --signatures APP/signatures
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("fedfuse.gateway")

FLEET_PREFIX = "/v1/fleet/"
#: Headers that describe one HTTP hop, not the request: never forwarded.
HOP_HEADERS = frozenset({"host", "connection", "keep-alive", "proxy-connection", "te", "trailer",
                         "transfer-encoding", "upgrade", "content-length", "content-encoding"})


def fleet_routes() -> frozenset[str]:
    """The paths of flwr's Fleet API (``/v1/fleet/register-node``, ...), read from flwr's own Fleet router."""
    from flwr.superlink.routers.fleet.router import router

    paths = {getattr(r, "path", "") for r in router.routes}
    return frozenset(p for p in paths if p.startswith(FLEET_PREFIX))


def verification_records(signatures: Path | None, fab: bytes) -> dict[str, str]:
    """The ``Fab.verifications`` of a bundle as Flower's SuperLink fills them for a signed Hub app: one JSON
    entry ``{"signature", "signed_at"}`` per signing key id plus ``valid_license``; ``{}`` when unsigned."""
    if signatures is None:
        return {}
    path = signatures / f"{hashlib.sha256(fab).hexdigest()}.json"
    if not path.is_file():
        return {}
    records = json.loads(path.read_text())
    out = {str(r["public_key_id"]): json.dumps({"signature": r["signature"], "signed_at": int(r["signed_at"])})
           for r in records}
    out["valid_license"] = "Valid"
    return out


def attach_signatures(body: bytes, signatures: Path | None) -> bytes:
    """A serialized ``GetFabResponse`` with the operator's signature records of its bundle (replacing any the
    SuperLink sent: only the operator's signatures count here)."""
    from flwr.proto.fab_pb2 import GetFabResponse

    res = GetFabResponse.FromString(body)
    res.fab.verifications.clear()
    res.fab.verifications.update(verification_records(signatures, res.fab.content))
    return res.SerializeToString()


class FleetGateway:
    """An ASGI app forwarding the Fleet API to ``upstream`` (``https://host:port``) and refusing everything else."""

    def __init__(self, upstream: str, *, ca_certfile: str | Path | None = None, signatures: str | Path | None = None,
                 timeout: float = 600.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.ca_certfile = ca_certfile
        self.signatures = Path(signatures).resolve() if signatures else None
        self.timeout = timeout
        self.routes = fleet_routes()
        self.refused = 0
        self._client: Any = None

    def client(self) -> Any:
        """The ``httpx.AsyncClient`` to the SuperLink (created in the server's event loop, kept alive)."""
        if self._client is None:
            import httpx

            verify: Any = ssl.create_default_context(cafile=str(self.ca_certfile)) if self.ca_certfile else False
            self._client = httpx.AsyncClient(base_url=self.upstream, verify=verify, timeout=self.timeout)
        return self._client

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                event = await receive()
                if event["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif event["type"] == "lifespan.shutdown":
                    if self._client is not None:
                        await self._client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method != "POST" or path not in self.routes:
            self.refused += 1
            log.warning("refused %s %s from %s (not a Fleet API route)", method, path, scope.get("client"))
            await _respond(send, 403, b'{"detail":"Only the Fleet API is served on this address"}',
                           [(b"content-type", b"application/json")])
            return
        body = b""
        while True:
            event = await receive()
            body += event.get("body", b"")
            if not event.get("more_body"):
                break
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in HOP_HEADERS]
        try:
            res = await self.client().post(path, content=body, headers=headers)
        except Exception as ex:  # the SuperLink is down or restarting: the SuperNode retries
            log.warning("SuperLink unreachable for %s: %s", path, ex)
            await _respond(send, 503, b'{"detail":"SuperLink unavailable"}', [(b"content-type", b"application/json")])
            return
        content = res.content
        if path == FLEET_PREFIX + "get-fab" and res.status_code == 200:
            content = attach_signatures(content, self.signatures)
        out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in res.headers.multi_items()
               if k.lower() not in HOP_HEADERS]
        await _respond(send, res.status_code, content, out)


async def _respond(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedfuse.flower.gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", default="0.0.0.0:9093", metavar="HOST:PORT",
                   help="device-facing address (default %(default)s)")
    p.add_argument("--superlink", default="127.0.0.1:9091", metavar="HOST:PORT",
                   help="the SuperLink's loopback address, its --host/--port (default %(default)s)")
    p.add_argument("--ssl-ca-certfile", required=True, help="CA that signed the SuperLink's certificate")
    p.add_argument("--ssl-certfile", required=True, help="server certificate presented to devices")
    p.add_argument("--ssl-keyfile", required=True, help="its private key")
    p.add_argument("--signatures", default=None, metavar="DIR",
                   help="signature records of the operator's app bundles (DIR/<sha256>.json)")
    args = p.parse_args(argv)
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "alembic"):  # one line per forwarded request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    host, port = _host_port(args.listen)
    app = FleetGateway(f"https://{args.superlink}", ca_certfile=args.ssl_ca_certfile, signatures=args.signatures)
    log.info("Fleet API gateway on %s -> %s (%d routes)", args.listen, args.superlink, len(app.routes))
    uvicorn.run(app, host=host, port=port, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                log_level="warning", lifespan="on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
