"""Server-side checks of client updates before fusion; a bad update is quarantined, never fused.

A reply is quarantined, with its reason, when

1. it declares a non-integer, negative, or larger example count than the client's known training size;
2. it reports a non-finite training loss, or any of its tensors holds a NaN or an Inf;
3. a tensor has another shape or dtype than the tensor of the same name that was sent (when replies live in the
   payload's space: model states, or deltas as in FedMerge), or — otherwise (FedMA's own-size layers, MSfusion's
   sub-models, IFCA's chosen cluster model) — than the shape and dtype that a strict majority of the round's
   replies agree on.  Tensors addressed to a peer (``sim/peer/{m}/…``, see :mod:`fedfuse.engine.peers`) are not
   voted on: their shape depends on the sender as well as the receiver (MSfusion sends each peer exactly the
   overlap of two windows), so different senders legitimately send different shapes under the same name.  An
   algorithm that knows a reply's shapes from its metadata says so with ``reply_shapes(cid, reply)`` (MSfusion:
   a participant's sub-model follows its own μ_n, so with heterogeneous μ a majority vote would quarantine the
   minority's valid sub-models); those tensors are checked against it instead of the vote;
4. it holds a key that was not sent, in algorithms whose replies are the sent model trained further
   ("state-like": every other reply's keys are a subset of its payload's keys);
5. its update norm exceeds ``norm_bound`` times the median norm of the round's replies (with >= 3 replies), or —
   in a round with fewer than 3 replies, where a median is no reference (with two replies, a ×1000 update is
   half the "median") — the absolute bound ``norm_max``.  The update is ``reply - sent`` for state-like replies
   and the reply itself otherwise (deltas, sub-models).

The checks catch malformed replies and grossly scaled updates; they do not catch an update scaled less than
``norm_bound`` × the median (a ×50 update passes the default 100×), nor a well-formed but poisoned one: those need
robust fusion (``fusion=median``/``trimmed-mean``) or ``clip_norm`` (docs/reliability.md).

The checks read the replies only; the server state is untouched until the remaining replies are fused.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fedfuse.engine.contract import Algorithm
from fedfuse.engine.faults import update_norm
from fedfuse.engine.peers import PEER_PREFIX
from fedfuse.types import Message


def is_state_like(algo: Algorithm, sent: Mapping[int, Message], replies: Mapping[int, Message]) -> bool:
    """Whether replies are the sent model trained further (keys a subset of the payload's keys).

    An algorithm says so in ``reply_kind``: ``"state"``, ``"delta"`` (same keys and shapes as the payload, but a
    difference) or ``"other"`` (replies are not in the payload's space, e.g. FedMA's own-size layers); with
    ``None`` the round's replies vote."""
    if algo.reply_kind is not None:
        return algo.reply_kind == "state"
    votes = [bool(r.tensors) and bool(sent[c].tensors) and set(r.tensors) <= set(sent[c].tensors)
             for c, r in replies.items() if c in sent]
    return bool(votes) and sum(votes) * 2 > len(votes)


def check_meta(reply: Message, known_size: int | None) -> str | None:
    if reply.stats is None:
        return None
    n = reply.stats.num_examples
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int | float | np.integer | np.floating) or not math.isfinite(n) \
                or float(n) != int(n):
            return f"declared example count {n!r} is not an integer"
        if n < 0:
            return f"declared example count {n} is negative"
        if known_size is not None and n > known_size:
            return f"declares {int(n)} examples but holds {known_size}"
    loss = reply.stats.train_loss
    if isinstance(loss, float) and not math.isfinite(loss):
        return f"non-finite training loss ({loss})"
    return None


def check_values(reply: Message) -> str | None:
    """The first tensor holding a NaN or Inf, if any.  The tensors of one dtype and device are screened by their
    norms in one fused call (a NaN or Inf makes a norm non-finite; a reply may hold hundreds of small peer
    tensors); only a group whose screen fails — a non-finite value, or a norm that overflowed — is searched key by
    key, element by element."""
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for k, v in reply.tensors.items():
        if v.is_floating_point() or v.is_complex():
            groups.setdefault((v.dtype, v.device), []).append(k)
    for keys in groups.values():
        norms = torch._foreach_norm([reply.tensors[k] for k in keys])
        if bool(torch.isfinite(torch.stack(norms)).all()):
            continue
        for k in keys:
            v = reply.tensors[k]
            if not bool(torch.isfinite(v).all()):
                what = "NaN" if bool(torch.isnan(v).any()) else "Inf"
                return f"non-finite values ({what}) in {k}"
    return None


