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

What fedfuse changes in Flower's protocol, and what it refuses:

* **Masks from 256-bit keys.**  flwr 1.41 expands every mask (a node's self mask and each pairwise mask) with
  ``pseudo_rand_gen``, which folds the 32-byte secret into a 32-bit seed of numpy's Mersenne Twister: the server,
  knowing a node's self-mask seed after unmasking, can search the 2^32 seeds of a remaining pairwise mask (with
  one neighbour, or when all but one neighbour dropped and their keys were rebuilt).  fedfuse's ServerApp and
  ClientApp both install :func:`aes_masks` in its place (:func:`use_strong_masks`): AES-256-CTR keyed by
  SHA-256 of the full secret, the PRG of fedfuse's own protocol simulation.  Both sides run fedfuse, so they
  expand the same masks; a node of an older fedfuse would make the sum undecodable (the weight check below then
  discards the round).
* **A minimum cohort of nodes and clients.**  A round with fewer than ``secagg_min_clients`` (≥ 3) sampled
  nodes or clients does not start; each node refuses to send its unmasking shares when fewer than 3 nodes sent a
  masked vector (:func:`secure_mod`), so a sum over one or two nodes is never unmasked; and the server discards a
  sum with fewer nodes or clients than the minimum (:class:`SecAggAbort`): over two nodes each would learn the
  other's contribution from the next model.
* **A strict-majority threshold.**  Flower's threshold is passed as a number of shares t = ⌊f·h⌋ + 1 > h/2 of
  the h shares of a neighbourhood (Flower's own float rule, round(f·h), gives t = h/2 for even h at f = ½).
* **Honest encoding.**  Each node encodes its clients with :func:`fedfuse.privacy.secure.client_encode` for the
  round's cohort: a client whose encoding fails is left out of the sum (its node reports why; the loop counts it
  as a dropout), and a node none of whose clients can be encoded drops out of the protocol.

