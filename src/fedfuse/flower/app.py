"""fedfuse as a Flower app: a ``ServerApp`` that runs fedfuse's round loop and a ``ClientApp`` that runs an
algorithm's client hooks.

Deployment (``flwr run`` against a SuperLink, see ``docs/flower.md``) uses the module-level objects::

    [tool.flwr.app.components]
    serverapp = "fedfuse.flower.app:server_app"
    clientapp = "fedfuse.flower.app:client_app"

The ServerApp reads its run from ``context.run_config``: ``fedfuse-config`` (a fedfuse YAML config, e.g. the
``config.yaml`` of any fedfuse run), optional ``out`` (run directory: metrics, checkpoints; ``resume = true``
continues from its checkpoint), ``round-timeout`` (seconds to wait for a round's replies; late or missing
replies are dropouts) and ``min-nodes`` (SuperNodes to wait for before the first round).

The ClientApp is stateless: each message carries the run's config, the job (client id, seed keys, local
training settings), the payload and the client's state; the node rebuilds the federation and the algorithm
from the config once (cached per config) and returns the reply and the client's new state.  Nothing is
pickled: see :mod:`fedfuse.flower.wire`.  What the node does not take from the server — the files it opens, the
local DP it enforces and accounts — is :mod:`fedfuse.flower.node_policy`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from typing import Any

import torch

from fedfuse.algorithms import get_algorithm
from fedfuse.config import ConfigError, make_config, resolve_device
from fedfuse.engine.assemble import assemble
from fedfuse.engine.client import TrainConfig
from fedfuse.engine.executor import Job, job_generator, seed_global
from fedfuse.engine.federated_eval import global_client_side
from fedfuse.engine.local_dp import guarded, secure_generator
from fedfuse.engine.loop import Experiment
from fedfuse.engine.personal import client_side
from fedfuse.engine.store import RunStore
from fedfuse.errors import UserError
from fedfuse.flower import wire
from fedfuse.flower.executor import CLIENTS, JOB, FlowerExecutor
from fedfuse.flower.logs import RoundLog, forward_to_flower
from fedfuse.flower.node_data import NODE_KEYS, NodeDataError
from fedfuse.flower.node_policy import NODE_PATHS, NodeDP, RefusedJob, node_view
from fedfuse.flower.secure import is_secure_fit, node_fit, secure_mod
from fedfuse.flower.server_data import ClaimCheck, learn_federation, node_answer, record_opens
from fedfuse.runfiles import FLOWER_CALLS
from fedfuse.runtime.precision import resolve_precision, use_precision
from fedfuse.runtime.threads import apply_threads
from fedfuse.types import Message as FedfuseMessage

try:
    from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.common.constant import ErrorCode
    from flwr.serverapp import Grid, ServerApp
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("fedfuse.flower needs Flower: pip install 'fedfuse[flower]'") from e

log = logging.getLogger("fedfuse")

# ---------------------------------------------------------------------------------------------- client side
_RUNS: dict[str, Any] = {}


@dataclasses.dataclass
class NodeRun:
    """What a node rebuilt from a run's config: the federation (its clients' data), context and algorithm.
    ``held`` is the set of client ids whose data the node holds (``None``: it rebuilt every client)."""

    fed: Any
    ctx: Any
    algo: Any
    held: frozenset[int] | None = None
    precision: str = "fp32"  # the run's training precision resolved on this node's device
    memory_format: str = "contiguous"  # the run's memory_format setting
    fp32_matmul: str = "ieee"  # the run's fp32_matmul setting
    frac_bits: int = 24  # the run's secagg_frac_bits (the fixed point of SecAgg+ contributions)
    cfg: Any = None  # the run's config as this node runs it (its own paths: node_policy.node_view)


def run_key(run_json: str) -> str:
    return hashlib.sha256(run_json.encode()).hexdigest()


def node_run(run_json: str, node_config: Any = None) -> NodeRun:
    """The node-side federation and algorithm of a run (built once per config, then cached).

    Every path of the run (data directory, LoRA base, an ``hf:`` dataset's files) is the node's own
    (:func:`~fedfuse.flower.node_policy.node_view`: ``--node-config "data-dir='/path'"`` and so on), never the
    server's; with ``data='DIR'`` the node's clients are its node-local data."""
    node_config = dict(node_config or {})
    key = run_key(run_json)
    own = {k: str(node_config[k]) for k in (*NODE_KEYS, *NODE_PATHS, "partition-id") if k in node_config}
    if node_config.get("data") or any(k in node_config for k in NODE_PATHS):  # another node run of the same run
        key = run_key(run_json + json.dumps(own, sort_keys=True))
    if key not in _RUNS:
        cfg = node_view(make_config(json.loads(run_json)), node_config)
        if node_config.get("data"):  # node-local data: only the clients the node holds
            from fedfuse.algorithms.base import Algorithm
            from fedfuse.flower.node_data import check_compatible, load_node_data

            if get_algorithm(cfg.algorithm).setup is not Algorithm.setup:
                raise ValueError(f"{cfg.algorithm} prepares server-side data from the clients' (setup); it cannot "
                                 "run on nodes that hold only their own data")
            data = load_node_data(node_config, seed=cfg.seed, val_fraction=cfg.val_fraction)
            check_compatible(data, cfg)
            built = prepare_node(cfg, data.federation(cfg.clients), key=key)
            built.held = frozenset(data.client_ids)
            log.info("node data %s: clients %s", data.source, data.client_ids)
        else:
            prepare_node(cfg, key=key)
    return _RUNS[key]


def prepare_node(cfg: Any, fed: Any = None, *, key: str | None = None) -> NodeRun:
    """Build (and cache) this node's side of run ``cfg``.  ``fed`` gives the federation instead of building it
    from the config — for a federation assembled in code, as ``Experiment(cfg, fed=...)`` accepts in process."""
    apply_threads(cfg.threads)
    device = resolve_device(cfg.device)
    with torch.random.fork_rng(devices=[]):
        fed, ctx, algo = assemble(cfg, device, get_algorithm(cfg.algorithm), fed=fed)
        # client hooks never see the partition's ground truth
        built = NodeRun(fed.blinded(), ctx, algo, precision=resolve_precision(cfg.precision, device),
                        memory_format=cfg.memory_format, fp32_matmul=cfg.fp32_matmul,
                        frac_bits=cfg.secagg_frac_bits, cfg=cfg)
    while len(_RUNS) >= 4:  # a node process serves one run at a time; a few entries for in-process test grids
        del _RUNS[next(iter(_RUNS))]
    _RUNS[key or run_key(json.dumps(cfg.to_dict(), sort_keys=True, default=str))] = built
    return built


def handle(msg: Message, context: Context) -> Message:
    """Run one fedfuse client job carried by ``msg`` and return the reply message (a SecAgg+ round's masked-input
    step carries all of the node's jobs: :func:`fedfuse.flower.secure.node_fit`)."""
    if is_secure_fit(msg):
        return Message(node_fit(msg, lambda content: run_job(content, context), lambda run: run.frac_bits),
                       reply_to=msg)
    try:
        _, job, result = run_job(msg.content, context)
    except (RefusedJob, NodeDataError) as e:
        log.error("job refused: %s", e)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(e)), reply_to=msg)
    content = wire.pack({"result": result})
    content[JOB] = ConfigRecord({"cid": job.cid, "method": str(msg.content[JOB]["method"])})
    content["metrics"] = MetricRecord(_metrics(result))
    return Message(content=content, reply_to=msg)


