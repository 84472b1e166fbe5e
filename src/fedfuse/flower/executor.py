"""The Flower executor: fedfuse's ``for_each_client`` seam over a Flower ``Grid``.

:class:`FlowerExecutor` turns each client job of a round into one Flower ``Message`` (``message_type``
``"train"`` for the client step, ``"evaluate"`` for personal evaluation), sends the whole round with
``grid.send_and_receive`` and decodes the replies.  The round loop, the algorithm's server hooks, fusion,
accounting and checkpoints stay in fedfuse's :class:`~fedfuse.engine.loop.Experiment`, which runs inside the
``ServerApp``; the ``ClientApp`` (:mod:`fedfuse.flower.app`) runs the algorithm's client hook on the node.  A
reply that never arrives (node gone, ``round_timeout`` passed) or that carries an error is left out, and the loop
treats that client as a dropout of the round — the same policy as ``--dropout`` in the in-process engine.

Grids:

- a real ``Grid`` (``flwr run`` against a SuperLink, or Flower's simulation runtime);
- :class:`LocalGrid`: calls the ``ClientApp`` in this process, but every message still goes through Flower's
  protobuf serialisation both ways (the equality tests use it: the same wire, no Ray start-up);
- :class:`~fedfuse.flower.simulation.SimulationExecutor` (``--executor flower``, its own module): starts
  Flower's simulation runtime (Ray) in a background thread on first use and forwards each batch of jobs to the
  ``ServerApp``'s grid.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from fedfuse.engine.contract import Algorithm, ClientFn, Job
from fedfuse.engine.routing import RouteLog
from fedfuse.flower import wire
from fedfuse.privacy.secure import SecAggAbort, SecAggSettings

log = logging.getLogger("fedfuse")

RETRY_AFTER = 3  # calls a node that left a message unanswered is skipped before it is tried again
REQUERY_AFTER = 1.0  # seconds between two discovery attempts while waiting for min_nodes nodes' answers
#: Flower's own errors for a message that never reached a ClientApp (expired, or its node missed its heartbeats):
#: MESSAGE_UNAVAILABLE, REPLY_MESSAGE_UNAVAILABLE, NODE_UNAVAILABLE (flwr.common.constant.ErrorCode)
UNDELIVERED = frozenset({3, 4, 5})
#: client hooks that run on the nodes, and the Flower message type each travels as
METHODS = {"fit": "train", "evaluate": "evaluate"}
JOB = "fedfuse.job"
CLIENTS = "fedfuse.clients"  # a node's answer to the "query" message: the client ids it holds, their sizes


class FlowerExecutor:
    """Runs client jobs on the SuperNodes of a Flower ``grid`` (see the module docstring).

    ``config`` is the run's resolved :class:`~fedfuse.config.RunConfig` (sent with every message, so a node
    builds the same federation and algorithm); ``train`` returns the current local-training settings (the
    loop may halve the lr on rollback).  Client ``cid`` is served by node ``nodes[cid % len(nodes)]`` of the
    nodes that answered lately (:meth:`route`).
    """

    name = "flower"

    def __init__(self, grid: Any, config: Any, seed: int, *, round_timeout: float | None = None,
                 min_nodes: int = 1, node_wait: float = 120.0) -> None:
        self.grid = grid
        self.seed = seed
        self.run_json = json.dumps(config.to_dict(), sort_keys=True, default=str)  # as node_run keys it
        self.round_timeout = round_timeout or None
        self.min_nodes = max(1, min_nodes)
        self.node_wait = node_wait
        self._ctx: Any = None
        self.lost: dict[int, str] = {}  # the last call's jobs without a usable reply, with the reason
        self.route_log = RouteLog()  # every client training runs on a node (the summary's executor block)
        self._started = False
        self._discovered = False  # the first round's discovery wait is over (see present)
        self._discovery_until: float | None = None  # during that wait: when it ends (time.monotonic)
        self.answered: set[int] = set()  # nodes whose ClientApp answered the discovery query (a refusal included)
        self.timed_out = 0  # consecutive training calls that ended at round_timeout with jobs unanswered
        self._silent: dict[int, int] = {}  # node -> calls left before it is tried again
        self.poll = 0.05  # seconds between two reply checks (see send_and_receive)
        self.calls: list[dict[str, Any]] = []  # per grid call: message type, push and last-reply wall times
        self.served: dict[int, list[int] | None] = {}  # node -> the clients it holds (None: any, see discover)
        #: ``vet(node, held, answer) -> reason | None``: checks a node's answer to the query (its client sizes and
        #: data shape, ``answer``) before its clients are served; a refused node is asked again on the next call
        #: (fedfuse.flower.server_data.ClaimCheck)
        self.vet: Any = None
        #: secagg=true: fit rounds run Flower's SecAgg+ with these settings (fedfuse.flower.secure)
        self.secagg = SecAggSettings.from_config(config) if config.secagg else None

    def bind(self, ctx: Any) -> None:
        """Follow ``ctx.train`` (the run's local-training settings) when building messages."""
        self._ctx = ctx

    def nodes(self) -> list[int]:
        """The connected node ids.  Before the first round it waits up to ``node_wait`` s for ``min_nodes`` to
        connect; later it takes whoever is connected (waiting only while nobody is)."""
        deadline = time.monotonic() + self.node_wait
        need = self.min_nodes if not self._started else 1
        while True:
            ids = sorted(self.grid.get_node_ids())
            if len(ids) >= need or time.monotonic() > deadline:
                if not ids:
                    raise RuntimeError(f"no Flower SuperNode connected within {self.node_wait:.0f} s")
                self._started = True
                return ids

    def discover(self, ids: list[int]) -> None:
        """Ask every node not asked yet which clients it serves (a ``query`` message; the ClientApp answers with
        the client ids of its node-local data, or ``"*"`` when it rebuilds the federation from the config and
        serves any client).  A node that does not answer is asked again on the next call.  The answers are waited
        for ``round_timeout`` (else 120 s; before the first round, until the end of :meth:`present`'s wait); the
        queries expire then (their TTL), so a node busy until later never answers a stale one."""
        for n in [n for n in self.served if n not in ids]:  # gone from the SuperLink's list
            del self.served[n]
        new = [n for n in ids if n not in self.served]
        if not new:
            return
        until = self._discovery_until
        replies, to = self._ask(new, self.round_timeout or 120.0 if until is None else until - time.monotonic())
        for rep in replies:
            node = rep.metadata.src_node_id
            if rep.has_error():
                self._unanswered_query(rep, to.get(rep.metadata.reply_to_message_id, node))
                continue
            self.answered.add(node)
            held = json.loads(str(rep.content[CLIENTS]["clients"]))
            if self._refused(node, held, rep.content[CLIENTS]):
                continue
            if held != "*" and self._claimed_elsewhere(node, [int(c) for c in held], ids):
                continue
            self.served[node] = None if held == "*" else [int(c) for c in held]
            log.info("flower: node %d serves %s", node, "any client" if held == "*" else f"clients {held}")

    def _refused(self, node: int, held: Any, record: Any) -> bool:
        """True (and logged as an error) when :attr:`vet` refuses ``node``'s answer (``record``: its entries
        beside the client ids, JSON-encoded: their sizes, the data's shape)."""
        if self.vet is None:
            return False
        why = self.vet(node, held, {k: json.loads(str(v)) for k, v in record.items() if k != "clients"})
        if why:
            log.error("flower: node %d refused: %s", node, why)
        return bool(why)

    def _ask(self, nodes: list[int], wait: float) -> tuple[list[Any], dict[str, int]]:
        """Send the discovery query to ``nodes`` (TTL ``wait``, at least 1 s) and collect the replies within that
        time; returns them and message id -> node (Flower's own error replies come from the SuperLink)."""
        from flwr.app import ConfigRecord, Message, RecordDict

        wait = max(1.0, wait)
        msgs = [Message(content=RecordDict({JOB: ConfigRecord({"run": self.run_json})}), message_type="query",
                        dst_node_id=n, ttl=wait) for n in nodes]
        query = getattr(self.grid, "query", None)  # an in-process grid answers without counting a call
        saved, self.round_timeout = self.round_timeout, wait
        try:
            replies = query(msgs) if query is not None else self.send_and_receive(msgs)
        finally:
            self.round_timeout = saved
        return list(replies), {m.metadata.message_id: m.metadata.dst_node_id for m in msgs if m.metadata.message_id}

    def _unanswered_query(self, rep: Any, node: int) -> None:
        """An error in place of a node's answer to the discovery query: Flower's own (:data:`UNDELIVERED`: the
        query never reached the node's ClientApp — it is still reconnecting, or offline until its next heartbeat) is
        no answer; an error of the ClientApp (it refused the run: another export's bundle, say) is one."""
        if rep.error.code in UNDELIVERED:
            log.info("flower: node %d has not answered yet: %s", node, rep.error.reason)
            return
        self.answered.add(node)
        log.warning("flower: node %d did not say which clients it holds: %s", node, rep.error.reason)

    def _claimed_elsewhere(self, node: int, held: list[int], ids: list[int]) -> bool:
        """True (and logged as an error) when a connected node already serves one of the clients ``node`` claims:
        two devices holding one client's data is a misconfiguration (a copied bundle), and the first claim stands.
        The refused node is asked again on the next call (a restarted device's old node id leaves the SuperLink's
        list when its heartbeat expires)."""
        taken = {c: n for n in ids if n != node for c in (self.served.get(n) or ())}
        clash = sorted(c for c in held if c in taken)
        if clash:
            log.error("flower: node %d claims clients %s, which node %s already holds: refused (two devices must "
                      "not hold one client's data; give each device its own bundle)", node, clash,
                      sorted({taken[c] for c in clash}))
        return bool(clash)

    def holders(self, ids: list[int]) -> dict[int, int]:
        """client id -> the connected node that holds its data (nodes with node-local data only)."""
        out: dict[int, int] = {}
        for n in ids:
            for c in self.served.get(n) or ():
                out.setdefault(c, n)
        return out

    def present(self) -> set[int] | None:
        """``None``: every client may be sampled, exactly as in process.  A sampled client that no connected node
        holds is absent — a dropout of the round (:meth:`assign`), never replaced by another client — so the sample,
        and the sampling probability a DP accountant assumes, are the run's own.

        Before this ServerApp's first round — a start, or a resume after a SuperLink restart, when the devices may
        still be reconnecting, marked offline until their next heartbeat, or finishing the killed run's job — it
        waits up to ``node_wait`` s until ``min_nodes`` nodes have answered the discovery query (a refusal is an
        answer), asking again every :data:`REQUERY_AFTER` s; only then are the clients of a node still silent
        absent."""
        if self._discovered:
            self.discover(self.nodes())
        else:
            self._discovered = True
            self._discovery_until = deadline = time.monotonic() + self.node_wait
            try:
                self.discover(self.nodes())
                while len(self.answered) < self.min_nodes and (left := deadline - time.monotonic()) > 0:
                    time.sleep(min(REQUERY_AFTER, left))
                    self.discover(self.nodes())
            finally:
                self._discovery_until = None
            if len(self.answered) < self.min_nodes:
                log.warning("flower: only %d of the %d nodes to wait for answered within %.0f s (node_wait); the "
                            "others' clients are absent until they answer", len(self.answered), self.min_nodes,
                            self.node_wait)
        return None

    def route(self, ids: list[int], strict: bool = False) -> list[int]:
        """The nodes to send to: those that answered lately.  A node that left a message unanswered (it died,
        or missed the deadline) is skipped for the next ``RETRY_AFTER`` calls — a dead SuperNode stays listed by
        the SuperLink until its heartbeat expires — and then tried again."""
        live = [n for n in ids if self._silent.get(n, 0) <= 0]
        return live if live or strict else ids

    def message(self, method: str, job: Job, node: int, payload: tuple[Any, Any], train: str) -> Any:
        """The Flower message of ``job``: its payload records (encoded once per distinct payload, see
        :meth:`map`), the client's state and the job record (``train``: the local-training settings as JSON).

        With a ``round_timeout`` the message's TTL is the round's: a job still queued at the SuperLink when its
        round ends expires there and is never delivered, so a device that was too slow finishes at most the job it
        is running and then takes the next round's, not the stale round's other jobs."""
        from flwr.app import ConfigRecord, Message

        content = wire.pack({"state": job.state})
        content[wire.PAYLOAD_ARRAYS], content[wire.PAYLOAD_SKELETON] = payload
        content[JOB] = ConfigRecord({
            "method": method, "cid": int(job.cid), "keys": json.dumps(list(job.keys)), "seed": int(self.seed),
            "run": self.run_json, "train": train,
        })
        return Message(content=content, message_type=METHODS[method], dst_node_id=node, ttl=self.round_timeout)

    def map(self, fn: ClientFn, jobs: Sequence[Job]) -> dict[int, Any]:
        method = getattr(fn, "__name__", "")
        if getattr(fn, "__self__", None) is None or method not in METHODS:
            raise ValueError(f"the Flower executor runs the algorithm's {'/'.join(METHODS)} hooks, not {fn!r}")
        return self.send_jobs(method, list(jobs), self.train_json())

    def train_json(self) -> str:
        """The current local-training settings (the loop may halve the lr on rollback), as sent with each job."""
        return json.dumps(asdict(self._ctx.train) if self._ctx is not None else {}, default=str)

    def send_jobs(self, method: str, jobs: list[Job], train: str) -> dict[int, Any]:
        """Send one message per job (``method``: ``fit`` or ``evaluate``) and decode the replies by client id; a
        job without a usable reply is left out and its reason kept in :attr:`lost`."""
        self.lost = {}
        if not jobs:
            return {}
        routes = self.assign(jobs)
        if method == "fit" and self.secagg is not None:  # secagg=true: Flower's SecAgg+ (fedfuse.flower.secure)
            return self.send_secure([j for j in jobs if j.cid in routes], routes, train)
        payloads: dict[int, tuple[Any, Any]] = {}  # a payload broadcast to many clients is encoded once
        sent = {}
        for job in jobs:
            if job.cid not in routes:
                continue
            if id(job.payload) not in payloads:
                payloads[id(job.payload)] = wire.to_records(job.payload)
            sent[job.cid] = self.message(method, job, routes[job.cid], payloads[id(job.payload)], train)
        replies = self.send_and_receive(list(sent.values())) if sent else []
        by_message = {m.metadata.message_id: cid for cid, m in sent.items() if m.metadata.message_id}
        out: dict[int, Any] = {}
        for rep in replies:
            if rep.has_error():
                cid = by_message.get(rep.metadata.reply_to_message_id)
                if cid is not None:
                    reason = (rep.error.reason or "").strip().splitlines()
                    self.lost[cid] = f"error from node {rep.metadata.src_node_id}: {reason[-1][:300] if reason else ''}"
                continue
            cid = int(rep.content[JOB]["cid"])
            out[cid] = wire.unpack(rep.content)["result"]
        silent = self._no_reply(sent, out)
        for cid, reason in sorted(self.lost.items()):
            log.warning("flower: client %d did not reply: %s", cid, reason)
        if method == "fit":
            self._check_timeouts(silent, len(sent), jobs)
        return out

    def _no_reply(self, sent: dict[int, Any], out: dict[int, Any]) -> dict[int, int]:
        """The sent jobs that got no reply at all (client -> its node), recorded in :attr:`lost`; their nodes are
        skipped for the next ``RETRY_AFTER`` calls (:meth:`route`)."""
        silent = {}
        for cid, msg in sent.items():
            if cid not in out and cid not in self.lost:
                self.lost[cid] = "no reply (node gone or round timeout)"
                silent[cid] = msg.metadata.dst_node_id
                self._silent[msg.metadata.dst_node_id] = RETRY_AFTER
        return silent

    def _check_timeouts(self, silent: dict[int, int], sent: int, jobs: Sequence[Job]) -> None:
        """Count training calls that ended at ``round_timeout`` with jobs unanswered (``silent``: client -> its
        node); from the second in a row on, say on the server's log why the run makes no progress."""
        if not silent or self.round_timeout is None:
            self.timed_out = 0
            return
        self.timed_out += 1
        if self.timed_out < 2:
            return
        keys = jobs[0].keys if jobs else ()
        where = f"round {int(keys[1]) + 1}" if len(keys) > 1 and isinstance(keys[1], int) else "this round"
        nodes = sorted(set(silent.values()))
        try:
            connected = set(self.grid.get_node_ids())
        except Exception:  # the reason is best effort: the round's outcome is already decided
            connected = set(nodes)
        gone, busy = [n for n in nodes if n not in connected], [n for n in nodes if n in connected]
        why = []
        if busy:
            why.append(f"nodes {busy} are connected but did not finish their jobs within the round timeout: a device "
                       "runs its clients' jobs one after another, so the round timeout must exceed the slowest "
                       "device's sum of job times (docs/deploy.md, 'Round timeout'); raise round-timeout")
        if gone:
            why.append(f"nodes {gone} left the federation (the SuperLink no longer lists them)")
        log.error("flower: %s timed out, %d training rounds in a row (round-timeout %g s): %d of %d training jobs "
                  "unanswered (clients %s): %s", where, self.timed_out, self.round_timeout, len(silent), sent,
                  sorted(silent), "; ".join(why))

    def assign(self, jobs: Sequence[Job]) -> dict[int, int]:
        """client id -> the node its job goes to: the connected node holding its data, else one that serves any
        client; a job no connected node can serve is recorded in :attr:`lost`."""
        ids = self.nodes()
        self.discover(ids)
        holders = self.holders(self.route(ids, strict=True))  # a silent node's clients are absent for a while
        anyone = self.route([n for n in ids if n in self.served and self.served[n] is None])
        self._silent = {n: k - 1 for n, k in self._silent.items() if k > 1}
        routes: dict[int, int] = {}
        for job in jobs:
            node = holders.get(job.cid)
            if node is None and anyone:
                node = anyone[job.cid % len(anyone)]
            if node is None:  # nobody connected holds this client's data: it cannot take part
                self.lost[job.cid] = "no connected node holds its data"
                continue
            routes[job.cid] = node
        return routes

    def send_secure(self, jobs: list[Job], routes: dict[int, int], train: str) -> dict[int, Any]:
        """The round's fit jobs under Flower's SecAgg+ (:func:`fedfuse.flower.secure.secure_fit`): the replies
        are masked replies sharing the decoded sum.  If the protocol halts, no client of the round counts."""
        from fedfuse.flower.secure import secure_fit

        assert self.secagg is not None
        round_index = int(jobs[0].keys[1]) if jobs and len(jobs[0].keys) > 1 else 0
        try:
            out = secure_fit(self, jobs, routes, train, round_index, self.secagg)
        except SecAggAbort as e:
            log.warning("flower: SecAgg+ round aborted: %s", e)
            out = {}
        for job in jobs:
            if job.cid not in out:
                self.lost[job.cid] = "not in the SecAgg+ sum (its node dropped out or the protocol halted)"
        return out

    def send_and_receive(self, messages: list[Any]) -> list[Any]:
        """Push ``messages`` and collect their replies until all came or ``round_timeout`` passed.

        Flower's ``Grid.send_and_receive`` checks for replies every 3 s (flwr 1.41, fixed); with a grid that
        exposes ``push_messages``/``pull_messages`` (the deployment and simulation grids) the executor checks
        every :attr:`poll` seconds instead, so a round is not rounded up to the next multiple of 3 s."""
        push, pull = getattr(self.grid, "push_messages", None), getattr(self.grid, "pull_messages", None)
        if push is None or pull is None:
            return list(self.grid.send_and_receive(messages, timeout=self.round_timeout))
        start = time.time()
        waiting = set(push(messages))
        end = None if self.round_timeout is None else time.monotonic() + self.round_timeout
        out: list[Any] = []
        while waiting:
            got = list(pull(waiting))
            out += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if not waiting or (end is not None and time.monotonic() >= end):
                break
            time.sleep(self.poll)
        self.calls.append({"type": str(messages[0].metadata.message_type) if messages else "", "push": start,
                           "done": time.time(), "messages": len(messages)})
        return out

    def fit(self, target: Algorithm, jobs: Sequence[Job]) -> dict[int, Any]:
        out = self.map(target.fit, jobs)
        self.route_log.ran("flower", len(out))
        return out

    def routing(self) -> RouteLog:
        return self.route_log

    def restore(self, choice: str | None) -> None:
        """Nothing to restore: the nodes are the grid's."""

    def close(self) -> None:
        """Nothing to release (the grid belongs to the ServerApp)."""

    def describe(self) -> str:
        return "flower"


class LocalGrid:
    """A Flower ``Grid`` whose nodes are ``ClientApp`` calls in this process.

    Every message is serialised to Flower's protobuf and parsed back on the way out and on the way back, so
    what a node receives is exactly what would cross the network.  ``fail`` maps node ids to a callable
    ``(round_of_calls) -> bool`` that drops the node's replies (simulated node failure); ``node_config`` adds
    each node's Flower node config (e.g. ``{"data": DIR}``: node-local data).  ``received`` keeps the serialised
    replies (what the server receives) when ``keep_replies`` is set.
    """

    def __init__(self, client_app: Any, num_nodes: int, *, fail: dict[int, Any] | None = None,
                 node_config: Sequence[dict[str, Any]] | None = None) -> None:
        from flwr.app import Context, RecordDict

        self.client_app = client_app
        self.node_ids = list(range(1, num_nodes + 1))
        self.contexts = {n: Context(run_id=1, node_id=n, state=RecordDict(), run_config={},
                                    node_config={"partition-id": i, "num-partitions": num_nodes,
                                                 **(node_config[i] if node_config else {})})
                         for i, n in enumerate(self.node_ids)}
        self.fail = fail or {}
        self.calls = 0
        from flwr.supercore.task_identity import TaskIdentity

        for attr, value in (("run_id", 1), ("task_id", 1), ("node_id", 0)):  # what a ServerApp runtime sets
            if getattr(TaskIdentity, "_" + attr) is None:
                setattr(TaskIdentity, attr, value)
        self.bytes_sent = 0  # serialised message sizes, both directions
        self.keep_replies = False
        self.received: list[bytes] = []

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)

    def _wire(self, msg: Any) -> Any:
        from flwr.common.serde import message_from_proto, message_to_proto
        from flwr.proto.message_pb2 import Message as ProtoMessage

        raw = message_to_proto(msg).SerializeToString()
        self.bytes_sent += len(raw)
        proto = ProtoMessage()
        proto.ParseFromString(raw)
        return message_from_proto(proto)

    def query(self, messages: Sequence[Any]) -> list[Any]:
        """The nodes' answers to the executor's ``query`` messages (not counted as calls, never failed)."""
        return [self._wire(self.client_app(self._wire(m), self.contexts[m.metadata.dst_node_id])) for m in messages]

    def send_and_receive(self, messages: Sequence[Any], *, timeout: float | None = None) -> list[Any]:
        self.calls += 1
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node in self.fail and self.fail[node](self.calls):
                continue
            msg.metadata.__dict__["_message_id"] = msg.object_id  # as a grid's push sets it (replies refer to it)
            received = self._wire(msg)
            reply = self.client_app(received, self.contexts[node])
            if self.keep_replies:
                from flwr.common.serde import message_to_proto

                self.received.append(message_to_proto(reply).SerializeToString())
            out.append(self._wire(reply))
        return out
