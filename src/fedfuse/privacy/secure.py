"""Secure aggregation of a round's replies (``secagg=true``): the glue between the clients' replies, the SecAgg
protocol (:mod:`fedfuse.fusion.secagg`) and an algorithm whose server step is a sum.

The protocol calls two hooks of the algorithm:

* ``secure_contribution(sent, reply) -> TensorDict`` — **client side**: what the client adds to the sum, computed
  from the payload it received and its own reply (FedAvg: n_i·(θ_i − θ) and n_i);
* ``aggregate_sum(state, info, total) -> ServerState`` — **server side**: the new state from the decoded sum alone.

An algorithm whose update is a mean of deltas writes neither: it declares ``server_update`` and
:class:`fedfuse.algorithms.mean_base.DeltaMean` defines both through :class:`fedfuse.privacy.mean.SecureSum`.

The server code never receives a reply: each contribution is flattened in a fixed key order, quantised to the
ring, masked by the protocol, and only the unmasked *sum* is decoded and handed to ``aggregate_sum``.

What the protocol refuses (``secagg_*`` options, :class:`SecAggSettings`):

* **a small cohort** — fewer than ``min_clients`` (≥ 3) contributions in a sum abort the round
  (:class:`SecAggAbort`; the loop counts it as skipped): a sum over one client is its update;
* **a weak threshold** — a threshold fraction below ½ (t ≤ n/2) is refused before any key is made;
* **an encoding that does not fit** — each client encodes its contribution itself (:func:`client_encode`, the code
  an honest client runs) and drops out of the round — counted in ``secagg_refused``, its masks recovered like any
  dropout's — when it cannot: a declared example count that is not a non-negative integer or exceeds the
  client's public size, an update norm above the absolute bound ``norm_max`` (with ``check_updates``), a non-finite
  value, or a value beyond its share of the ring (:func:`fedfuse.fusion.secagg.client_limit` for the round's
  cohort n: n such values cannot wrap the sum).  Its weight n_i is capped at ``max_weight`` when that is set;
* **a forged weight** — server side, the decoded weight sum (``secagg/count``) must lie within the sum of the
  survivors' public weight bounds; a larger one means a masked input carried a weight no honest client encodes,
  and the round is discarded (:class:`SecAggAbort`).

A malicious client does not run :func:`client_encode`: it can mask any vector of the ring, e.g. a ×1000 update
with an honest weight, and the server cannot tell (it sees only the sum; under central DP the clipping is the
client's own step too).  SecAgg bounds what a faulty client's honest code sends and detects a weight beyond the
public bound; it cannot check a malicious client's update — that needs proofs of a norm bound inside the
protocol (not built) or robust fusion without SecAgg (docs/reliability.md).

On a Flower deployment the protocol runs for real between the nodes (:mod:`fedfuse.flower.secure`: Flower's
SecAgg+ workflow): each node encodes its clients' contributions with :func:`encode_contributions` (the same
fixed-point ring as the simulation) and the executor hands the loop :class:`MaskedReply` objects — the replies'
metadata and statistics without tensors, all pointing at one :class:`SecureTotal`, the ring sum the protocol
decoded.  :func:`secure_round` then skips the simulation and decodes that sum.  Clients
that received the round's payload but did not reply (dropouts, stragglers past the deadline) count as having
shared their keys and then vanished: their pairwise masks are recovered from the survivors' shares.  The
engine's own bookkeeping (bytes, FLOPs, training loss in ``metrics.jsonl``) is simulation-side and reads the
replies' sizes and statistics, not their tensors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedfuse.fusion.secagg import (
    FRAC_BITS,
    MIN_COHORT,
    EncodingError,
    SecAggAbort,
    ServerTranscript,
    dequantize,
    flatten,
    quantize,
    ring_add,
    secure_sum,
    unflatten,
)
from fedfuse.rng import derive_seed
from fedfuse.types import Message, TensorDict

__all__ = ["WEIGHT_KEY", "EncodingError", "MaskedReply", "SecAggAbort", "SecAggSettings", "SecureTotal",
           "client_encode", "encode_contributions", "secure_round", "weight_bound"]

WEIGHT_KEY = "secagg/count"  # the contribution's weight slot (FedAvg: n_i; central DP: the unclipped indicator)


@dataclass(frozen=True)
class SecAggSettings:
    """The run's ``secagg_*`` options (and the absolute update-norm bound an honest client checks itself)."""

    threshold: float = 0.5  # fraction of a client's shareholders needed to reconstruct its secrets
    neighbors: int = 0  # SecAgg+ graph degree k (0 = SecAgg's complete graph)
    frac_bits: int = FRAC_BITS  # fixed-point fraction bits of the quantisation
    min_clients: int = MIN_COHORT  # fewest contributions a sum may hold
    max_weight: int = 0  # cap of a client's weight n_i (0: its public training size only)
    norm_max: float = 0.0  # an honest client drops out when its update norm exceeds this (0: no check)
    centred_count: bool = False  # central DP: the weight slot holds b_i − ½ (the sum may be negative)

    @classmethod
    def from_config(cls, cfg: Any) -> SecAggSettings:
        """The settings of a validated run config."""
        return cls(float(cfg.secagg_threshold), int(cfg.secagg_neighbors), int(cfg.secagg_frac_bits),
                   int(cfg.secagg_min_clients), int(cfg.secagg_max_weight),
                   float(cfg.norm_max) if cfg.check_updates else 0.0, cfg.dp == "central")


