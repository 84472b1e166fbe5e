"""Layer recombination operators (FedMR, Hu et al.): pure functions on lists of named tensors.

A *unit* is a tuple of state-dict keys that always travels together.  With ``granularity="module"`` a unit
is one :class:`~fedfuse.models.base.Layer` of ``model.layers()`` — a module with *all* its parameters and
buffers, so a BatchNorm's ``running_mean``/``running_var``/``num_batches_tracked`` stay with its affine
``weight``/``bias``.  ``granularity="key"`` makes every state key its own unit (the author code's
per-``state_dict``-key shuffle, which separates BN statistics from their affine parameters).  FedMR-p groups
the layer sequence into ``p`` contiguous segments (:func:`segment_units`).

Every operator here *moves* tensors, never mixes them: each recombined model holds exactly one copy of every
unit position, and every uploaded unit is used by exactly one recombined model (the multiset invariant).
Integer buffers (``num_batches_tracked``) and parameters a client did not train move with their unit like
any other tensor; a key missing from every input is an error (there is nothing to move).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedfuse.errors import UserError
from fedfuse.fusion.average import flat_vector
from fedfuse.types import TensorDict

Unit = tuple[str, ...]


def units_from_layers(layers: Sequence[Sequence[str]], granularity: str = "module") -> list[Unit]:
    """Recombination units from a model's layer key groups (input-to-output order).

    ``layers`` is e.g. ``[layer.keys for layer in model.layers()]``.  ``"module"`` keeps each group;
    ``"key"`` splits every group into single keys (author code).
    """
    if granularity == "module":
        return [tuple(keys) for keys in layers if keys]
    if granularity == "key":
        return [(k,) for keys in layers for k in keys]
    raise UserError(f"granularity={granularity!r}; choose module or key")


def segment_units(units: Sequence[Unit], segments: int) -> list[Unit]:
    """Merge ``units`` into ``segments`` contiguous segments (FedMR-p); 0 keeps the units as they are.

    Unit ``l`` (0-based, of ``L``) goes to segment ``floor(l * p / L)``, so every segment holds at least one
    unit when ``p <= L``.  ``p = 1`` is a single segment: models are only re-dispatched, never mixed.
    """
    if segments <= 0:
        return [tuple(u) for u in units]
    n = len(units)
    if segments > n:
        raise UserError(f"segments={segments} but the model has only {n} recombination units")
    out: list[list[str]] = [[] for _ in range(segments)]
    for i, u in enumerate(units):
        out[i * segments // n].extend(u)
    return [tuple(s) for s in out]


def check_units(units: Sequence[Unit], keys: Sequence[str]) -> None:
    """Raise unless ``units`` partition ``keys`` exactly (no key lost, none duplicated)."""
    flat = [k for u in units for k in u]
    if len(flat) != len(set(flat)):
        raise ValueError("a state key appears in two recombination units")
    if set(flat) != set(keys):
        missing, extra = set(keys) - set(flat), set(flat) - set(keys)
        raise ValueError(f"units do not cover the state: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}")


def random_unit_permutations(num_units: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """An independent uniform permutation of ``range(k)`` per unit: array (num_units, k)."""
    return np.stack([rng.permutation(k) for _ in range(num_units)]) if num_units else np.zeros((0, k), np.int64)


def recombine(
    states: Sequence[Mapping[str, torch.Tensor]], units: Sequence[Unit], perms: np.ndarray
) -> list[TensorDict]:
    """New model ``j`` takes unit ``u`` from input model ``perms[u, j]`` (tensors cloned, bit-exact).

    ``perms[u]`` must be a permutation of ``range(len(states))`` for every unit, which is what makes the
    operation a pure reshuffle: every input unit lands in exactly one output model.
    """
    k = len(states)
    perms = np.asarray(perms)
    if perms.shape != (len(units), k):
        raise ValueError(f"perms has shape {perms.shape}, expected {(len(units), k)}")
    for u, p in enumerate(perms):
        if sorted(int(i) for i in p) != list(range(k)):
            raise ValueError(f"perms[{u}] = {list(p)} is not a permutation of range({k})")
    for i, st in enumerate(states):
        missing = [key for keys in units for key in keys if key not in st]
        if missing:
            raise ValueError(f"model {i} lacks {missing[:3]}: recombination moves whole units, every model "
                             "must send every key (send untrained parameters unchanged)")
    out: list[TensorDict] = [{} for _ in range(k)]
    for u, keys in enumerate(units):
        for j in range(k):
            src = states[int(perms[u, j])]
            for key in keys:
                out[j][key] = src[key].detach().clone()
    if states:  # keep the original key order
        order = list(states[0].keys())
        out = [{key: o[key] for key in order if key in o} for o in out]
    return out


def unit_bytes(state: Mapping[str, torch.Tensor], unit: Unit) -> int:
    """Bytes of one unit (dtype size x numel of all its tensors, buffers included)."""
    return int(sum(state[k].numel() * state[k].element_size() for k in unit))


# ---------------------------------------------------------------------------------------------------------
# Secure recombination (FedMR paper, Appendix B): a client-side exchange of layers.


@dataclass
class SecureExchange:
    """Outcome of one or more passes of the four-stage secure exchange among ``K`` clients.

    ``sources[j, u]`` is the client whose trained unit ``u`` client ``j`` finally holds; ``messages`` lists
    every peer transfer as (sender, receiver, unit) — stage-1 sends and stage-3 returns — and ``passes`` how
    many passes were run.
    """

    sources: np.ndarray
    messages: list[tuple[int, int, int]]
    passes: int


def secure_exchange_pass(
    holding: np.ndarray, rng: np.random.Generator, send_prob: float = 0.5
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """One four-stage pass over the ``(K, U)`` array ``holding`` (which original unit each client holds).

    Stage 1: every client sends each unit with probability ``send_prob`` to one other active client chosen
    uniformly (a unit goes to exactly one client) and keeps the rest in its per-unit buffers.  Stage 2: each
    receiver adds what arrives to the matching buffer.  Stage 3: for every buffer that received something,
    the receiver returns one uniformly drawn element per sender (without replacement) to that sender.  Stage
    4: every client assembles its model from what is left in its buffers plus what came back.  Every client
    that sent unit ``u`` gets exactly one unit ``u`` back and a client that kept it keeps exactly one, so each
    client ends with one copy of every unit and the multiset is preserved.
    """
    k, n_units = holding.shape
    new = holding.copy()
    messages: list[tuple[int, int, int]] = []
    if k < 2:
        return new, messages
    for u in range(n_units):
        buffers: list[list[int]] = [[] for _ in range(k)]  # entries: original source client of the unit
        senders: list[list[int]] = [[] for _ in range(k)]
        sent = rng.random(k) < send_prob
        for c in range(k):
            if sent[c]:
                to = int(rng.integers(k - 1))
                to = to + 1 if to >= c else to  # uniform over the other clients
                senders[to].append(c)
                messages.append((c, to, u))
        for c in range(k):
            if not sent[c]:
                buffers[c].append(int(holding[c, u]))
            for s in senders[c]:
                buffers[c].append(int(holding[s, u]))
        for c in range(k):
            if not senders[c]:
                continue
            order = rng.permutation(len(buffers[c]))
            pool = [buffers[c][i] for i in order]
            for s in senders[c]:
                new[s, u] = pool.pop()
                messages.append((c, s, u))
            if not sent[c]:
                new[c, u] = pool.pop()
            assert not pool
    return new, messages


def secure_exchange(
    k: int,
    n_units: int,
    rng: np.random.Generator,
    *,
    send_prob: float = 0.5,
    min_passes: int = 1,
    max_passes: int = 64,
    require_mixed: bool = True,
) -> SecureExchange:
    """Run exchange passes (the paper allows several per round) until no client holds a model made only of
    its own or any single client's layers (``require_mixed``, possible when ``K >= 2`` and ``U >= 2``)."""
    holding = np.tile(np.arange(k)[:, None], (1, n_units))
    messages: list[tuple[int, int, int]] = []
    passes = 0
    need_mixed = require_mixed and k >= 2 and n_units >= 2
    while passes < max_passes:
        holding, msgs = secure_exchange_pass(holding, rng, send_prob)
        messages += msgs
        passes += 1
        if passes >= min_passes and (not need_mixed or not any_pure(holding)):
            return SecureExchange(holding, messages, passes)
    if need_mixed and any_pure(holding):
        raise RuntimeError(f"secure exchange left a single-source model after {max_passes} passes")
    return SecureExchange(holding, messages, passes)


def any_pure(sources: np.ndarray) -> bool:
    """True when some row of ``sources`` takes all its units from one client."""
    return bool(any(len(set(row.tolist())) == 1 for row in sources))


def assemble(
    states: Sequence[Mapping[str, torch.Tensor]], units: Sequence[Unit], sources: np.ndarray
) -> list[TensorDict]:
    """Models built from ``sources[j, u]`` (client j's unit u comes from ``states[sources[j, u]]``)."""
    return recombine(states, units, np.asarray(sources).T)


# ---------------------------------------------------------------------------------------------------------
# Diagnostics


def mean_pairwise_cosine(states: Sequence[Mapping[str, torch.Tensor]], keys: Sequence[str]) -> float | None:
    """Mean cosine similarity over all pairs of models, on the flattened ``keys`` (FedMR Fig. 6)."""
    if len(states) < 2:
        return None
    v = torch.stack([flat_vector(s, keys) for s in states])
    v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-30)
    sim = v @ v.T
    k = len(states)
    return float((sim.sum() - sim.diagonal().sum()) / (k * (k - 1)))