def _overlap_matches(sent: Mapping[int, Message], replies: Mapping[int, Message]) -> bool:
    """Whether most replies that share keys with their payload also share those keys' shapes (then a reply's
    tensors are compared with the payload's)."""
    votes = []
    for c, r in replies.items():
        common = [k for k in r.tensors if k in sent.get(c, Message()).tensors]
        if common:
            votes.append(all(r.tensors[k].shape == sent[c].tensors[k].shape for k in common))
    return bool(votes) and sum(votes) * 2 > len(votes)


def _signature(v: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(v.shape), v.dtype


Signature = tuple[tuple[int, ...], torch.dtype]


def _modal(replies: Mapping[int, Message]) -> dict[str, tuple[Signature, int, int]]:
    """Per key: the most common (shape, dtype) among the round's replies, its count and the key's total count."""
    by_key: dict[str, Counter] = {}
    for r in replies.values():
        for k, v in r.tensors.items():
            by_key.setdefault(k, Counter())[_signature(v)] += 1
    return {k: (*cnt.most_common(1)[0], sum(cnt.values())) for k, cnt in by_key.items()}


def _shape_problem(reply: Message, payload: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]],
                   state_like: bool, modal: Mapping[str, tuple[Signature, int, int]]) -> str | None:
    """Why one reply's tensors have the wrong keys, shapes or dtypes: against the shapes the algorithm declares
    for it, else what was sent, else the round's strict majority (peer messages are not voted on)."""
    for k, v in reply.tensors.items():
        if k in expected:
            if tuple(v.shape) != tuple(expected[k]):
                return f"{k} has shape {tuple(v.shape)}, its selection gives {tuple(expected[k])}"
        elif k in payload:
            want = _signature(payload[k])
            if _signature(v) != want:
                return f"{k} has shape {tuple(v.shape)} {v.dtype}, sent {want[0]} {want[1]}"
        elif state_like:
            return f"unexpected key {k} (not in what was sent)"
        elif not k.startswith(PEER_PREFIX):  # a peer message's shape depends on its sender: no vote
            sig, n, total = modal[k]
            if _signature(v) != sig and n * 2 > total and n >= 2:
                return f"{k} has shape {tuple(v.shape)} {v.dtype}, the round's other replies {sig[0]} {sig[1]}"
    return None


MEDIAN_REPLIES = 3  # the fewest replies whose median norm is a reference for norm_bound


def _norm_outliers(sent: Mapping[int, Message], replies: Mapping[int, Message], state_like: bool,
                   norm_bound: float, norm_max: float = 0.0) -> dict[int, str]:
    """Replies whose update norm exceeds ``norm_bound`` × the round's median (with >= 3 replies), or the absolute
    ``norm_max`` (with fewer)."""
    if (norm_bound <= 0 and norm_max <= 0) or not replies:
        return {}
    norms = {c: update_norm(sent.get(c, Message()), r, state_like) for c, r in replies.items()}
    if len(norms) < MEDIAN_REPLIES:
        if norm_max <= 0:
            return {}
        return {c: f"update norm {v:.3g} exceeds the absolute bound norm_max={norm_max:g} (fewer than "
                   f"{MEDIAN_REPLIES} replies: no median to compare with)"
                for c, v in norms.items() if not v <= norm_max}
    med = float(np.median(list(norms.values())))
    if med <= 0 or norm_bound <= 0:
        return {}
    return {c: f"update norm {v:.3g} exceeds {norm_bound:g} x the round's median {med:.3g}"
            for c, v in norms.items() if v > norm_bound * med}


def check_replies(
    algo: Algorithm,
    sent: Mapping[int, Message],
    replies: Mapping[int, Message],
    sizes: Sequence[int] | np.ndarray | None = None,
    norm_bound: float = 0.0,
    norm_max: float = 0.0,
) -> dict[int, str]:
    """Reasons, per client id, for the replies that must not be fused (see the module docstring)."""
    bad: dict[int, str] = {}
    state_like = is_state_like(algo, sent, replies)
    kind = algo.reply_kind
    same_space = state_like or kind == "delta" or (kind is None and _overlap_matches(sent, replies))
    for c, r in replies.items():
        known = int(sizes[c]) if sizes is not None and 0 <= c < len(sizes) else None
        why = check_meta(r, known) or check_values(r)
        if why:
            bad[c] = why
    modal = _modal(replies)
    for c, r in replies.items():
        payload = sent.get(c, Message()).tensors if same_space else {}
        why = None if c in bad else _shape_problem(r, payload, algo.reply_shapes(c, r), state_like, modal)
        if why:
            bad[c] = why
    bad.update(_norm_outliers(sent, {c: r for c, r in replies.items() if c not in bad}, state_like, norm_bound,
                              norm_max))
    return dict(sorted(bad.items()))


__all__ = ["check_meta", "check_replies", "check_values", "is_state_like"]