@dataclass(frozen=True)
class SecureTotal:
    """A ring sum that a deployment's secure-aggregation protocol already decoded: ``ring`` (int64 in Z_2^62, the
    sum of the contributions of ``clients`` in :func:`encode_contributions`'s layout ``keys``/``shapes``) and what
    the protocol did (``record``, for metrics.jsonl)."""

    ring: torch.Tensor
    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    clients: frozenset[int]
    record: dict[str, Any] = field(default_factory=dict)


@dataclass
class MaskedReply(Message):
    """A client's reply whose tensors never reached the server: metadata and statistics only, and the
    :class:`SecureTotal` its contribution went into (the same object for every client of the round).
    ``upload`` is this client's share of the masked bytes its node sent."""

    summed: SecureTotal | None = None
    upload: int = 0

    @property
    def nbytes(self) -> int:
        return self.upload


# ---- client side ------------------------------------------------------------------------------------------------
def _update_norm(algo: Any, sent: Message, reply: Message) -> float:
    """L2 norm of a reply's update: ``reply − sent`` on the floating tensors it shares (same shape) with the payload
    when replies are model states, the reply's floating tensors themselves otherwise."""
    state_like = algo.reply_kind in ("state", None)
    total = 0.0
    for k, v in reply.tensors.items():
        if not v.is_floating_point():
            continue
        base = sent.tensors.get(k) if state_like else None
        diff = v.double() - base.double() if base is not None and base.shape == v.shape else v.double()
        total += float(torch.linalg.vector_norm(diff)) ** 2
    return math.sqrt(total)


def _bounded_reply(reply: Message, size: int | None, max_weight: int) -> Message:
    """The reply with its declared example count checked against the client's public size and capped at
    ``max_weight``; raises :class:`EncodingError` for a count no honest client declares."""
    if reply.stats is None:
        return reply
    n = reply.stats.num_examples
    if isinstance(n, bool) or not isinstance(n, int | float | np.integer | np.floating) or not math.isfinite(n) \
            or float(n) != int(n) or n < 0:
        raise EncodingError(f"declared example count {n!r} is not a non-negative integer")
    if size is not None and n > size:
        raise EncodingError(f"declares {int(n)} examples, above its public size {size}")
    if max_weight > 0 and n > max_weight:
        return Message(reply.tensors, reply.meta, dataclasses.replace(reply.stats, num_examples=int(max_weight)))
    return reply


def client_encode(algo: Any, sent: Message, reply: Message, cohort: int, settings: SecAggSettings,
                  size: int | None = None) -> tuple[TensorDict, torch.Tensor]:
    """**Client side** (the code an honest client runs): its contribution and the contribution's ring vector for a
    sum over ``cohort`` clients.  Raises :class:`EncodingError` — the client then drops out of the round — for a
    declared count above its public ``size`` or not an integer, an update norm above ``settings.norm_max``, a
    non-finite value, or a value beyond its share of the ring (:func:`fedfuse.fusion.secagg.client_limit`).
    Its weight is capped at ``settings.max_weight`` (when set) before ``algo.secure_contribution`` reads it."""
    reply = _bounded_reply(reply, size, settings.max_weight)
    if settings.norm_max > 0:
        norm = _update_norm(algo, sent, reply)
        if not norm <= settings.norm_max:
            raise EncodingError(f"update norm {norm:.3g} exceeds the absolute bound norm_max={settings.norm_max:g}")
    contrib = algo.secure_contribution(sent, reply)
    return contrib, quantize(flatten(contrib, list(contrib)), settings.frac_bits, cohort)


