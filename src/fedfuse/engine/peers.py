"""The simulated peer channel used by serverless algorithms (MSfusion, D-PSGD, Dis-PFL).

A participant addresses a tensor to peer ``m`` by naming it ``sim/peer/{m}/key`` in its reply; the engine's
``exchange`` step delivers it to ``m`` as ``sim/mail/{n}/key`` (``n`` = sender) together with the sender's own
``sim/own/`` tensors.  Only the addressed tensors are real traffic: they are counted once, as peer bytes.
"""

from __future__ import annotations

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
        out[c] = Message({**own, **routed.get(c, {})}, dict(msg.meta))
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