The result is the exact ring sum of the contributions — the same value fedfuse's simulated SecAgg decodes — so
a run with SecAgg+ equals the run without it within the fixed-point step, as in simulation.  Costs: three limbs
make the masked upload 3 × 8 bytes per value (Flower's int64 arrays); a round takes Flower's four protocol
round trips instead of one; and the protocol's participants are **nodes**: a node that serves several clients
of a round sums their contributions before masking (its clients' data is on it anyway), so the server learns
the sum over all nodes, and — as in Flower's design — each node's reply metadata (the clients' training
statistics, as in a plain run) travels in the clear.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedfuse.engine.contract import Job
from fedfuse.flower import wire
from fedfuse.fusion.secagg import MIN_COHORT, RING_BITS, check_threshold, ring_add
from fedfuse.privacy.secure import (
    EncodingError,
    MaskedReply,
    SecAggAbort,
    SecAggSettings,
    SecureTotal,
    encode_contributions,
)
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
REFUSED = "fedfuse.secure.refused"  # FitRes metrics: the node's clients whose encoding failed (JSON id -> reason)
ENCODING = "fedfuse.secure.encoding"  # FitIns config: the round's cohort and the bounds the server accepts (JSON)
#: the flwr modules that expand SecAgg+ masks with ``pseudo_rand_gen`` (server workflow, client mod)
MASK_MODULES = ("flwr.server.workflow.secure_aggregation.secaggplus_workflow",
                "flwr.client.mod.secure_aggregation.secaggplus_mod")


# ---- masks ------------------------------------------------------------------------------------------------------
def aes_masks(seed: bytes, num_range: int, dimensions_list: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Flower's ``pseudo_rand_gen`` interface with a cryptographic generator: uniform integers in
    [0, ``num_range``) from AES-256-CTR keyed by SHA-256 of the whole ``seed`` (no 32-bit fold), one array per
    shape (a scalar for ``()``)."""
    key = hashlib.sha256(b"fedfuse-secaggplus-mask/" + bytes(seed)).digest()
    enc = Cipher(algorithms.AES(key), modes.CTR(b"\0" * 16)).encryptor()
    out = []
    for dims in dimensions_list:
        n = math.prod(dims)
        words = np.frombuffer(enc.update(b"\0" * (8 * max(n, 1))), dtype=np.uint64)
        vals = (words & np.uint64(num_range - 1) if num_range & (num_range - 1) == 0
                else words % np.uint64(num_range)).astype(np.int64)  # modulo bias <= num_range / 2^64
        out.append(np.array(vals[0], dtype=np.int64) if len(dims) == 0 else vals[:n].reshape(dims))
    return out


def use_strong_masks() -> None:
    """Make Flower's SecAgg+ (workflow and mod, in this process) expand its masks with :func:`aes_masks`."""
    # the package rebinds the name secaggplus_mod to the function: take the modules from sys.modules
    import flwr.client.mod.secure_aggregation.secaggplus_mod
    import flwr.server.workflow.secure_aggregation.secaggplus_workflow  # noqa: F401

    for name in MASK_MODULES:
        module = sys.modules[name]
        if getattr(module, "pseudo_rand_gen", None) is not aes_masks:
            module.pseudo_rand_gen = aes_masks  # type: ignore[attr-defined]


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


def workflow_shares(settings: SecAggSettings, nodes: int) -> tuple[int, int]:
    """Flower's ``num_shares`` and ``reconstruction_threshold``, as numbers, for ``nodes`` (≥ 3) sampled nodes:
    every node (``secagg_neighbors`` 0, SecAgg) or an odd neighbourhood of at least 3 around each node (k + 1
    shares), and t = ⌊f·h⌋ + 1 > h/2 of its h shares (f = ``secagg_threshold``), below h (Flower's rule)."""
    check_threshold(settings.threshold)
    if nodes < MIN_COHORT:
        raise SecAggAbort(f"SecAgg+ needs at least {MIN_COHORT} nodes, got {nodes}")
    shares = nodes if settings.neighbors <= 0 else min(nodes, max(3, settings.neighbors + 1))
    if shares < nodes and shares % 2 == 0:
        shares += 1  # Flower's neighbourhoods are symmetric: an odd number of shares
    return shares, min(math.floor(settings.threshold * shares) + 1, shares - 1)


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
    least = max(settings.min_clients, MIN_COHORT)
    if len(by_node) < least or len(jobs) < least:
        raise SecAggAbort(f"{len(by_node)} nodes with {len(jobs)} clients in one round: a secure sum needs at least "
                          f"{least} of each (secagg_min_clients)")
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
        encoding = json.dumps({"cohort": len(jobs), "max_weight": settings.max_weight,
                               "norm_max": settings.norm_max})
        fitins[node] = FitIns(Parameters(tensors=[], tensor_type="numpy.ndarray"), {
            ENCODING: encoding, **{f"{JOBS}.{i}": b for i, b in enumerate(blobs)}})
    strategy = _Round(fitins)
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            strategy=strategy)  # type: ignore[arg-type]
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({"current_round": round_index + 1})
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    shares, threshold = workflow_shares(settings, len(by_node))
    use_strong_masks()
    workflow = SecAggPlusWorkflow(shares, threshold, max_weight=1.0, clipping_range=CLIP,
                                  quantization_range=TARGET, modulus_range=MOD, timeout=executor.round_timeout)
    workflow(_Polling(executor.send_and_receive), context)
    if not strategy.results:
        raise SecAggAbort(f"Flower's SecAgg+ halted ({len(by_node)} nodes sampled, {len(strategy.failures)} "
                          f"failed; it needs {threshold} of {shares} shares per node)")
    if len(strategy.results) < least:
        raise SecAggAbort(f"only {len(strategy.results)} nodes are in the SecAgg+ sum; it needs at least {least} "
                          "(secagg_min_clients): the sum is discarded")
    return _decode(strategy.results, by_node, parameters_to_ndarrays)


def _decode(results: list[tuple[Any, Any]], by_node: dict[int, list[Job]], to_arrays: Callable) -> dict[int, Any]:
    """The clients' masked replies from the workflow's results (every FitRes carries the same aggregate)."""
    layout = json.loads(str(results[0][1].metrics[LAYOUT]))
    ring = from_limbs(to_arrays(results[0][1].parameters), len(results))
    upload = int(ring.numel()) * LIMBS * 8  # Flower's int64 arrays of masked limbs, per node
    clients: dict[int, Any] = {}
    refused: dict[str, str] = {}
    for proxy, res in results:
        refused.update(json.loads(str(res.metrics.get(REFUSED, "{}"))))
        got = wire.join({}, json.loads(str(res.metrics[REPLIES])))
        share = upload // max(len(got), 1)
        for cid, (reply, cstate) in got.items():
            clients[int(cid)] = (reply, cstate, share)
        if proxy.node_id not in by_node:
            raise ValueError(f"SecAgg+: a result from node {proxy.node_id}, which was not sampled")
    record: dict[str, Any] = {"secagg_nodes": len(results), "secagg_clients": len(clients), "secagg_flower": 1}
    if refused:
        record["secagg_refused"] = refused
    total = SecureTotal(ring, tuple(layout["keys"]), tuple(tuple(s) for s in layout["shapes"]),
                        frozenset(clients), record)
    return {cid: (MaskedReply({}, dict(reply.meta), reply.stats, summed=total, upload=share), cstate)
            for cid, (reply, cstate, share) in sorted(clients.items())}


# ---- client side ------------------------------------------------------------------------------------------------
def secure_mod(msg: Any, context: Any, call_next: Callable[[Any, Any], Any]) -> Any:
    """The ClientApp's mod: Flower's ``secaggplus_mod`` for the messages of a SecAgg+ round (with
    :func:`aes_masks`), a pass-through for every other message (plain runs, evaluation, queries).

    The node itself refuses — with an error reply, which Flower's workflow counts as this node's dropout — to send
    its unmasking shares when fewer than 3 nodes sent a masked vector (then no sum over one or two nodes can be
    unmasked, whatever the server's settings), and to join a round none of whose clients it could encode."""
    from flwr.app import Error, Message
    from flwr.client.mod import secaggplus_mod
    from flwr.common.constant import ErrorCode
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

    if RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)
    use_strong_masks()
    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    why = None
    if configs.get(Key.STAGE) == Stage.UNMASK and len(configs.get(Key.ACTIVE_NODE_ID_LIST, [])) < MIN_COHORT:
        why = (f"SecAgg+: only {len(configs[Key.ACTIVE_NODE_ID_LIST])} nodes sent a masked vector; this node "
               f"unmasks no sum over fewer than {MIN_COHORT}")
    else:
        try:
            return secaggplus_mod(msg, context, call_next)
        except EncodingError as e:
            why = f"SecAgg+: this node has no client it can encode: {e}"
    log.warning("%s", why)
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=why), reply_to=msg)