def encode_contributions(algo: Any, pairs: Sequence[tuple[Message, Message]], frac_bits: int = FRAC_BITS, *,
                         cohort: int = 1, settings: SecAggSettings | None = None,
                         sizes: Mapping[int, int | None] | None = None,
                         cids: Sequence[int] | None = None) -> tuple[torch.Tensor, list[str], list[tuple[int, ...]],
                                                                     dict[int, str]]:
    """**Client side** (a node holding several clients): the ring sum of :func:`client_encode` over its
    ``(sent, reply)`` pairs (client ids ``cids``, public sizes ``sizes``) for a round of ``cohort`` clients, the
    layout (keys, shapes), and the clients that dropped out because their encoding failed (id → reason).
    Raises :class:`EncodingError` when no client's contribution could be encoded."""
    settings = settings or SecAggSettings(frac_bits=frac_bits)
    ring: torch.Tensor | None = None
    keys: list[str] = []
    shapes: list[tuple[int, ...]] = []
    refused: dict[int, str] = {}
    for i, (sent, reply) in enumerate(pairs):
        cid = cids[i] if cids is not None else i
        try:
            contrib, vec = client_encode(algo, sent, reply, cohort, settings, (sizes or {}).get(cid))
        except EncodingError as e:
            refused[cid] = str(e)
            continue
        if ring is None:
            keys, shapes = list(contrib), [tuple(contrib[k].shape) for k in contrib]
        elif list(contrib) != keys or [tuple(contrib[k].shape) for k in keys] != shapes:
            raise ValueError("secure contributions of one round must share one layout (keys and shapes)")
        ring = vec if ring is None else ring_add(ring, vec)
    if ring is None:
        raise EncodingError("no contribution could be encoded: " + "; ".join(f"client {c}: {w}"
                                                                          for c, w in refused.items()))
    return ring, keys, shapes, refused


# ---- server side ------------------------------------------------------------------------------------------------
def _public_sizes(algo: Any, sizes: Sequence[int] | np.ndarray | None) -> Sequence[int] | np.ndarray | None:
    if sizes is not None:
        return sizes
    return algo.ctx.client_sizes


def _size(sizes: Sequence[int] | np.ndarray | None, cid: int) -> int | None:
    return int(sizes[cid]) if sizes is not None and 0 <= cid < len(sizes) else None


def weight_bound(clients: Sequence[int] | frozenset[int], sizes: Sequence[int] | np.ndarray | None,
                 max_weight: int = 0) -> float | None:
    """The largest weight sum honest ``clients`` can encode: Σ min(public size, ``max_weight``) (each at least 1,
    the weight of ``weighting=uniform`` and of central DP's count), or None when a client's bound is unknown."""
    total = 0.0
    for c in clients:
        size = _size(sizes, c)
        caps = [x for x in (size, max_weight if max_weight > 0 else None) if x is not None]
        if not caps:
            return None
        total += max(min(caps), 1)
    return total


def _check_total(total: TensorDict, clients: Sequence[int] | frozenset[int], sizes: Sequence[int] | np.ndarray | None,
                 settings: SecAggSettings) -> None:
    """Server side: the decoded weight sum must be one honest clients can produce (see the module docstring).
    Under central DP (``settings.centred_count``) the slot holds the centred bits b_i − ½: the sum lies in
    [−n/2, n/2]."""
    least = max(settings.min_clients, MIN_COHORT)
    if len(clients) < least:
        raise SecAggAbort(f"the secure sum holds {len(clients)} clients; it needs at least {least} "
                          "(secagg_min_clients): over fewer it would reveal their inputs")
    if WEIGHT_KEY not in total:
        return
    lower, bound = (-len(clients) / 2, len(clients) / 2) if settings.centred_count else \
        (0.0, weight_bound(clients, sizes, settings.max_weight))
    got = float(total[WEIGHT_KEY].sum())
    slack = len(clients) * 2.0 ** -settings.frac_bits
    if not math.isfinite(got) or got < lower - slack or (bound is not None and got > bound + slack):
        raise SecAggAbort(f"the decoded weight sum {got:.6g} lies outside [{lower:g}, {bound:g}], the public bound "
                          f"of the {len(clients)} clients in the sum: a masked input carries a forged weight; round "
                          "discarded")


