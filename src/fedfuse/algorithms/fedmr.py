"""FedMR (Hu et al., "FedMR: Federated Learning via Model Recombination"): layer-wise model recombination.

The server keeps ``K`` intermediate models (*slots*, ``K`` = clients per round), all starting from the same
initial model.  Slots are not tied to clients: in every round the i-th sampled client (sorted ids) trains
slot i.  After local training the server recombines the uploaded models: for every layer it draws an
independent uniform permutation of the ``K`` models and new model j takes that layer from model
``perm[j]`` (Algorithm 1, §4.2.2) — every uploaded layer is used by exactly one recombined model.

* **Layers** are modules with all their parameters *and* buffers (paper: "decomposes received local models
  into multiple layers"); BN statistics stay with their affine parameters.  The author code shuffles each
  ``state_dict`` key independently: ``granularity="key"``.
* **Two-stage training** (§4.3): the first ``warmup_rounds`` rounds are FedAvg (average of the full state,
  ``num_batches_tracked`` = max, everyone receives the global model); recombination starts from the
  pre-trained model afterwards.  Paper: none for the 4-layer CNN, 100 rounds for ResNet-20/VGG-16; author
  code: ``--first_stage_bound``, default 0.  The warm-up average is *uniform* over the K uploads, as the
  author code does (its ``Aggregation(w_locals, None)``); ``warmup_weighting="samples"`` is the
  sample-weighted FedAvg form.
* **FedMR-p** (§5.4.2): ``segments=p`` recombines p contiguous segments of layers instead of single layers;
  ``p = 1`` only re-dispatches whole models (the paper's "Indep" with shuffling); 0 = layer-wise.
* **Global model** (evaluation/deployment): the uniform average of the K intermediate models (paper Alg. 1
  l. 11 and the author code); BN statistics are averaged and ``num_batches_tracked`` takes the max.
* **Secure recombination** (App. B, not in the author code, ``secure=True``): a three-stage round in which
  the server never receives any client's own trained model.  Stage 0: clients train their slot model, keep it
  in their client state with a fresh X25519 key pair and reply with metadata and their public key only; the
  server draws the exchange plan among the stage-0 repliers with
  :func:`fedfuse.fusion.recombine.secure_exchange` (passes repeated until no planned model is any single
  client's).  Stage 1: every client sends each of its units that the plan gives to a peer as an envelope
  AES-GCM-encrypted under a key agreed with that peer (X25519 + HKDF-SHA256), addressed
  ``sim/peer/{m}/u{unit}``; the server only relays ciphertext.  Stage 2: every client decrypts its mail,
  assembles its recombined model and uploads it; the server then applies its usual layer-wise recombination
  to these uploads, so the round ends bit for bit where the former server-side simulation ended.
  ``bytes_peer`` counts the ciphertext envelopes (unit bytes + 28 bytes of nonce and tag each).  Dropouts:
  see :meth:`FedMR.settle_plan`.  Threat model: an honest-but-curious relay (it passes the public keys on
  unchanged).
* **Diagnostics**: ``model_cosine`` — mean pairwise cosine similarity of the K uploaded (trained) models'
  parameters (paper Fig. 6) — in ``metrics.jsonl``, and ``fedmr_similarity.png`` at the end of the run.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, RunContext, ServerState
from fedfuse.engine.local_dp import check_local_dp, train_dp_sgd
from fedfuse.engine.peers import mail_of, route_peers
from fedfuse.engine.program import ClientProgram, run_program
from fedfuse.fusion.average import clone_state, weighted_average
from fedfuse.fusion.recombine import (
    check_units,
    mean_pairwise_cosine,
    random_permutations,
    recombine,
    secure_exchange,
    segment_units,
    units_from_layers,
)
from fedfuse.options import opt
from fedfuse.rng import numpy_rng
from fedfuse.types import ClientData, Federation, Message, Privacy, ServerView, TensorDict, no, yes

Unit = tuple[str, ...]


def model_units(model: torch.nn.Module, granularity: str = "module", segments: int = 0) -> list[tuple[str, ...]]:
    """Recombination units of ``model`` (its ``layers()`` or one unit per state key), optionally segmented."""
    layers = model.layers() if hasattr(model, "layers") else [(k,) for k in model.state_dict()]
    groups = [tuple(layer.keys) if hasattr(layer, "keys") else tuple(layer) for layer in layers]
    units = segment_units(units_from_layers(groups, granularity), segments)
    check_units(units, list(model.state_dict().keys()))
    return units


# ---- App. B envelopes: X25519 key agreement, HKDF-SHA256, AES-256-GCM ----------------------------------------
NONCE_BYTES = 12
TAG_BYTES = 16
ENVELOPE_OVERHEAD = NONCE_BYTES + TAG_BYTES  # ciphertext bytes = plaintext bytes + this


def new_key_pair() -> tuple[torch.Tensor, str]:
    """A fresh X25519 key pair from the OS's randomness: (private key as 32 uint8, public key as hex).

    Never derived from the run's seed: the server knows the seed."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    sk = X25519PrivateKey.generate()
    secret = torch.frombuffer(bytearray(sk.private_bytes_raw()), dtype=torch.uint8).clone()
    return secret, sk.public_key().public_bytes_raw().hex()


