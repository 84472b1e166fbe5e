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
pickled: see :mod:`fedfuse.flower.wire`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import queue
from typing import Any

import torch

from fedfuse.engine.executor import Job, job_generator, seed_global
from fedfuse.flower import wire
from fedfuse.flower.executor import JOB, FlowerExecutor

try:
    from flwr.app import ConfigRecord, Context, Message, MetricRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("fedfuse.flower needs Flower: pip install 'fedfuse[flower]'") from e

log = logging.getLogger("fedfuse")

# ---------------------------------------------------------------------------------------------- client side
_RUNS: dict[str, Any] = {}


@dataclasses.dataclass
class NodeRun:
    """What a node rebuilt from a run's config: the federation (its clients' data), context and algorithm."""

    fed: Any
    ctx: Any
    algo: Any


def run_key(run_json: str) -> str:
    return hashlib.sha256(run_json.encode()).hexdigest()


def node_run(run_json: str) -> NodeRun:
    """The node-side federation and algorithm of a run (built once per config, then cached)."""
    key = run_key(run_json)
    if key not in _RUNS:
        from fedfuse.api import make_config

        prepare_node(make_config(json.loads(run_json)))
    return _RUNS[key]


def prepare_node(cfg: Any, fed: Any = None) -> NodeRun:
    """Build (and cache) this node's side of run ``cfg``.  ``fed`` gives the federation instead of building it
    from the config — for a federation assembled in code, as ``Experiment(cfg, fed=...)`` accepts in process."""
    from fedfuse.algorithms import get_algorithm
    from fedfuse.config import resolve_device
    from fedfuse.engine.loop import assemble

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with torch.random.fork_rng(devices=[]):
        built = NodeRun(*assemble(cfg, resolve_device(cfg.device), fed=fed, lookup=get_algorithm))
    _RUNS.clear()  # one run at a time per node process
    _RUNS[run_key(json.dumps(cfg.to_dict(), sort_keys=True, default=str))] = built
    return built


def handle(msg: Message, context: Context) -> Message:
    """Run one fedfuse client job carried by ``msg`` and return the reply message."""
    from fedfuse.engine.client import TrainConfig

    job_rec = msg.content[JOB]
    run = node_run(str(job_rec["run"]))
    method, cid, seed = str(job_rec["method"]), int(job_rec["cid"]), int(job_rec["seed"])
    train = json.loads(str(job_rec["train"]))
    if train:
        run.ctx.train = TrainConfig(**train)
    body = wire.unpack(msg.content)
    data = run.fed.clients[cid]
    job = Job(cid, body["payload"].to(data.train.x.device), body["state"], tuple(json.loads(str(job_rec["keys"]))))
    seed_global(seed, job)
    result = getattr(run.algo, method)(job.payload, job.state, data, job_generator(seed, job))
    content = wire.pack({"result": result})
    content[JOB] = ConfigRecord({"cid": cid, "method": method})
    content["metrics"] = MetricRecord(_metrics(result))
    return Message(content=content, reply_to=msg)


def _metrics(result: Any) -> dict[str, float]:
    """Flower-visible metrics of a reply (``num-examples`` and the client's scalar metrics)."""
    meta = result[0].meta if isinstance(result, tuple) and hasattr(result[0], "meta") else result
    out: dict[str, float] = {}
    if isinstance(meta, dict):
        for k, v in meta.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and v == v:
                out[str(k)] = float(v)
        if "samples" in out:
            out["num-examples"] = out["samples"]
    return out


client_app = ClientApp()


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
    from fedfuse.algorithms import get_algorithm
    from fedfuse.api import make_config
    from fedfuse.engine.loop import Experiment

    rc = dict(context.run_config)
    if "fedfuse-config" not in rc:
        raise ValueError("the fedfuse ServerApp needs run config 'fedfuse-config' (a fedfuse YAML config file)")
    overrides: dict[str, Any] = {"executor": "sequential"}
    if rc.get("out"):
        overrides["out"] = str(rc["out"])
    cfg = make_config(str(rc["fedfuse-config"]), **overrides)
    timeout = float(rc.get("round-timeout", 0) or 0) or None
    executor = FlowerExecutor(grid, cfg, cfg.seed, round_timeout=timeout, min_nodes=int(rc.get("min-nodes", 1)))
    exp = Experiment(cfg, executor=executor, algorithm_lookup=get_algorithm)
    summary = exp.run(resume=bool(rc.get("resume", False)))
    log.info("fedfuse run finished: %s", json.dumps(summary.get("final", {}), default=str)[:500])


def serving_app(requests: queue.Queue[Any], replies: queue.Queue[Any]) -> ServerApp:
    """A ServerApp that serves a :class:`~fedfuse.flower.executor.SimulationExecutor` living in the caller's
    thread: it sends each batch of jobs it is handed and returns the replies, until it is handed ``None``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        while True:
            item = requests.get()
            if item is None:
                return
            executor, fn, jobs = item
            try:
                replies.put(executor.serve(grid, fn, jobs))
            except BaseException as e:  # hand the error to the caller, keep serving
                replies.put(e)

    return app


def quiet_flower() -> None:
    """Keep Flower's and Ray's start-up chatter out of fedfuse's output (warnings and errors still show)."""
    import os
    import warnings

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    warnings.filterwarnings("ignore", category=FutureWarning, module="ray")
    logging.getLogger("flwr").setLevel(logging.WARNING)
