"""Secure aggregation on a Flower deployment: Flower's own SecAgg+ (``SecAggPlusWorkflow`` on the server,
``secaggplus_mod`` on the ClientApp) carrying fedfuse's contributions (``secagg=true``).

Flower's workflow computes the weighted *mean* of the clients' ``FitRes`` arrays, each clipped to
[−C, C] and stochastically quantised to ``quantization_range`` levels in a ring of at most 2^32.  fedfuse's
secure algorithms need the *sum* of their contributions (n_i·(θ_i − θ) and n_i for FedAvg; clipped updates
and counts under central DP), whose values span far more than 2^32 levels.  So the payload is fitted to
Flower's quantiser instead of the other way round:

1. each node runs its clients' jobs of the round, and encodes the sum of their contributions
   (``algo.secure_contribution``) in fedfuse's fixed-point ring Z_2^62 (:func:`fedfuse.privacy.secure.
   encode_contributions`: the same encoding as the in-process simulation, step 2^-``secagg_frac_bits``);
2. the 62-bit ring elements are split into three 22-bit limbs, and each limb ℓ is sent as the float ℓ − C with
   C = 2^21 and ``quantization_range`` 2^22, so Flower's quantiser (x + C)·2^22/(2C) maps it back to the
   integer ℓ exactly (its stochastic rounding of an integer is the integer itself); every node sends weight 1
   with ``max_weight`` 1, so Flower's weight factor is exactly 2^22 per node;
3. Flower masks, sums and unmasks the limbs in Z_2^32 (per-limb sums stay below 2^32 for up to 1023 nodes)
   and returns (Σℓ − N·C)/N per limb; the executor undoes that affine map (rounding removes the float error of
   the division by N), recombines the limbs into the ring sum and hands it to the loop.

The result is the exact ring sum of the contributions — the same value fedfuse's simulated SecAgg decodes — so
a run with SecAgg+ equals the run without it within the fixed-point step, as in simulation.  Costs: three limbs
make the masked upload 3 × 8 bytes per value (Flower's int64 arrays); a round takes Flower's four protocol
round trips instead of one; and the protocol's participants are **nodes**: a node that serves several clients
of a round sums their contributions before masking (its clients' data is on it anyway), so the server learns
the sum over all nodes, and — as in Flower's design — each node's reply metadata (the clients' training
statistics, as in a plain run) travels in the clear.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fedfuse.engine.contract import Job
from fedfuse.flower import wire
from fedfuse.fusion.secagg import RING_BITS, ring_add
from fedfuse.privacy.secure import MaskedReply, SecAggAbort, SecAggSettings, SecureTotal, encode_contributions
from fedfuse.types import Message as FedfuseMessage

log = logging.getLogger("fedfuse")

LIMB_BITS = 22
LIMBS = -(-RING_BITS // LIMB_BITS)  # 3 limbs of 22 bits hold a 62-bit ring element
TARGET = 1 << LIMB_BITS  # Flower's quantization_range
CLIP = float(TARGET // 2)  # Flower's clipping_range: (x + C)·TARGET/(2C) = x + C, so limb − C quantises to limb
MOD = 1 << 32  # Flower's modulus_range (its largest)
MAX_NODES = MOD // TARGET - 1  # per-limb sums and Flower's weight factor (N·TARGET) stay below the modulus
JOBS = "fedfuse.secure.jobs"  # FitIns config: the node's job messages, serialised
REPLIES = "fedfuse.secure.replies"  # FitRes metrics: the clients' replies without tensors (JSON)
LAYOUT = "fedfuse.secure.layout"  # FitRes metrics: the contribution layout (keys, shapes)


# ---- limbs ----------------------------------------------------------------------------------------------------
def to_limbs(ring: torch.Tensor) -> list[np.ndarray]:
    """A vector of Z_2^62 elements as ``LIMBS`` float arrays ℓ_j − C that Flower's quantiser maps to ℓ_j."""
    v = ring.numpy().astype(np.int64)
    return [((v >> (LIMB_BITS * j)) & (TARGET - 1)).astype(np.float64) - CLIP for j in range(LIMBS)]