def run_job(content: Any, context: Context) -> tuple[NodeRun, Job, Any]:
    """Run the fedfuse client job in a message's ``content``: (the node's run, the job, the hook's result).  A
    job the node will not run raises :class:`~fedfuse.flower.node_policy.RefusedJob`."""
    job_rec = content[JOB]
    run = node_run(str(job_rec["run"]), context.node_config)
    method, cid, seed = str(job_rec["method"]), int(job_rec["cid"]), int(job_rec["seed"])
    if run.held is not None and cid not in run.held:  # never train or evaluate as another client
        raise RefusedJob(f"node {context.node_id} does not hold client {cid} (it holds clients {sorted(run.held)}): "
                         "job refused")
    dp = NodeDP.from_node_config(context.node_config)
    if dp is not None and run.cfg is not None:
        dp.check_run(run.cfg)
    train = json.loads(str(job_rec["train"]))
    if train:
        run.ctx.train = TrainConfig(**train)
    body = wire.unpack(content)
    payload = wire.from_records(content[wire.PAYLOAD_ARRAYS], content[wire.PAYLOAD_SKELETON])
    data = run.fed.clients[cid]
    # with entries that stay local, they are merged here (engine/personal.py); an evaluation payload carrying the
    # global model (global_eval=federated) is evaluated on the client's test split too (engine/federated_eval.py)
    client = global_client_side(client_side(run.algo))
    private = tuple(client.node_private)
    state = restore_private(body["state"], private, context, cid)
    job = Job(cid, payload.to(data.train.x.device), state, tuple(json.loads(str(job_rec["keys"]))))
    seed_global(seed, job)
    hook = {"fit": client.fit, "evaluate": client.evaluate}[method]
    guard = dp.guard(cid) if dp is not None and method == "fit" else None
    with use_precision(run.precision, run.memory_format, run.fp32_matmul), \
            guarded(guard) if guard is not None else contextlib.nullcontext():
        # a node enforcing its own local DP: every DP-SGD call is checked, charged and drawn from the OS
        result = hook(job.payload, job.state, data, secure_generator() if guard else job_generator(seed, job))
    trained = getattr(getattr(result[0], "stats", None), "steps", 0) if guard is not None else 0
    if guard is not None and trained and not guard.charged:  # trained outside DP-SGD: nothing of it leaves
        raise RefusedJob(f"client {cid}: the job trained {trained} steps without DP-SGD, which this node "
                         f"enforces ({guard.policy.describe()}): reply withheld")
    if guard is not None and guard.charged:
        log.info("local DP: client %d has spent ε = %.4g of this node's %g (δ = %g)", cid,
                 guard.book.epsilon(cid), guard.policy.epsilon, guard.policy.delta)
    if private and method == "fit":  # evaluation reads the kept entries but leaves them as they are
        result = (result[0], keep_private(result[1], private, context, cid))
    return run, job, result


