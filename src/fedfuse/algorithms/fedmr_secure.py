"""FedMR's secure recombination (App. B, not in the author code; ``secure=True``), the protocol's side of
:class:`~fedfuse.algorithms.fedmr.FedMR`: a three-stage round in which the server never receives any client's own
trained model.

Stage 0: clients train their slot model, keep it in their client state with a fresh X25519 key pair and reply with
metadata and their public key only; the server draws the exchange plan among the stage-0 repliers with
:func:`fedfuse.fusion.recombine.secure_exchange` (passes repeated until no planned model is any single client's).
Stage 1: every client sends each of its units that the plan gives to a peer as an envelope AES-GCM-encrypted under
a key agreed with that peer (:mod:`fedfuse.fusion.envelopes`), addressed ``sim/peer/{m}/u{unit}``; the server only
relays ciphertext.  Stage 2: every client decrypts its mail, assembles its recombined model and uploads it; the
server then applies its usual layer-wise recombination to these uploads, so the round ends bit for bit where the
former server-side simulation ended.  ``bytes_peer`` counts the ciphertext envelopes (unit bytes + 28 bytes of
nonce and tag each).  Dropouts: see :meth:`SecureRecombination.settle_plan`.  Threat model: an honest-but-curious
relay (it passes the public keys on unchanged).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState
from fedfuse.engine.peers import mail_of
from fedfuse.engine.program import ClientProgram
from fedfuse.fusion.envelopes import (
    envelope_aad,
    envelope_key,
    new_key_pair,
    seal,
    unit_from_plaintext,
    unit_plaintext,
    unseal,
)
from fedfuse.fusion.recombine import secure_exchange
from fedfuse.rng import numpy_rng
from fedfuse.types import Message, TensorDict


def _pure(row: Sequence[int]) -> bool:
    return len(set(row)) == 1


class SecureRecombination(Algorithm):
    """The stages of a secure FedMR round; the algorithm provides its recombination units (:meth:`units`) and the
    options ``secure_send_prob`` and ``secure_min_passes``.  (No ``name``: not an algorithm of its own.)"""

    def units(self) -> list[tuple[str, ...]]:
        raise NotImplementedError

    # ---- server side ---------------------------------------------------------------------------------
    def secure_plan(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        """Stage 0: draw the exchange plan among the clients that trained this round and sent a public key.

        ``sources[c][u]`` is the client whose trained unit ``u`` client ``c`` assembles; the same generator
        and draw as the former server-side simulation, so the recombined models are the same bit for bit.
        Replies that arrive late from an earlier round carry no model of this round and take no part."""
        cids = sorted(c for c, m in results.items() if "public_key" in m.meta and not m.meta.get("late"))
        n_units = len(self.units())
        if len(cids) >= 2:
            ex = secure_exchange(len(cids), n_units, numpy_rng(self.ctx.seed, "fedmr-secure", info.index, 0),
                                 send_prob=float(self.opt.secure_send_prob),
                                 min_passes=int(self.opt.secure_min_passes))
            sources = {c: [cids[int(i)] for i in ex.sources[j]] for j, c in enumerate(cids)}
            passes = ex.passes
        else:  # one client: nobody to mix with, it uploads its own model (as the simulation did)
            sources, passes = {c: [c] * n_units for c in cids}, 0
        plan = {
            "round": info.index, "cids": cids, "sources": sources, "passes": passes,
            "keys": {c: str(results[c].meta["public_key"]) for c in cids},
            "slots": {c: int(results[c].meta["slot"]) for c in cids},
        }
        return {**state, "secure": plan}

    def settle_plan(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        """Stage 1: fit the plan to the envelopes that actually arrived (dropout policy).

        For every unit the plan is a permutation ``c -> sources[c][u]`` of the planned clients.  A cycle of it
        is *broken* when one of its clients did not reply in stage 1 or an envelope on it is missing; every
        surviving client of a broken cycle keeps its own unit ``u`` (its envelopes on that cycle are dropped,
        undelivered).  Unbroken cycles are delivered as planned.  So among the models that are uploaded every
        unit position holds exactly one unit and no trained unit is used twice.  A client whose planned mixed
        model is reduced to its own units by this withholds its upload (its slot keeps its model, as for a
        dropout): the server still never receives a client's own trained model."""
        plan = state["secure"]
        planned, sources = plan["cids"], plan["sources"]
        mail = {c: mail_of(results[c]) for c in planned if c in results}
        settled = {c: list(sources[c]) for c in mail}
        for u in range(len(self.units())):
            seen: set[int] = set()
            for start in planned:
                cycle, c = [], start
                while c not in seen:
                    seen.add(c)
                    cycle.append(c)
                    c = sources[c][u]
                broken = any(m not in mail or (sources[m][u] != m and f"{sources[m][u]}/u{u}" not in mail[m])
                             for m in cycle)
                if broken:
                    for m in cycle:
                        if m in settled:
                            settled[m][u] = m
        withheld = sorted(c for c in settled if _pure(settled[c]) and not _pure(sources[c]))
        inbox = {c: {f"sim/{s}/u{u}": mail[c][f"{s}/u{u}"] for u, s in enumerate(settled[c]) if s != c}
                 for c in settled if c not in withheld}
        return {**state, "secure": {**plan, "settled": settled, "withheld": withheld, "inbox": inbox}}

    def secure_payloads(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        """Stage 1: which of its units each client sends to whom; stage 2: each client's relayed mail."""
        plan = state.get("secure")
        if not plan or plan["round"] != info.index:
            raise RuntimeError("secure FedMR: no exchange plan for this round (stage 0 did not aggregate)")
        keys, out = plan["keys"], {}
        for c in clients:
            if c not in plan["sources"]:
                continue
            if info.stage == 1:
                send = [[u, m] for m in plan["cids"] if m != c for u, s in enumerate(plan["sources"][m]) if s == c]
                peers = sorted({m for _, m in send})
                out[c] = Message({}, {"secure_stage": 1, "round": info.index, "send": send,
                                      "keys": [[m, keys[m]] for m in peers]})
            elif c in plan.get("inbox", {}):
                recv = [[u, s] for u, s in enumerate(plan["settled"][c]) if s != c]
                peers = sorted({s for _, s in recv})
                out[c] = Message(dict(plan["inbox"][c]), {
                    "secure_stage": 2, "round": info.index, "recv": recv, "keys": [[s, keys[s]] for s in peers],
                    "slot": plan["slots"][c]})
        return out

    # ---- client side ---------------------------------------------------------------------------------
    @staticmethod
    def secure_keep(program: ClientProgram, round_index: int) -> ClientProgram:
        """Stage 0: ``program`` with a finalize that keeps the trained model and a fresh private key in the client
        state and replies with metadata and the public key only."""
        finalize = program.finalize

        def keep(trained: TensorDict, stats: Any) -> tuple[Message, ClientState]:
            reply, _ = finalize(trained, stats)
            secret, public = new_key_pair()
            kept = {"round": round_index, "model": trained, "secret": secret}
            return Message({}, {**reply.meta, "public_key": public}, reply.stats), {"secure": kept}

        return dataclasses.replace(program, finalize=keep)

    @staticmethod
    def kept(client_state: ClientState, payload: Message) -> dict[str, Any]:
        kept = (client_state or {}).get("secure")
        if not kept or int(kept["round"]) != int(payload.meta["round"]):
            raise RuntimeError(f"secure FedMR: this client holds no model trained in round {payload.meta['round']}")
        return kept

    def secure_send(self, payload: Message, client_state: ClientState, me: int) -> tuple[Message, ClientState]:
        """Stage 1: every unit the plan gives to peer ``m``, sealed for ``m``, as ``sim/peer/{m}/u{unit}``."""
        kept = self.kept(client_state, payload)
        units, r, keys = self.units(), int(kept["round"]), {int(m): str(k) for m, k in payload.meta["keys"]}
        out: TensorDict = {}
        for u, m in payload.meta["send"]:
            key = envelope_key(kept["secret"], keys[m], r, me, m)
            out[f"sim/peer/{m}/u{u}"] = seal(key, unit_plaintext(kept["model"], units[u]), envelope_aad(r, me, m, u))
        return Message(out, {"envelopes": len(out)}), client_state

    def secure_assemble(self, payload: Message, client_state: ClientState, me: int) -> tuple[Message, ClientState]:
        """Stage 2: open the mail, put the received units into the own trained model and upload that.

        The trained model and the private key are dropped from the client state afterwards."""
        kept = self.kept(client_state, payload)
        units, r, keys = self.units(), int(kept["round"]), {int(s): str(k) for s, k in payload.meta["keys"]}
        own: TensorDict = kept["model"]
        mixed = {k: v.detach().clone() for k, v in own.items()}
        for u, s in payload.meta["recv"]:
            name = f"sim/{s}/u{u}"
            if name not in payload.tensors:
                raise ValueError(f"secure FedMR: the envelope of unit {u} from client {s} is missing")
            raw = unseal(envelope_key(kept["secret"], keys[s], r, s, me), payload.tensors[name],
                         envelope_aad(r, s, me, u))
            mixed.update(unit_from_plaintext(raw, own, units[u]))
        rest = {k: v for k, v in (client_state or {}).items() if k != "secure"}
        return Message(mixed, {"received_units": len(payload.meta["recv"])}), rest or None