def _decode(total: SecureTotal, frac_bits: int) -> TensorDict:
    like = {k: torch.zeros(s) for k, s in zip(total.keys, total.shapes, strict=True)}
    return unflatten(dequantize(total.ring, frac_bits), like, list(total.keys))


def _presummed(results: Mapping[int, Message]) -> SecureTotal | None:
    """The deployment's decoded sum when the replies are :class:`MaskedReply` objects (all of them), else None."""
    masked = [r for r in results.values() if isinstance(r, MaskedReply)]
    if not masked:
        return None
    totals = {id(r.summed) for r in masked}
    if len(masked) != len(results) or len(totals) != 1 or masked[0].summed is None:
        raise ValueError("secure aggregation: a round mixes masked replies with plain ones")
    total = masked[0].summed
    if set(results) != set(total.clients):
        raise ValueError(f"secure aggregation: the masked sum holds clients {sorted(total.clients)} but the round "
                         f"kept {sorted(results)} (simulated faults cannot be applied to a sum computed on the nodes)")
    return total


def secure_round(
    algo: Any,
    state: dict[str, Any],
    info: Any,
    sent: dict[int, Message],
    results: dict[int, Message],
    settings: SecAggSettings,
    seed: int,
    sizes: Sequence[int] | np.ndarray | None = None,
) -> tuple[dict[str, Any], dict[str, Any], ServerTranscript]:
    """One secure aggregation: ``(new server state, record for metrics.jsonl, the server's transcript)``.

    Every replying client encodes its own contribution (:func:`client_encode`, for the cohort of ``len(sent)``
    clients the payload went to; ``sizes``: the clients' public training sizes, by default the algorithm
    context's); one whose encoding fails drops out (``secagg_refused``).  Raises :class:`SecAggAbort` when fewer
    than ``settings.min_clients`` contributions or too few clients for the threshold survive, or the decoded
    weight sum exceeds the survivors' public bound (the caller keeps the state).  Replies that are
    :class:`MaskedReply` objects were summed by the nodes' own protocol: their sum is decoded as is (the
    transcript is then empty: the server-side view of that protocol is the executor's)."""
    sizes = _public_sizes(algo, sizes)
    done = _presummed(results)
    if done is not None:
        decoded = _decode(done, settings.frac_bits)
        _check_total(decoded, done.clients, sizes, settings)
        return algo.aggregate_sum(state, info, decoded), dict(done.record), ServerTranscript()
    cohort = len(set(sent) | set(results))
    vectors: dict[int, torch.Tensor] = {}
    refused: dict[int, str] = {}
    like: TensorDict = {}
    for c, r in sorted(results.items()):
        try:
            contrib, vectors[c] = client_encode(algo, sent[c], r, cohort, settings, _size(sizes, c))
        except EncodingError as e:
            refused[c] = str(e)
            continue
        if not like:
            like = contrib
        elif list(contrib) != list(like) or any(contrib[k].shape != like[k].shape for k in like):
            raise ValueError(f"client {c}'s secure contribution has other keys or shapes than client "
                             f"{next(iter(vectors))}'s; secure aggregation sums vectors of one layout")
    if not vectors:
        raise SecAggAbort("no client replied" if not results else
                          f"no contribution could be encoded ({len(refused)} clients refused)")
    keys = list(like)
    absent = sorted((set(sent) - set(results)) | set(refused))
    zeros = torch.zeros_like(next(iter(vectors.values())))
    vectors.update({c: zeros for c in absent})  # never sent: they drop before the masked-input step
    survivors = sorted(set(vectors) - set(absent))
    ring_sum, transcript = secure_sum(vectors, threshold=settings.threshold, neighbors=settings.neighbors,
                                      graph_seed=derive_seed(seed, "secagg-graph", info.index, info.stage),
                                      drop_before_masking=set(absent), min_clients=settings.min_clients)
    total: TensorDict = unflatten(dequantize(ring_sum, settings.frac_bits), like, keys)
    _check_total(total, survivors, sizes, settings)
    record: dict[str, Any] = {"secagg_clients": len(vectors), "secagg_survivors": len(survivors),
                              "secagg_recovered": sum(1 for k in transcript.reconstructed.values() if k == "s")}
    if refused:
        record["secagg_refused"] = {str(c): why for c, why in refused.items()}
    return algo.aggregate_sum(state, info, total), record, transcript