def is_secure_fit(msg: Any) -> bool:
    """Whether ``msg`` is the masked-input step of a SecAgg+ round (the node's fedfuse jobs as FitIns)."""
    rec = msg.content.config_records.get("fitins.config")
    return rec is not None and f"{JOBS}.0" in rec


def node_fit(msg: Any, run_job: Callable[[Any], tuple[Any, Any, Any]], frac_bits: Callable[[Any], int]) -> Any:
    """Node side of a SecAgg+ round: run the node's jobs (``run_job(content) -> (node run, job, result)``), encode
    the sum of their contributions (each client as an honest client encodes itself, for the round's cohort and
    within the bounds the server sent; a client that cannot is left out) and reply with a FitRes whose arrays are
    the limbs (``secaggplus_mod`` masks them) and whose metrics hold the replies' metadata and statistics only.
    Raises :class:`~fedfuse.privacy.secure.EncodingError` (the node drops out) when no client can be encoded."""
    from flwr.app import RecordDict
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.common.serde import recorddict_from_proto
    from flwr.compat.common.recorddict_compat import fitres_to_recorddict
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    cfg = msg.content.config_records["fitins.config"]
    pairs, replies, cids, sizes, run = [], {}, [], {}, None
    i = 0
    while f"{JOBS}.{i}" in cfg:
        proto = ProtoRecordDict()
        proto.ParseFromString(cfg[f"{JOBS}.{i}"])
        run, job, (reply, cstate) = run_job(recorddict_from_proto(proto))
        pairs.append((job.payload, reply))
        cids.append(job.cid)
        known = run.ctx.client_sizes
        sizes[job.cid] = int(known[job.cid]) if 0 <= job.cid < len(known) else None
        replies[job.cid] = (FedfuseMessage({}, dict(reply.meta), reply.stats), cstate)
        i += 1
    if run is None:
        raise ValueError("a SecAgg+ round's fit message without jobs")
    bounds = json.loads(str(cfg.get(ENCODING, "{}")))
    settings = dataclasses.replace(SecAggSettings(), frac_bits=frac_bits(run),
                                   max_weight=int(bounds.get("max_weight", 0)),
                                   norm_max=float(bounds.get("norm_max", 0.0)))
    ring, keys, shapes, refused = encode_contributions(run.algo, pairs, settings.frac_bits,
                                                       cohort=int(bounds.get("cohort", len(pairs))),
                                                       settings=settings, sizes=sizes, cids=cids)
    for cid, why in refused.items():
        log.warning("SecAgg+: client %d is left out of the sum: %s", cid, why)
        del replies[cid]
    arrays, skeleton = wire.split(replies)
    if arrays:
        raise ValueError("secagg=true on Flower: a client's state carries tensors, which only travel unmasked; "
                         "this algorithm's client state cannot go through SecAgg+")
    metrics = {REPLIES: json.dumps(skeleton, allow_nan=False), LAYOUT: json.dumps({"keys": keys, "shapes": shapes}),
               REFUSED: json.dumps({str(c): w for c, w in refused.items()})}
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(to_limbs(ring)), 1, metrics)
    out: RecordDict = fitres_to_recorddict(res, keep_input=False)
    return out