KEPT = "fedfuse:kept-on-node"  # what the server holds in place of a node-private client-state entry


def _private_key(cid: int, name: str) -> str:
    return f"fedfuse.private.{cid}.{name}"


def keep_private(state: Any, private: tuple[str, ...], context: Context, cid: int) -> Any:
    """Move the client-state entries an algorithm declares ``node_private`` into the node's ``context.state``
    (Flower's per-node store for the run); the reply carries only the :data:`KEPT` marker in their place.

    This is how secure FedMR's trained model and private key stay on the client under Flower, although the
    ClientApp is otherwise stateless (every other client-state entry travels with the messages)."""
    for name in private:
        base = _private_key(cid, name)
        for part in (".arrays", ".skeleton"):
            if base + part in context.state:
                del context.state[base + part]
    if not isinstance(state, dict):
        return state
    out = dict(state)
    for name in private:
        if out.get(name) is not None:
            base = _private_key(cid, name)
            context.state[base + ".arrays"], context.state[base + ".skeleton"] = wire.to_records(out[name])
            out[name] = KEPT
    return out


def restore_private(state: Any, private: tuple[str, ...], context: Context, cid: int) -> Any:
    """Inverse of :func:`keep_private`: the node's kept entries back in place of their markers (an entry the
    node no longer holds — it restarted — is left out, and the algorithm sees a client without it)."""
    if not private or not isinstance(state, dict):
        return state
    out = dict(state)
    for name in private:
        if out.get(name) != KEPT:
            continue
        base = _private_key(cid, name)
        if base + ".arrays" in context.state:
            out[name] = wire.from_records(context.state[base + ".arrays"], context.state[base + ".skeleton"])
        else:
            del out[name]
    return out


def _metrics(result: Any) -> dict[str, float]:
    """Flower-visible metrics of a reply: its :class:`FitStats` (``num-examples`` = the examples it trained on,
    Flower's convention) and the scalar entries of its metadata, or an evaluation's metrics."""
    reply = result[0] if isinstance(result, tuple) and isinstance(result[0], FedfuseMessage) else None
    entries: dict[str, Any] = {}
    if reply is not None:
        entries.update(reply.meta)
        if reply.stats is not None:
            entries.update({k: v for k, v in reply.stats.as_dict().items() if v is not None})
    elif isinstance(result, dict):
        entries = result
    out = {str(k): float(v) for k, v in entries.items()
           if isinstance(v, int | float) and not isinstance(v, bool) and v == v}
    if "samples" in out:
        out["num-examples"] = out["samples"]
    return out


client_app = ClientApp(mods=[secure_mod])  # secure_mod: Flower's secaggplus_mod in SecAgg+ rounds only


@client_app.query()
def _query(msg: Message, context: Context) -> Message:
    """Which clients this node serves: ``[ids]`` when it holds node-local data, ``"*"`` when it rebuilds the
    whole federation from the config (and so can serve any client); with their training-set sizes and the shape
    of the data (:func:`~fedfuse.flower.server_data.node_answer`: what a server without data learns)."""
    held: Any = "*"
    try:
        run = node_run(str(msg.content[JOB]["run"]), context.node_config)
    except (RefusedJob, NodeDataError) as e:  # this node will not serve the run: say why
        log.error("run refused: %s", e)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(e)), reply_to=msg)
    if context.node_config.get("data"):
        held = sorted(run.held or ())
    answer = {"clients": json.dumps(held), **node_answer(run.fed, None if held == "*" else held)}
    return Message(content=RecordDict({CLIENTS: ConfigRecord(answer)}), reply_to=msg)


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    return handle(msg, context)


