"""Secure aggregation of a round's replies (``secagg=true``): the glue between the clients' replies, the SecAgg
protocol (:mod:`fedfuse.fusion.secagg`) and an algorithm whose server step is a sum.

An algorithm admits it by declaring ``secagg`` *yes* (:class:`fedfuse.types.Privacy`) and defining two hooks:

* ``secure_contribution(sent, reply) -> TensorDict`` — **client side**: what the client adds to the sum, computed
  from the payload it received and its own reply (FedAvg: n_i·(θ_i − θ) and n_i);
* ``aggregate_sum(state, info, total) -> ServerState`` — **server side**: the new state from the decoded sum alone.

The server code never receives a reply: each contribution is flattened in a fixed key order, quantised to the
ring, masked by the protocol, and only the unmasked *sum* is decoded and handed to ``aggregate_sum``.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedfuse.fusion.secagg import (
    FRAC_BITS,
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

__all__ = ["MaskedReply", "SecAggAbort", "SecAggSettings", "SecureTotal", "encode_contributions", "secure_round"]


@dataclass(frozen=True)
class SecAggSettings:
    """The run's ``secagg_*`` options."""

    threshold: float = 0.5  # fraction of a client's shareholders needed to reconstruct its secrets
    neighbors: int = 0  # SecAgg+ graph degree k (0 = SecAgg's complete graph)
    frac_bits: int = FRAC_BITS  # fixed-point fraction bits of the quantisation


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


def encode_contributions(algo: Any, pairs: Sequence[tuple[Message, Message]],
                         frac_bits: int = FRAC_BITS) -> tuple[torch.Tensor, list[str], list[tuple[int, ...]]]:
    """**Client side** (a node holding several clients): the ring sum of the contributions
    ``algo.secure_contribution(sent, reply)`` of its ``(sent, reply)`` pairs, with the layout (keys, shapes)."""
    ring: torch.Tensor | None = None
    keys: list[str] = []
    shapes: list[tuple[int, ...]] = []
    for sent, reply in pairs:
        contrib = algo.secure_contribution(sent, reply)
        if ring is None:
            keys, shapes = list(contrib), [tuple(contrib[k].shape) for k in contrib]
        elif list(contrib) != keys or [tuple(contrib[k].shape) for k in keys] != shapes:
            raise ValueError("secure contributions of one round must share one layout (keys and shapes)")
        vec = quantize(flatten(contrib, keys), frac_bits)
        ring = vec if ring is None else ring_add(ring, vec)
    if ring is None:
        raise ValueError("no contribution to encode")
    return ring, keys, shapes


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
) -> tuple[dict[str, Any], dict[str, Any], ServerTranscript]:
    """One secure aggregation: ``(new server state, record for metrics.jsonl, the server's transcript)``.

    Raises :class:`SecAggAbort` when too few clients survive for the threshold (the caller keeps the state).
    Replies that are :class:`MaskedReply` objects were summed by the nodes' own protocol: their sum is decoded
    as is (the transcript is then empty: the server-side view of that protocol is the executor's)."""
    done = _presummed(results)
    if done is not None:
        return algo.aggregate_sum(state, info, _decode(done, settings.frac_bits)), dict(done.record), \
            ServerTranscript()
    contributions = {c: algo.secure_contribution(sent[c], r) for c, r in sorted(results.items())}
    absent = sorted(set(sent) - set(results))
    if not contributions:
        raise SecAggAbort("no client replied")
    like = next(iter(contributions.values()))
    keys = list(like)
    for c, contrib in contributions.items():
        if list(contrib) != keys or any(contrib[k].shape != like[k].shape for k in keys):
            raise ValueError(f"client {c}'s secure contribution has other keys or shapes than client "
                             f"{next(iter(contributions))}'s; secure aggregation sums vectors of one layout")
    vectors = {c: quantize(flatten(v, keys), settings.frac_bits) for c, v in contributions.items()}
    zeros = torch.zeros_like(next(iter(vectors.values())))
    vectors.update({c: zeros for c in absent})  # never sent: they drop before the masked-input step
    ring_sum, transcript = secure_sum(vectors, threshold=settings.threshold, neighbors=settings.neighbors,
                                      graph_seed=derive_seed(seed, "secagg-graph", info.index, info.stage),
                                      drop_before_masking=set(absent))
    total: TensorDict = unflatten(dequantize(ring_sum, settings.frac_bits), like, keys)
    record = {"secagg_clients": len(vectors), "secagg_survivors": len(contributions),
              "secagg_recovered": sum(1 for k in transcript.reconstructed.values() if k == "s")}
    return algo.aggregate_sum(state, info, total), record, transcript
