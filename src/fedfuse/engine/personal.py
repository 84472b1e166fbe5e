"""What stays on the client: the split of a model into shared entries and each client's own.

An algorithm declares the entries of the model that are every client's own with ``stays_local``, a
:class:`StaysLocal` (by module kind — e.g. every BatchNorm layer's parameters and buffers —, the model's
head, its last layers, or a regular expression on state-dict keys).  The engine honours the declaration once,
here, for every executor:

- **payloads** (:meth:`ClientSide.outgoing`): the client's own entries are taken out of every message the
  server sends (training and evaluation), so the byte accounting counts, and the Flower wire carries, only the
  shared entries;
- **the client step** (:meth:`ClientSide.client_program`, :meth:`ClientSide.fit`): the client's own entries are
  merged into the payload from its persistent state — the first time from the run's initial model (seeded by
  the run seed, as ``init_state``'s, so every process and every Flower node rebuilds the same one) — and the
  algorithm's hook sees the whole model; the new values of its own entries are read from its reply (which
  carries the trained model) and kept in the client's state under :data:`OWN`; the reply leaves without them;
- **evaluation** (:meth:`ClientSide.evaluate`): each client evaluates with its own entries;
- **client state**: :data:`OWN` sits beside the algorithm's own client-state entries (the algorithm never sees
  it); the engine checkpoints it with the other client states, and under Flower it is ``node_private``, so it
  never leaves the node.

Executors run :func:`client_side` of the algorithm (the algorithm itself when nothing stays local) and need
to know nothing of this.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedfuse.engine.context import RunContext, seeded_state
from fedfuse.errors import UnsupportedModel
from fedfuse.structure import is_batchnorm
from fedfuse.types import ClientData, Message, TensorDict

if TYPE_CHECKING:
    from fedfuse.engine.program import ClientProgram

OWN = "fedfuse:own"  # the client-state entry holding the client's own model entries
_WAS_EMPTY = "fedfuse:empty"  # the algorithm's client state was {} (not None) beside OWN

#: What an algorithm may require of a model (``Algorithm.requires``), with the test of a model for each.
REQUIREMENTS: dict[str, str] = {
    "batchnorm": "BatchNorm layers",
    "head": "a classification head (a FedModel: head_keys(), layers())",
    "features": "a penultimate representation (features_and_logits)",
}


def unmet_requirements(model: nn.Module, requires: Iterable[str]) -> list[str]:
    """The requirements of ``requires`` (names of :data:`REQUIREMENTS`) that ``model`` does not meet."""
    out = []
    for need in sorted(requires):
        if need not in REQUIREMENTS:
            raise ValueError(f"unknown model requirement {need!r}; known: {', '.join(REQUIREMENTS)}")
        if need == "batchnorm":
            met = any(is_batchnorm(m) for m in model.modules())
        elif need == "head":
            met = callable(getattr(model, "head_keys", None)) and callable(getattr(model, "layers", None))
        else:
            met = callable(getattr(model, "features_and_logits", None))
        if not met:
            out.append(need)
    return out


def check_requirements(name: str, model: nn.Module, requires: Iterable[str]) -> None:
    """Raise :class:`UnsupportedModel` naming what ``model`` lacks of what algorithm ``name`` requires."""
    unmet = unmet_requirements(model, requires)
    if unmet:
        raise UnsupportedModel(f"{name} needs a model with {' and '.join(REQUIREMENTS[n] for n in unmet)}; "
                               f"{type(model).__name__} has none")


@dataclass(frozen=True)
class StaysLocal:
    """Which entries of the model are every client's own (never sent, never returned, never averaged).

    An entry stays local when any field selects it:

    - ``kinds``: module kinds as :func:`fedfuse.models.base.module_kind` names them (``"bn"``, ``"linear"``,
      ``"conv"``, ``"ln"``, ...): every parameter and buffer a module of that kind owns (FedBN: ``("bn",)``);
    - ``head``: the model's classification head, ``model.head_keys()`` (FedRep);
    - ``last_layers``: the last ``k`` parametrised layers of ``model.layers()`` (FedPer's personalisation layers);
    - ``match``: a regular expression a state-dict key matches in full (``re.fullmatch``).
    """

    kinds: tuple[str, ...] = ()
    head: bool = False
    last_layers: int = 0
    match: str | None = None

    def keys(self, model: nn.Module) -> frozenset[str]:
        """The state-dict keys of ``model`` the declaration selects."""
        from fedfuse.models.base import module_kind

        state = model.state_dict()
        out: set[str] = set()
        if self.kinds:
            for name, m in model.named_modules():
                if module_kind(m) in self.kinds:
                    prefix = f"{name}." if name else ""
                    out.update(prefix + k for k, _ in (*m.named_parameters(recurse=False),
                                                       *m.named_buffers(recurse=False)) if prefix + k in state)
        if self.head or self.last_layers:
            check_requirements("stays_local", model, ("head",))
        if self.head:
            out.update(model.head_keys())  # type: ignore[operator]
        if self.last_layers:
            params = {k for k, _ in model.named_parameters()}
            layers = [lay for lay in model.layers() if any(k in params for k in lay.keys)]  # type: ignore[operator]
            for lay in layers[-self.last_layers:]:
                out.update(lay.keys)
        if self.match is not None:
            pattern = re.compile(self.match)
            out.update(k for k in state if pattern.fullmatch(k))
        return frozenset(out)


def shared(tensors: Mapping[str, torch.Tensor], own: frozenset[str]) -> TensorDict:
    """The entries of ``tensors`` that are not the client's own."""
    return {k: v for k, v in tensors.items() if k not in own}


def split_state(state: Any) -> tuple[TensorDict | None, Any]:
    """``(own entries or None, the algorithm's client state)`` of an engine-held client state."""
    if not isinstance(state, dict) or OWN not in state:
        return None, state
    rest = {k: v for k, v in state.items() if k not in (OWN, _WAS_EMPTY)}
    own = state[OWN] if isinstance(state[OWN], dict) else None  # a marker (kept on a Flower node) is not a model
    return own, rest if rest or state.get(_WAS_EMPTY) else None


def join_state(own: TensorDict, state: Any) -> dict[str, Any]:
    """The engine-held client state: the algorithm's state (``None`` or a dict) with the own entries beside it."""
    if state is None:
        return {OWN: own}
    if not isinstance(state, dict):
        raise TypeError(f"an algorithm with entries that stay local keeps a dict (or None) as client state, "
                        f"not {type(state).__name__}")
    if OWN in state:
        raise KeyError(f"{OWN!r} is the engine's client-state entry")
    return {**state, OWN: own, **({_WAS_EMPTY: True} if not state else {})}


class ClientSide:
    """The client side of an algorithm with entries that stay local (see the module docstring): what every
    executor runs in place of the algorithm's own ``client_program``, ``fit`` and ``evaluate``."""

    def __init__(self, algo: Any, declaration: StaysLocal) -> None:
        self.algo = algo
        self.declaration = declaration
        self.ctx: RunContext = algo.ctx
        self._keys: dict[str, frozenset[str]] = {}
        self._initial: TensorDict | None = None

    @property
    def node_private(self) -> tuple[str, ...]:
        """The algorithm's node-private client-state entries and :data:`OWN` (never leaves a Flower node)."""
        return (*self.algo.node_private, OWN)

    def own_keys(self, meta: Mapping[str, Any] | None = None) -> frozenset[str]:
        """The client's own state-dict keys for the architecture ``meta`` describes."""
        key = json.dumps((meta or {}).get("model_options") or {}, sort_keys=True, default=str)
        if key not in self._keys:
            self._keys[key] = self.declaration.keys(self.ctx.model(meta))
        return self._keys[key]

    # ---- server side: what is sent -------------------------------------------------------------------------
    def outgoing(self, payloads: dict[int, Message]) -> dict[int, Message]:
        """Every payload without the client's own entries (a message shared by clients stays shared)."""
        out: dict[int, Message] = {}
        done: dict[int, Message] = {}
        for c, msg in payloads.items():
            if id(msg) not in done:
                done[id(msg)] = Message(shared(msg.tensors, self.own_keys(msg.meta)), msg.meta, msg.stats)
            out[c] = done[id(msg)]
        return out

    # ---- client side --------------------------------------------------------------------------------------
    def initial(self, keys: frozenset[str]) -> TensorDict:
        """The client's own entries before its first round: the run's initial model's."""
        if self._initial is None:
            self._initial = seeded_state(self.ctx, self.ctx.seed)
        return {k: self._initial[k].clone() for k in keys}

    def _merged(self, payload: Message, state: Any) -> tuple[Message, Any, frozenset[str], TensorDict]:
        keys = self.own_keys(payload.meta)
        own, inner = split_state(state)
        if own is None or set(own) != keys:
            own = self.initial(keys)
        device = next(iter(payload.tensors.values())).device if payload.tensors else None
        own = {k: v.to(device) for k, v in own.items()} if device is not None else own
        return Message({**payload.tensors, **own}, payload.meta, payload.stats), inner, keys, own

    @staticmethod
    def _settle(reply: Message, new_inner: Any, keys: frozenset[str], old: TensorDict) -> tuple[Message, Any]:
        own = {k: reply.tensors[k].detach().clone() if k in reply.tensors else old[k] for k in keys}
        return Message(shared(reply.tensors, keys), reply.meta, reply.stats), join_state(own, new_inner)

    def client_program(self, payload: Message, client_state: Any, data: ClientData) -> ClientProgram | None:
        """The algorithm's program on the whole model; its reply leaves without the client's own entries."""
        full, inner, keys, own = self._merged(payload, client_state)
        prog = self.algo.client_program(full, inner, data)
        if prog is None:
            return None
        done = prog.finalize

        def finalize(trained: TensorDict, stats: Any) -> tuple[Message, Any]:
            reply, new_inner = done(trained, stats)
            return self._settle(reply, new_inner, keys, own)

        return dataclasses.replace(prog, finalize=finalize)

    def fit(self, payload: Message, client_state: Any, data: ClientData,
            gen: torch.Generator) -> tuple[Message, Any]:
        """The algorithm's ``fit`` on the whole model; its reply leaves without the client's own entries."""
        full, inner, keys, own = self._merged(payload, client_state)
        reply, new_inner = self.algo.fit(full, inner, data, gen)
        return self._settle(reply, new_inner, keys, own)

    def evaluate(self, payload: Message, client_state: Any, data: ClientData,
                 gen: torch.Generator) -> dict[str, float]:
        """The algorithm's ``evaluate`` with the client's own entries merged in."""
        full, inner, _, _ = self._merged(payload, client_state)
        return self.algo.evaluate(full, inner, data, gen)


def client_side(algo: Any) -> Any:
    """What executors run for ``algo``: :class:`ClientSide` when it declares entries that stay local, else the
    algorithm itself; under ``dp=local`` either wrapped in :class:`~fedfuse.engine.local_dp.LocalDPClient` (the
    client step trained with DP-SGD)."""
    from fedfuse.engine.local_dp import LocalDPClient

    declaration = algo.stays_local
    side = algo if declaration is None else ClientSide(algo, declaration)
    dp = algo.ctx.dp
    return LocalDPClient(side, dp.noise, dp.clip) if dp.local else side


def outgoing(client: Any, payloads: dict[int, Message]) -> dict[int, Message]:
    """``payloads`` as they travel: without the client's own entries when ``client`` is a :class:`ClientSide` or
    wraps one (a client wrapper keeps what it wraps as ``inner``: federated evaluation's
    :class:`~fedfuse.engine.federated_eval.GlobalEvaluation`, local DP's
    :class:`~fedfuse.engine.local_dp.LocalDPClient`)."""
    while not isinstance(client, ClientSide):
        client = getattr(client, "inner", None)
        if client is None:
            return payloads
    return client.outgoing(payloads)


__all__ = ["OWN", "REQUIREMENTS", "ClientSide", "StaysLocal", "check_requirements", "client_side", "join_state",
           "outgoing", "shared", "split_state", "unmet_requirements"]