@client_app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    return handle(msg, context)


# ---------------------------------------------------------------------------------------------- server side
server_app = ServerApp()


@server_app.main()
def _main(grid: Grid, context: Context) -> None:
    """Deployment: run the fedfuse experiment named by the run config, with the nodes as its clients."""
    rc = dict(context.run_config)
    if "fedfuse-config" not in rc:
        raise UserError("the fedfuse ServerApp needs run config 'fedfuse-config' (a fedfuse YAML config file)")
    audit = os.environ.get("FEDFUSE_AUDIT_OPEN")
    if audit:  # record every file the server opens (the tests check a server without data opens none)
        record_opens(audit)
    overrides: dict[str, Any] = {"executor": "sequential"}
    if rc.get("out"):
        overrides["out"] = str(rc["out"])
    cfg = make_config(str(rc["fedfuse-config"]), **overrides)
    timeout = float(rc.get("round-timeout", 0) or 0) or None
    executor = FlowerExecutor(grid, cfg, cfg.seed, round_timeout=timeout, min_nodes=int(rc.get("min-nodes", 1)))
    forward_to_flower()  # fedfuse's INFO log, a line per round included, in `flwr log` (fedfuse.flower.logs)
    algorithm = get_algorithm(cfg.algorithm)
    if cfg.global_eval == "server":  # the operator gave the server its dataset: the global test set is its own
        exp = Experiment(cfg, algorithm, executor=executor, callbacks=[RoundLog()])
        executor.vet = ClaimCheck(cfg.clients, exp.fed.client_sizes())  # the nodes' sizes must be the same
    else:  # the server holds no data: the clients' sizes come from the nodes (fedfuse.flower.server_data)
        # a fixed reason is refused before waiting for the nodes; one that depends on the options, when the run is built
        need = algorithm.server_data
        if isinstance(need, str):
            raise ConfigError(f"algorithm {cfg.algorithm!r} cannot run on a server without data: {need}")
        exp = Experiment(cfg, algorithm, executor=executor, fed=learn_federation(executor, cfg),
                         callbacks=[RoundLog()])
    summary = exp.run(resume=bool(rc.get("resume", False)))
    # when each call's messages were pushed and their last reply arrived (benchmarks/peers.py --deploy)
    RunStore(cfg.out).write_json(FLOWER_CALLS, executor.calls)
    log.info("fedfuse run finished: %s", json.dumps(summary.get("final", {}), default=str)[:500])


relay_app = ServerApp()


@relay_app.main()
def _relay(grid: Grid, context: Context) -> None:
    """``--executor flower`` (:class:`~fedfuse.flower.simulation.SimulationExecutor`): the ServerApp of a
    ``flwr run`` on a local simulation SuperLink.  It connects back to the fedfuse process that submitted the run
    (run config ``relay``, ``relay-key``: a loopback ``multiprocessing`` connection with an authentication key),
    then sends each batch of jobs it is handed to the simulated nodes and returns the results, until it is handed
    ``None``.  fedfuse's round loop stays in the submitting process."""
    import pickle
    from multiprocessing.connection import Client

    rc = dict(context.run_config)
    host, port = str(rc["relay"]).rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(str(rc["relay-key"])))
    cfg = make_config(json.loads(str(rc["fedfuse-run"])))
    executor = FlowerExecutor(grid, cfg, cfg.seed, min_nodes=int(rc.get("min-nodes", 1)))
    try:
        while True:
            item = pickle.loads(conn.recv_bytes())  # the standard pickler: torch tensors by value
            if item is None:
                return
            method, jobs, train = item
            try:
                reply: Any = (executor.send_jobs(method, jobs, train), executor.lost)
            except Exception as e:  # hand the error to the caller, keep serving
                reply = RuntimeError(f"{type(e).__name__}: {e}")
            conn.send_bytes(pickle.dumps(reply))
    finally:
        conn.close()


def quiet_flower() -> None:
    """Keep Flower's and Ray's start-up chatter out of fedfuse's output (warnings and errors still show)."""
    import os
    import warnings

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    warnings.filterwarnings("ignore", category=FutureWarning, module="ray")
    logging.getLogger("flwr").setLevel(logging.WARNING)