def from_limbs(means: Sequence[np.ndarray], nodes: int) -> torch.Tensor:
    """The ring sum from Flower's per-limb outputs (Σℓ_j − N·C)/N over ``nodes`` = N nodes."""
    total: torch.Tensor | None = None
    for j, m in enumerate(means):
        s = np.rint(np.asarray(m, dtype=np.float64) * nodes + nodes * CLIP).astype(np.int64)  # Σ ℓ_j, exact
        keep = RING_BITS - LIMB_BITS * j  # bits of this limb's sum that land inside the ring
        part = torch.from_numpy((s & ((1 << keep) - 1)) << (LIMB_BITS * j))  # < 2^62
        total = part if total is None else ring_add(total, part)
    assert total is not None
    return total


def workflow_shares(settings: SecAggSettings) -> tuple[int | float, float]:
    """Flower's ``num_shares`` and ``reconstruction_threshold`` for fedfuse's ``secagg_neighbors`` (0: every
    node shares with every other, SecAgg) and ``secagg_threshold`` (a fraction of the shares)."""
    shares: int | float = 1.0 if settings.neighbors <= 0 else max(3, settings.neighbors + 1)
    return shares, float(settings.threshold)


# ---- server side ------------------------------------------------------------------------------------------------
class _Proxy:
    """What Flower's workflow needs of a ``ClientProxy``: the node id."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id


class _Round:
    """The part of a legacy ``Strategy`` Flower's SecAgg+ workflow calls: ``configure_fit`` hands it one FitIns
    per node (the node's fedfuse jobs), ``aggregate_fit`` receives the unmasked result (nothing individual: the
    workflow replaces every FitRes's arrays by the aggregate before the call)."""

    def __init__(self, fitins: dict[int, Any]) -> None:
        self.fitins = fitins
        self.results: list[tuple[Any, Any]] | None = None
        self.failures: list[Any] = []

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list[tuple[Any, Any]]:
        return [(_Proxy(n), ins) for n, ins in self.fitins.items()]

    def aggregate_fit(self, server_round: int, results: list[tuple[Any, Any]], failures: list[Any]) -> tuple:
        self.results, self.failures = results, list(failures)
        return None, {}


class _Polling:
    """The grid the workflow talks to: the executor's ``send_and_receive`` (its short reply poll and round
    timeout) in place of the grid's own."""

    def __init__(self, send: Callable[[list[Any]], list[Any]]) -> None:
        self.send = send

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Any]:
        return self.send(list(messages))


