"""Secure aggregation of a round's replies (``secagg=true``): the glue between the clients' replies, the SecAgg
protocol (:mod:`fedfuse.fusion.secagg`) and an algorithm whose server step is a sum.

An algorithm admits it by declaring ``secagg`` *yes* (:class:`fedfuse.types.Privacy`) and defining two hooks:

* ``secure_contribution(sent, reply) -> TensorDict`` — **client side**: what the client adds to the sum, computed
  from the payload it received and its own reply (FedAvg: n_i·(θ_i − θ) and n_i);
* ``aggregate_sum(state, info, total) -> ServerState`` — **server side**: the new state from the decoded sum alone.

The server code never receives a reply: each contribution is flattened in a fixed key order, quantised to the
ring, masked by the protocol, and only the unmasked *sum* is decoded and handed to ``aggregate_sum``.  Clients
that received the round's payload but did not reply (dropouts, stragglers past the deadline) count as having
shared their keys and then vanished: their pairwise masks are recovered from the survivors' shares.  The
engine's own bookkeeping (bytes, FLOPs, training loss in ``metrics.jsonl``) is simulation-side and reads the
replies' sizes and statistics, not their tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedfuse.fusion.secagg import (
    FRAC_BITS,
    SecAggAbort,
    ServerTranscript,
    dequantize,
    flatten,
    quantize,
    secure_sum,
    unflatten,
)
from fedfuse.rng import derive_seed
from fedfuse.types import Message, TensorDict

__all__ = ["SecAggAbort", "SecAggSettings", "secure_round"]


@dataclass(frozen=True)
class SecAggSettings:
    """The run's ``secagg_*`` options."""

    threshold: float = 0.5  # fraction of a client's shareholders needed to reconstruct its secrets
    neighbors: int = 0  # SecAgg+ graph degree k (0 = SecAgg's complete graph)
    frac_bits: int = FRAC_BITS  # fixed-point fraction bits of the quantisation


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

    Raises :class:`SecAggAbort` when too few clients survive for the threshold (the caller keeps the state)."""
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
