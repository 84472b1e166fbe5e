"""The simulated peer channel used by serverless algorithms (MSfusion, D-PSGD, Dis-PFL).

A participant addresses a tensor to peer ``m`` by naming it ``sim/peer/{m}/key`` in its reply; the engine's
``exchange`` step delivers it to ``m`` as ``sim/mail/{n}/key`` (``n`` = sender) together with the sender's own
``sim/own/`` tensors.  Only the addressed tensors are real traffic: they are counted once, as peer bytes.

Who talks to whom (:func:`peer_graph`: ring, full, random ring, random in-neighbours) is decided here too, so
D-PSGD and Dis-PFL share it without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from fedfuse.errors import UserError
from fedfuse.rng import numpy_rng
from fedfuse.types import Message, TensorDict

#: name prefix of a tensor addressed to one peer: ``sim/peer/{m}/key``
PEER_PREFIX = "sim/peer/"


def route_peers(results: dict[int, Message]) -> tuple[dict[int, Message], int]:
    """Deliver every ``sim/peer/{m}/key`` of sender n to m's mailbox as ``sim/mail/{n}/key``.

    Returns the routed messages (mail plus each sender's ``sim/own/`` tensors) and the bytes moved."""
    moved = 0
    routed: dict[int, TensorDict] = {c: {} for c in results}
    for n, msg in results.items():
        for k, v in msg.tensors.items():
            if k.startswith(PEER_PREFIX):
                _, _, m, key = k.split("/", 3)
                routed.setdefault(int(m), {})[f"sim/mail/{n}/{key}"] = v
                moved += v.numel() * v.element_size()
    out = {}
    for c, msg in results.items():
        own = {k: v for k, v in msg.tensors.items() if k.startswith("sim/own/")}
        out[c] = Message({**own, **routed.get(c, {})}, dict(msg.meta), msg.stats)
    return out, int(moved)


def own_tensors(msg: Message) -> TensorDict:
    """The sender's own ``sim/own/`` tensors of a routed reply (what the simulation assembles for evaluation)."""
    return {k[len("sim/own/"):]: v for k, v in msg.tensors.items() if k.startswith("sim/own/")}


def mail_of(msg: Message) -> TensorDict:
    """The mail a routed reply holds, keyed ``{sender}/key``, to keep until the participant's next round."""
    return {k[len("sim/mail/"):]: v for k, v in msg.tensors.items() if k.startswith("sim/mail/")}


def deliver(mailbox: dict[int, TensorDict], cid: int) -> TensorDict:
    """Participant ``cid``'s kept mail as ``sim/`` payload tensors (``sim/{sender}/key``)."""
    return {f"sim/{k}": v for k, v in mailbox.get(cid, {}).items()}


def unpack_mail(tensors: Mapping[str, torch.Tensor], prefix: str = "sim/") -> dict[int, TensorDict]:
    """``{prefix}{sender}/key`` tensors grouped by sender."""
    box: dict[int, TensorDict] = {}
    for k, v in tensors.items():
        if k.startswith(prefix):
            s, key = k[len(prefix):].split("/", 1)
            box.setdefault(int(s), {})[key] = v
    return box


# ------------------------------------------------------------------------------------------------- topology

TOPOLOGIES = ("ring", "full", "random-ring", "random")


def peer_graph(num: int, topology: str, r: int = 0, seed: int = 0, degree: int = 2) -> np.ndarray:
    """Boolean (N, N) matrix A with A[i, j] = participant i receives participant j's model (no self loops)."""
    a = np.zeros((num, num), dtype=bool)
    if num < 2:
        return a
    if topology == "full":
        a[:] = True
    elif topology in ("ring", "random-ring"):
        order = np.arange(num) if topology == "ring" else numpy_rng(seed, "topology", r).permutation(num)
        for pos, i in enumerate(order):
            a[i, order[(pos - 1) % num]] = a[i, order[(pos + 1) % num]] = True
    elif topology == "random":
        rng = numpy_rng(seed, "topology", r)
        k = min(int(degree), num - 1)
        for i in range(num):
            others = np.delete(np.arange(num), i)
            a[i, rng.choice(others, size=k, replace=False)] = True
    else:
        raise UserError(f"topology={topology!r}; choose one of {', '.join(TOPOLOGIES)}")
    np.fill_diagonal(a, False)
    return a