def secure_fit(executor: Any, jobs: list[Job], routes: dict[int, int], train: str, round_index: int,
               settings: SecAggSettings) -> dict[int, Any]:
    """Run the round's ``jobs`` (client → node in ``routes``) under Flower's SecAgg+; returns, per client that
    made it into the sum, its :class:`~fedfuse.privacy.secure.MaskedReply` (no tensors; all share one
    :class:`~fedfuse.privacy.secure.SecureTotal`) and its new client state.  Raises
    :class:`~fedfuse.privacy.secure.SecAggAbort` when the workflow halts (too few nodes for the threshold, fewer
    than two nodes)."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.common import FitIns, Parameters, parameters_to_ndarrays
    from flwr.common.serde import recorddict_to_proto
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD

    by_node: dict[int, list[Job]] = {}
    for job in jobs:
        by_node.setdefault(routes[job.cid], []).append(job)
    if len(by_node) > MAX_NODES:
        raise SecAggAbort(f"{len(by_node)} nodes in one round: the limbs' sums would overflow Flower's ring "
                          f"(at most {MAX_NODES})")
    fitins: dict[int, Any] = {}
    payloads: dict[int, tuple[Any, Any]] = {}
    for node, node_jobs in by_node.items():
        blobs = []
        for job in node_jobs:
            if id(job.payload) not in payloads:
                payloads[id(job.payload)] = wire.to_records(job.payload)
            content = executor.message("fit", job, node, payloads[id(job.payload)], train).content
            blobs.append(recorddict_to_proto(content).SerializeToString())
        fitins[node] = FitIns(Parameters(tensors=[], tensor_type="numpy.ndarray"), {
            f"{JOBS}.{i}": b for i, b in enumerate(blobs)})
    strategy = _Round(fitins)
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            strategy=strategy)  # type: ignore[arg-type]
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({"current_round": round_index + 1})
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    shares, threshold = workflow_shares(settings)
    workflow = SecAggPlusWorkflow(shares, threshold, max_weight=1.0, clipping_range=CLIP,
                                  quantization_range=TARGET, modulus_range=MOD, timeout=executor.round_timeout)
    workflow(_Polling(executor.send_and_receive), context)
    if not strategy.results:
        raise SecAggAbort(f"Flower's SecAgg+ halted ({len(by_node)} nodes sampled, {len(strategy.failures)} "
                          "failed; it needs at least two nodes and enough shares for its threshold)")
    return _decode(strategy.results, by_node, parameters_to_ndarrays)


def _decode(results: list[tuple[Any, Any]], by_node: dict[int, list[Job]], to_arrays: Callable) -> dict[int, Any]:
    """The clients' masked replies from the workflow's results (every FitRes carries the same aggregate)."""
    layout = json.loads(str(results[0][1].metrics[LAYOUT]))
    ring = from_limbs(to_arrays(results[0][1].parameters), len(results))
    upload = int(ring.numel()) * LIMBS * 8  # Flower's int64 arrays of masked limbs, per node
    clients: dict[int, Any] = {}
    for proxy, res in results:
        got = wire.join({}, json.loads(str(res.metrics[REPLIES])))
        share = upload // max(len(got), 1)
        for cid, (reply, cstate) in got.items():
            clients[int(cid)] = (reply, cstate, share)
        if proxy.node_id not in by_node:
            raise ValueError(f"SecAgg+: a result from node {proxy.node_id}, which was not sampled")
    total = SecureTotal(ring, tuple(layout["keys"]), tuple(tuple(s) for s in layout["shapes"]),
                        frozenset(clients), {"secagg_nodes": len(results), "secagg_clients": len(clients),
                                             "secagg_flower": 1})
    return {cid: (MaskedReply({}, dict(reply.meta), reply.stats, summed=total, upload=share), cstate)
            for cid, (reply, cstate, share) in sorted(clients.items())}


# ---- client side ------------------------------------------------------------------------------------------------
def secure_mod(msg: Any, context: Any, call_next: Callable[[Any, Any], Any]) -> Any:
    """The ClientApp's mod: Flower's ``secaggplus_mod`` for the messages of a SecAgg+ round, a pass-through for
    every other message (plain runs, evaluation, queries)."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def is_secure_fit(msg: Any) -> bool:
    """Whether ``msg`` is the masked-input step of a SecAgg+ round (the node's fedfuse jobs as FitIns)."""
    rec = msg.content.config_records.get("fitins.config")
    return rec is not None and f"{JOBS}.0" in rec


def node_fit(msg: Any, run_job: Callable[[Any], tuple[Any, Any, Any]], frac_bits: Callable[[Any], int]) -> Any:
    """Node side of a SecAgg+ round: run the node's jobs (``run_job(content) -> (node run, job, result)``), encode
    the sum of their contributions and reply with a FitRes whose arrays are the limbs (``secaggplus_mod`` masks
    them) and whose metrics hold the replies' metadata and statistics only."""
    from flwr.app import RecordDict
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.common.serde import recorddict_from_proto
    from flwr.compat.common.recorddict_compat import fitres_to_recorddict
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    cfg = msg.content.config_records["fitins.config"]
    pairs, replies, algo, bits = [], {}, None, 0
    i = 0
    while f"{JOBS}.{i}" in cfg:
        proto = ProtoRecordDict()
        proto.ParseFromString(cfg[f"{JOBS}.{i}"])
        run, job, (reply, cstate) = run_job(recorddict_from_proto(proto))
        algo, bits = run.algo, frac_bits(run)
        pairs.append((job.payload, reply))
        replies[job.cid] = (FedfuseMessage({}, dict(reply.meta), reply.stats), cstate)
        i += 1
    ring, keys, shapes = encode_contributions(algo, pairs, bits)
    arrays, skeleton = wire.split(replies)
    if arrays:
        raise ValueError("secagg=true on Flower: a client's state carries tensors, which only travel unmasked; "
                         "this algorithm's client state cannot go through SecAgg+")
    metrics = {REPLIES: json.dumps(skeleton, allow_nan=False), LAYOUT: json.dumps({"keys": keys, "shapes": shapes})}
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(to_limbs(ring)), 1, metrics)
    out: RecordDict = fitres_to_recorddict(res, keep_input=False)
    return out