def envelope_key(secret: torch.Tensor, peer_public: str, round_index: int, sender: int, receiver: int) -> bytes:
    """The AES-256 key of envelopes ``sender -> receiver`` in one round (X25519 shared secret, HKDF-SHA256)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    sk = X25519PrivateKey.from_private_bytes(bytes(secret.cpu().numpy().tobytes()))
    shared = sk.exchange(X25519PublicKey.from_public_bytes(bytes.fromhex(peer_public)))
    info = f"fedfuse/fedmr-secure/v1 round={round_index} {sender}->{receiver}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def envelope_aad(round_index: int, sender: int, receiver: int, unit: int) -> bytes:
    """Authenticated header of an envelope: a relay cannot pass one unit, round or pair off as another."""
    return f"fedmr-secure round={round_index} {sender}->{receiver} unit={unit}".encode()


def seal(key: bytes, plaintext: bytes, aad: bytes) -> torch.Tensor:
    """``nonce || AES-GCM(plaintext) || tag`` as a uint8 tensor (random 96-bit nonce)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = os.urandom(NONCE_BYTES)
    return torch.frombuffer(bytearray(nonce + AESGCM(key).encrypt(nonce, plaintext, aad)), dtype=torch.uint8)


def unseal(key: bytes, envelope: torch.Tensor, aad: bytes) -> bytes:
    """The plaintext of :func:`seal`; raises ``ValueError`` if the envelope or its header was altered."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    raw = envelope.detach().cpu().numpy().tobytes()
    try:
        return AESGCM(key).decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], aad)
    except InvalidTag:
        raise ValueError(f"secure FedMR: an envelope failed authentication ({aad.decode()})") from None


def unit_plaintext(state: Mapping[str, torch.Tensor], unit: Unit) -> bytes:
    """The raw bytes of one unit's tensors, in the unit's key order (shapes and dtypes are the model's)."""
    return b"".join(state[k].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    for k in unit)


def unit_from_plaintext(raw: bytes, like: Mapping[str, torch.Tensor], unit: Unit) -> TensorDict:
    """Inverse of :func:`unit_plaintext`, shaped like ``like`` (the receiver's own model), bit for bit."""
    out: TensorDict = {}
    off = 0
    for k in unit:
        ref = like[k]
        n = ref.numel() * ref.element_size()
        if off + n > len(raw):
            raise ValueError(f"secure FedMR: a received unit is too short for {k}")
        buf = torch.frombuffer(bytearray(raw[off:off + n]), dtype=torch.uint8)
        out[k] = buf.view(ref.dtype).reshape(ref.shape).to(ref.device)
        off += n
    if off != len(raw):
        raise ValueError("secure FedMR: a received unit does not match the model's layout")
    return out


def _pure(row: Sequence[int]) -> bool:
    return len(set(row)) == 1


class FedMR(Algorithm):
    name = "fedmr"
    description = "FedMR: K slot models, layer-wise random recombination after every round (two-stage, FedMR-p)"
    privacy = (
        Privacy(ServerView.MODELS,
                'the server recombines the layers of individual trained models into new ones',
                central_dp=no("each recombined model is made of single clients' layers: nothing is averaged to"
                               ' hide them'),
                local_dp=yes('DP-SGD on the client step (Opacus) makes each uploaded model (ε, δ)-DP with respect '
                             "to its client's examples; recombining DP models is post-processing"),
                secagg=no('a masked layer is random: recombining masked layers gives no usable model')),
        Privacy(ServerView.MODELS,
                ("secure=true: the server never gets a client's own model, but every uploaded layer is still "
                 "some client's trained layer"),
                central_dp=no("the uploads still carry single clients' layers; only who trained which is "
                               'hidden'),
                local_dp=yes('DP-SGD on the client step makes the model whose layers are exchanged (ε, δ)-DP; the '
                             'exchange and recombination are post-processing'),
                secagg=no('the peer exchange hides which client trained a layer (unlinkability), not the layer'
                           ' values'),
                when=(("secure", True),)),
    )
    echo_meta = ("slot",)  # the server notes which slot each reply trained (partial rounds keep the others)
    node_private = ("secure",)  # secure mode's trained model and private key never leave a Flower node

    @dataclass
    class Options:
        granularity: str = opt(
            "module", "recombination unit: 'module' = a layer with its buffers (paper); 'key' = every "
            "state-dict key on its own (author code, splits BN statistics from their affine parameters)",
            choices=("module", "key"))
        segments: int = opt(0, "FedMR-p: 0 = layer-wise; p >= 1 recombines p contiguous segments "
                            "(1 = re-dispatch whole models only)", ge=0)
        warmup_rounds: int = opt(0, "two-stage training: FedAvg rounds before recombination starts "
                                 "(paper: 0 for the CNN, 100 for ResNet-20/VGG-16; code --first_stage_bound)", ge=0)
        warmup_weighting: str = opt(
            "uniform", "warm-up averaging: 'uniform' over the K uploads (author code) or 'samples' "
            "(sample-weighted FedAvg)", choices=("uniform", "samples"))
        secure: bool = opt(False, "App. B client-side secure recombination before upload (not in the author code): "
                                  "three stages per round, layers travel encrypted client to client")
        secure_send_prob: float = opt(0.5, "secure exchange plan: probability a client sends a given layer in the "
                                      "first step of an App. B pass", ge=0.0, le=1.0)
        secure_min_passes: int = opt(1, "secure exchange: minimum number of exchange passes per round", ge=1)
        int_policy: str = opt("max", "num_batches_tracked in averages (warm-up, global model)",
                              choices=("max", "sum", "first"))

    def __init__(self, ctx: RunContext, options: Any | None = None) -> None:
        super().__init__(ctx, options)
        if ctx.dp.local:  # Opacus must be able to clip per-sample gradients of the model
            check_local_dp(ctx.model())

    # ---- helpers -------------------------------------------------------------------------------
    @property
    def k(self) -> int:
        return min(self.ctx.clients_per_round, self.ctx.num_clients)

    def units(self) -> list[tuple[str, ...]]:
        if not hasattr(self, "_units"):
            self._units = model_units(self.ctx.model(), self.opt.granularity, int(self.opt.segments))
        return self._units

    def param_key_list(self) -> list[str]:
        keys = self.ctx.param_keys()
        return [k for k in self.ctx.model().state_dict() if k in keys]

    def in_warmup(self, info: RoundInfo) -> bool:
        return info.index < int(self.opt.warmup_rounds)

    @staticmethod
    def ordered(results: dict[int, Message]) -> list[Message]:
        return [results[c] for c in sorted(results)]

    # ---- server hooks --------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        state = super().init_state()
        state["slots"] = None  # None = every slot equals state["global"] (start, warm-up)
        state["similarity"] = []
        return state

    def slot_states(self, state: ServerState) -> list[TensorDict]:
        if state.get("slots") is None:
            return [state["global"]] * self.k
        return state["slots"]

    def secure_round(self, info: RoundInfo) -> bool:
        return bool(self.opt.secure) and not self.in_warmup(info)

    def num_stages(self, state: ServerState, info: RoundInfo) -> int:
        """Secure rounds: 0 train (metadata up), 1 encrypted unit exchange, 2 upload recombined models."""
        return 3 if self.secure_round(info) else 1

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        if self.in_warmup(info):
            msg = Message(state["global"])
            return {c: msg for c in clients}
        if self.secure_round(info) and info.stage > 0:
            return self.secure_payloads(state, info, clients)
        slots = self.slot_states(state)
        if len(clients) > len(slots):
            raise ValueError(f"{len(clients)} clients sampled but FedMR keeps {len(slots)} slots")
        extra = {"secure_stage": 0, "round": info.index} if self.secure_round(info) else {}
        return {c: Message(slots[i], {"slot": i, **extra}) for i, c in enumerate(sorted(clients))}

    def exchange(self, info: RoundInfo, results: dict[int, Message]) -> tuple[dict[int, Message], int]:
        """Secure stage 1: relay the clients' encrypted envelopes (bytes = ciphertext handed to the relay)."""
        if self.secure_round(info) and info.stage == 1:
            return route_peers(results)
        return results, 0

    # ---- secure recombination, server side ---------------------------------------------------------
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

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        if self.secure_round(info):
            if info.stage == 0:
                return self.secure_plan(state, info, results)
            if info.stage == 1:
                return self.settle_plan(state, info, results)
            state = {k: v for k, v in state.items() if k != "secure"}  # stage 2: the uploads, fused as below
        msgs = self.ordered(results)
        trained = [m.tensors for m in msgs]
        sim = mean_pairwise_cosine(trained, self.param_key_list())
        history = [*state.get("similarity", []), [info.index + 1, sim]]
        if self.in_warmup(info):
            weights = ([float(m.num_examples) for m in msgs]
                       if self.opt.warmup_weighting == "samples" else None)
            g = weighted_average(trained, weights, base=state["global"],  # type: ignore[arg-type]
                                 int_policy=self.opt.int_policy)
            return {**state, "global": g, "slots": None, "similarity": history}
        slots = self.slot_states(state)
        if len(trained) < len(slots):  # fewer uploads than slots (dropouts): untouched slots keep their models
            got = {int(m.meta["slot"]): m.tensors for m in msgs if "slot" in m.meta}
            if len(got) == len(trained):
                trained = [got[i] if i in got else clone_state(s) for i, s in enumerate(slots)]
            else:
                trained = trained + [clone_state(s) for s in slots[len(trained):]]
        rng = numpy_rng(self.ctx.seed, "fedmr-recombine", info.index)
        units = self.units()
        new = recombine(trained, units, random_permutations(len(units), len(trained), rng))
        g = self.average(new)
        return {**state, "global": g, "slots": new, "similarity": history}

    def average(self, states: list[TensorDict]) -> TensorDict:
        """Uniform average of the intermediate models (the deployed global model)."""
        if len(states) == 1:
            return clone_state(states[0])
        return weighted_average(states, None, int_policy=self.opt.int_policy)  # type: ignore[arg-type]

    def global_model(self, state: ServerState) -> tuple[TensorDict, dict[str, Any]] | None:
        return state["global"], {}

    def server_parameters(self, state: ServerState) -> int:
        keys = self.ctx.param_keys()
        n = sum(v.numel() for k, v in state["global"].items() if k in keys)
        return int(n * (1 if state.get("slots") is None else len(state["slots"])))

    # ---- client hooks ------------------------------------------------------------------------------
    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram | None:
        """The standard local step; in secure stage 0 the trained model stays with the client (only metadata
        and a fresh public key go up); secure stages 1 and 2 train nothing (``fit`` runs them)."""
        stage = payload.meta.get("secure_stage")
        if stage not in (None, 0) or self.ctx.dp.local:  # dp=local: fit runs DP-SGD (the executors call it)
            return None
        return self._program(payload, client_state, data)

    def _program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        stage = payload.meta.get("secure_stage")
        program = self.standard_program(payload, client_state, data)
        if stage is None:
            return program
        round_index, finalize = int(payload.meta["round"]), program.finalize

        def keep(trained: TensorDict, stats: Any) -> tuple[Message, ClientState]:
            reply, _ = finalize(trained, stats)
            secret, public = new_key_pair()
            kept = {"round": round_index, "model": trained, "secret": secret}
            return Message({}, {**reply.meta, "public_key": public}, reply.stats), {"secure": kept}

        return dataclasses.replace(program, finalize=keep)

    def fit(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> tuple[Message, ClientState]:
        stage = payload.meta.get("secure_stage")
        if stage == 1:
            return self.secure_send(payload, client_state, data.cid)
        if stage == 2:
            return self.secure_assemble(payload, client_state, data.cid)
        program = self._program(payload, client_state, data)
        if not self.ctx.dp.local:
            return run_program(program, data, gen)
        model = self.ctx.load(program.init, payload.meta)  # dp=local: DP-SGD through Opacus, same finalize
        trained, stats = train_dp_sgd(model, data.train, program.spec, gen, noise=self.ctx.dp.noise,
                                      clip=self.ctx.dp.clip)
        return program.finalize(trained, stats)

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

    # ---- diagnostics ---------------------------------------------------------------------------
    def diagnostics(self, state: ServerState, fed: Federation, info: RoundInfo) -> dict[str, Any]:
        hist = state.get("similarity") or []
        return {"model_cosine": hist[-1][1] if hist else None}

    def finish(self, state: ServerState, fed: Federation, out_dir: Path) -> None:
        hist = [(r, s) for r, s in state.get("similarity") or [] if s is not None]
        if not hist:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        r, s = np.array(hist).T
        ax.plot(r, s)
        ax.set_xlabel("round")
        ax.set_ylabel("mean pairwise cosine")
        ax.set_title(f"{self.name}: similarity of the K trained models")
        fig.tight_layout()
        fig.savefig(out_dir / "fedmr_similarity.png", dpi=110)
        plt.close(fig)
