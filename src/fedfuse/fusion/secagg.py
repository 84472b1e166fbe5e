"""Secure aggregation, simulated in-process: SecAgg (Bonawitz et al., CCS 2017, "Practical secure aggregation for
privacy-preserving machine learning") and SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova, CCS 2020, "Secure
single-server aggregation with (poly)logarithmic overhead").

The server learns the sum of the survivors' vectors and nothing else about them (honest-but-curious server, the
semi-honest protocol of Bonawitz et al. §4 without the consistency-check round that guards against an active
server).  Each client u:

0. **AdvertiseKeys** — makes two X25519 key pairs, (c_u^SK, c_u^PK) to encrypt shares and (s_u^SK, s_u^PK) to
   agree pairwise masks, and sends the public keys.  The server forwards the roster.
1. **ShareKeys** — draws a self-mask seed b_u (32 random bytes), splits b_u and s_u^SK into Shamir shares of
   threshold t among its *shareholders* (itself and its neighbours: every client under SecAgg, the k neighbours of
   a random k-regular Harary graph under SecAgg+), and sends each neighbour's two shares AES-256-GCM-encrypted
   under HKDF(X25519(c_u^SK, c_v^PK)) through the server, which sees only ciphertext.
2. **MaskedInputCollection** — sends y_u = x_u + PRG(b_u) + Σ_{v>u} PRG(s_uv) − Σ_{v<u} PRG(s_uv) (mod 2^62) over
   its neighbours v that shared keys, with s_uv = HKDF(X25519(s_u^SK, s_v^PK)) and PRG = AES-256-CTR.
3. **Unmasking** — the server announces who sent a masked input (U3).  Every surviving client returns, for each
   neighbour v, its share of b_v if v is in U3, or its share of s_v^SK if v dropped after sharing keys — never both
   for one client, so the server can remove the masks but never strip one survivor's pairwise masks.  With at least
   t shares per secret the server reconstructs them, regenerates the masks and subtracts them from Σ y_u.

Fewer than t clients at any step, fewer than t shares of a needed secret, or fewer survivors than the minimum
cohort (``min_clients``, at least 3: a sum over one client is that client's input, over two each learns the
other's) abort the round with :class:`SecAggAbort` (the caller decides what to do with the round).  The threshold
must be a strict majority of every client's shareholders (t > h/2, :func:`check_threshold`): with t ≤ h/2 a
server that tells one half of u's shareholders "u dropped" and the other half "u survived" collects t shares of
both of u's secrets and unmasks u's input.

Quantisation: floats are mapped to the ring Z_{2^62} in fixed point, x ↦ round(x·2^f) mod 2^62 with
``frac_bits`` f (default 24: a step of 2^-24 ≈ 6e-8, each value off by at most 2^-25 ≈ 3e-8 after rounding); the
sum is exact in the ring and decodes correctly while the true sum stays within ±(2^61−1)/2^f (≈ ±1.4e11 for
f = 24).  A sum over n clients cannot wrap when every client's values stay within 1/n of that range
(:func:`client_limit`): ``quantize(x, cohort=n)`` refuses (:class:`EncodingError`) a vector beyond it, so a client
detects its own overflow before masking, and never sends a value that would wrap the sum silently.

Randomness: keys, seeds and share polynomials come from the operating system's CSPRNG (as in a deployment); the
masks cancel exactly, so the decoded sum does not depend on them and runs stay reproducible.  The SecAgg+ graph
is public and drawn from ``graph_seed``.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

RING_BITS = 62
MODULUS = 1 << RING_BITS
FRAC_BITS = 24
PRIME = (1 << 521) - 1  # Mersenne prime: the Shamir field (holds a 256-bit secret)
_RAW = serialization.Encoding.Raw


MIN_COHORT = 3  # the fewest clients a secure sum may hold


class SecAggAbort(RuntimeError):
    """The protocol cannot complete (too few clients or shares for the threshold): no aggregate this round."""


class EncodingError(ValueError):
    """A client's vector cannot be encoded for the ring (non-finite, or beyond its share of the range)."""


# ---- fixed-point ring ---------------------------------------------------------------------------------------------
def client_limit(cohort: int = 1, frac_bits: int = FRAC_BITS) -> float:
    """The largest |x| one of ``cohort`` clients may encode: the sum of ``cohort`` values within it stays inside
    the decodable range ±(2^61−1)/2^f, so the ring sum cannot wrap."""
    return ((MODULUS // 2 - 1) // max(int(cohort), 1)) / (1 << frac_bits)


def quantize(x: torch.Tensor, frac_bits: int = FRAC_BITS, cohort: int = 1) -> torch.Tensor:
    """``round(x·2^f) mod 2^62`` as int64 in [0, 2^62).  Raises :class:`EncodingError` if a value is non-finite or
    beyond :func:`client_limit` for ``cohort`` clients (1: the whole decodable range)."""
    scaled = torch.round(x.detach().double().flatten() * (1 << frac_bits))
    if not bool(torch.isfinite(scaled).all()):
        raise EncodingError("secure aggregation: a value is non-finite")
    limit = (MODULUS // 2 - 1) // max(int(cohort), 1)
    if scaled.numel() and float(scaled.abs().max()) > limit:
        raise EncodingError(f"secure aggregation: a value ({float(x.detach().double().abs().max()):.3g}) is beyond "
                            f"±{client_limit(cohort, frac_bits):.3g}, one client's share of the ring for a sum "
                            f"over {cohort} clients at {frac_bits} fraction bits")
    return torch.remainder(scaled.to(torch.int64), MODULUS)


def dequantize(v: torch.Tensor, frac_bits: int = FRAC_BITS) -> torch.Tensor:
    """The float64 values of ring elements (the upper half of the ring is negative)."""
    signed = torch.where(v >= MODULUS // 2, v - MODULUS, v)
    return signed.double() / (1 << frac_bits)


def ring_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.remainder(a + b, MODULUS)  # both < 2^62: the int64 sum cannot overflow


def ring_sub(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.remainder(a - b, MODULUS)


def prg(seed: bytes, n: int) -> torch.Tensor:
    """``n`` uniform ring elements from AES-256-CTR keyed by the 32-byte ``seed`` (zero nonce: one key, one use)."""
    enc = Cipher(algorithms.AES(seed), modes.CTR(b"\0" * 16)).encryptor()
    raw = enc.update(b"\0" * (8 * n)) + enc.finalize()
    words = np.frombuffer(raw, dtype=np.uint64) & np.uint64(MODULUS - 1)
    return torch.from_numpy(words.astype(np.int64))


# ---- key agreement and Shamir sharing -----------------------------------------------------------------------------
def agree(sk: X25519PrivateKey, pk: bytes, purpose: bytes) -> bytes:
    """32 bytes from X25519(sk, pk) through HKDF-SHA256, bound to ``purpose``."""
    shared = sk.exchange(X25519PublicKey.from_public_bytes(pk))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"fedfuse-secagg/" + purpose).derive(shared)


def _public(sk: X25519PrivateKey) -> bytes:
    return sk.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)


def _private(sk: X25519PrivateKey) -> bytes:
    return sk.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def shamir_split(secret: bytes, xs: list[int], t: int) -> dict[int, int]:
    """Shares ``{x: f(x)}`` of a random polynomial of degree t−1 over GF(2^521−1) with f(0) = ``secret``."""
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(t - 1)]
    return {x: sum(c * pow(x, i, PRIME) for i, c in enumerate(coeffs)) % PRIME for x in xs}


def shamir_join(shares: Mapping[int, int], length: int = 32) -> bytes:
    """f(0) from ``{x: f(x)}`` by Lagrange interpolation (any t shares of a degree t−1 polynomial)."""
    total = 0
    for xi, yi in shares.items():
        num = den = 1
        for xj in shares:
            if xj != xi:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, -1, PRIME)) % PRIME
    if total >= 1 << (8 * length):
        raise SecAggAbort("shares do not reconstruct a secret (inconsistent or too few shares)")
    return total.to_bytes(length, "big")


def harary_neighbors(ids: list[int], k: int, seed: int) -> dict[int, set[int]]:
    """SecAgg+'s communication graph: a Harary graph H(k, n) on a random relabelling of ``ids`` (public, from
    ``seed``); every client gets k neighbours (k even; ``k >= n−1`` gives the complete graph of SecAgg)."""
    n = len(ids)
    if k <= 0 or k >= n - 1:
        return {u: set(ids) - {u} for u in ids}
    order = [ids[i] for i in np.random.default_rng(seed).permutation(n)]
    half = max(k // 2, 1)
    nb: dict[int, set[int]] = {u: set() for u in ids}
    for i, u in enumerate(order):
        for d in range(1, half + 1):
            v = order[(i + d) % n]
            nb[u].add(v)
            nb[v].add(u)
    return nb


def threshold_of(holders: int, fraction: float) -> int:
    """t = ⌊fraction·holders⌋ + 1 (fraction 0.5: a strict majority of the shareholders)."""
    return min(holders, math.floor(fraction * holders) + 1)


def check_threshold(fraction: float) -> None:
    """Refuse a threshold fraction that gives some shareholder count h a threshold t ≤ h/2.

    t = ⌊f·h⌋ + 1 > h/2 for every h exactly when f ≥ ½ (at f < ½ and h large, ⌊f·h⌋ + 1 ≤ h/2); below it a
    server that announces "u dropped" to one half of u's shareholders and "u survived" to the other collects t
    shares of both of u's secrets — its mask key and its self-mask seed — and unmasks u's input."""
    if not 0.5 <= fraction < 1.0:
        raise ValueError(f"secure aggregation: threshold fraction {fraction:g} gives t <= n/2 for some cohorts; a "
                         "server that reports a client dropped to half its shareholders and alive to the others "
                         "could rebuild both of its secrets (use a fraction in [0.5, 1))")


# ---- the protocol -------------------------------------------------------------------------------------------------
@dataclass
class ServerTranscript:
    """Everything the server receives, in order: ``(step, sender, what)`` — public keys, ciphertexts, masked
    vectors and the unmasking shares.  Tests inspect it; nothing else reaches the server's code."""

    messages: list[tuple[str, int, Any]] = field(default_factory=list)
    reconstructed: dict[int, str] = field(default_factory=dict)  # client -> "b" (self mask) or "s" (mask key)

    def masked_inputs(self) -> dict[int, torch.Tensor]:
        return {u: m for step, u, m in self.messages if step == "masked_input"}


class _Client:
    """One client's side of the protocol (its secrets never leave this object except as shares/ciphertext)."""

    def __init__(self, cid: int, x: torch.Tensor) -> None:
        self.cid, self.x = cid, x
        self.c_sk, self.s_sk = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        self.b = os.urandom(32)
        self.roster: dict[int, tuple[bytes, bytes]] = {}
        self.neighbors: set[int] = set()
        self.inbox: dict[int, bytes] = {}  # ciphertexts from neighbours, by sender

    def advertise(self) -> tuple[bytes, bytes]:
        return _public(self.c_sk), _public(self.s_sk)

    def share_keys(self, roster: dict[int, tuple[bytes, bytes]], neighbors: set[int], t: int) -> dict[int, bytes]:
        self.roster, self.neighbors = roster, set(neighbors)
        holders = sorted(self.neighbors | {self.cid})
        xs = [h + 1 for h in holders]  # Shamir x-coordinates: client id + 1 (never 0)
        s_sh, b_sh = shamir_split(_private(self.s_sk), xs, t), shamir_split(self.b, xs, t)
        self.own = (s_sh[self.cid + 1], b_sh[self.cid + 1])
        out = {}
        for v in self.neighbors:
            key = agree(self.c_sk, roster[v][0], b"enc")
            nonce = os.urandom(12)
            plain = b"".join(z.to_bytes(66, "big") for z in (s_sh[v + 1], b_sh[v + 1]))
            out[v] = nonce + AESGCM(key).encrypt(nonce, plain, f"{self.cid}->{v}".encode())
        return out

    def masked_input(self, shared: set[int]) -> torch.Tensor:
        y = ring_add(self.x, prg(self.b, self.x.numel()))
        for v in sorted(self.neighbors & shared):
            mask = prg(agree(self.s_sk, self.roster[v][1], b"mask"), self.x.numel())
            y = ring_add(y, mask) if v > self.cid else ring_sub(y, mask)
        return y

    def unmask(self, survivors: set[int], shared: set[int]) -> dict[int, tuple[str, int]]:
        out: dict[int, tuple[str, int]] = {}
        for v in sorted((self.neighbors | {self.cid}) & shared):
            if v == self.cid:
                s_share, b_share = self.own
            else:
                blob = self.inbox[v]
                key = agree(self.c_sk, self.roster[v][0], b"enc")
                plain = AESGCM(key).decrypt(blob[:12], blob[12:], f"{v}->{self.cid}".encode())
                s_share, b_share = int.from_bytes(plain[:66], "big"), int.from_bytes(plain[66:], "big")
            out[v] = ("b", b_share) if v in survivors else ("s", s_share)
        return out


def secure_sum(
    vectors: Mapping[int, torch.Tensor],
    *,
    threshold: float = 0.5,
    neighbors: int = 0,
    graph_seed: int = 0,
    drop_before_masking: set[int] | frozenset[int] = frozenset(),
    drop_before_unmasking: set[int] | frozenset[int] = frozenset(),
    min_clients: int = MIN_COHORT,
) -> tuple[torch.Tensor, ServerTranscript]:
    """Run the protocol on the clients' ring vectors (``quantize``-d, same length) and return the server's
    unmasked sum over the clients that sent a masked input, with the server's transcript.

    ``neighbors`` = k > 0 selects SecAgg+ (k-regular graph); 0 is SecAgg's complete graph.  ``threshold`` is the
    fraction of a client's shareholders (itself and its neighbours) whose shares reconstruct its secrets.
    ``drop_before_masking``: clients that shared their keys and then vanished (their pairwise masks are recovered);
    ``drop_before_unmasking``: clients whose masked input counts but who do not help unmask.  Fewer than
    ``min_clients`` (at least :data:`MIN_COHORT`) survivors abort before anything is unmasked."""
    check_threshold(threshold)
    if min_clients < MIN_COHORT:
        raise ValueError(f"secure aggregation: a minimum cohort of {min_clients} lets a sum reveal one client's "
                         f"input; it must be at least {MIN_COHORT}")
    ids = sorted(vectors)
    if not ids:
        raise SecAggAbort("no client takes part")
    lengths = {int(v.numel()) for v in vectors.values()}
    if len(lengths) != 1:
        raise ValueError(f"secure aggregation needs vectors of one length, got {sorted(lengths)}")
    if len(ids) < min_clients:
        raise SecAggAbort(f"only {len(ids)} clients take part; a secure sum needs at least {min_clients} "
                          "(secagg_min_clients): over fewer it would reveal their inputs")
    tr = ServerTranscript()
    clients = {u: _Client(u, vectors[u]) for u in ids}
    graph = harary_neighbors(ids, neighbors, graph_seed)
    holders = min(len(graph[u]) + 1 for u in ids)
    t = threshold_of(holders, threshold)
    roster = _share_keys(clients, graph, t, tr)
    shared = set(ids)
    survivors = {u for u in ids if u not in drop_before_masking}
    masked = _collect_masked(clients, survivors, shared, tr)
    if len(survivors) < t:
        raise SecAggAbort(f"only {len(survivors)} of {len(ids)} clients sent a masked input; the threshold is {t} "
                          f"(threshold fraction {threshold:g} of {holders} shareholders)")
    if len(survivors) < min_clients:
        raise SecAggAbort(f"only {len(survivors)} of {len(ids)} clients sent a masked input; a secure sum needs at "
                          f"least {min_clients} (secagg_min_clients): over fewer it would reveal their inputs")
    got = _collect_shares(clients, survivors - set(drop_before_unmasking), survivors, shared, tr)
    total = torch.zeros(lengths.pop(), dtype=torch.int64)
    for u in sorted(survivors):
        total = ring_add(total, masked[u])
    for v in sorted(shared):
        total = _remove_masks(total, v, got[v], survivors, graph[v], roster, t, tr)
    return total, tr


def _share_keys(clients: dict[int, _Client], graph: dict[int, set[int]], t: int,
                tr: ServerTranscript) -> dict[int, tuple[bytes, bytes]]:
    """Steps 0 (AdvertiseKeys) and 1 (ShareKeys; the server routes ciphertexts it cannot read); returns the roster."""
    roster = {}
    for u in clients:
        roster[u] = clients[u].advertise()
        tr.messages.append(("public_keys", u, roster[u]))
    if len(clients) < t:
        raise SecAggAbort(f"only {len(clients)} clients advertised keys; the threshold is {t}")
    for u in clients:
        for v, blob in clients[u].share_keys(roster, graph[u], t).items():
            tr.messages.append(("ciphertext", u, (v, blob)))
            clients[v].inbox[u] = blob
    return roster


def _collect_masked(clients: dict[int, _Client], survivors: set[int], shared: set[int],
                    tr: ServerTranscript) -> dict[int, torch.Tensor]:
    """Step 2 (MaskedInputCollection): the survivors' masked vectors."""
    masked = {}
    for u in sorted(survivors):
        masked[u] = clients[u].masked_input(shared)
        tr.messages.append(("masked_input", u, masked[u]))
    return masked


def _collect_shares(clients: dict[int, _Client], helpers: set[int], survivors: set[int], shared: set[int],
                    tr: ServerTranscript) -> dict[int, dict[int, tuple[str, int]]]:
    """Step 3 (Unmasking), the clients' side: every helper's shares, by the client they belong to."""
    got: dict[int, dict[int, tuple[str, int]]] = {u: {} for u in shared}
    for h in sorted(helpers):
        for v, share in clients[h].unmask(survivors, shared).items():
            tr.messages.append(("unmask_share", h, (v, share[0], share[1])))
            got[v][h + 1] = share
    return got


def _remove_masks(total: torch.Tensor, v: int, got: dict[int, tuple[str, int]], survivors: set[int],
                  neighbors: set[int], roster: dict[int, tuple[bytes, bytes]], t: int,
                  tr: ServerTranscript) -> torch.Tensor:
    """Step 3, the server's side for client ``v``: reconstruct its self-mask seed (a survivor) or its mask key (a
    dropped client) from ``t`` shares and take the masks it derives off ``total``."""
    kind = "b" if v in survivors else "s"
    shares = {x: s for x, (k, s) in got.items() if k == kind}
    if len(shares) < t:
        raise SecAggAbort(f"client {v}'s {'self-mask seed' if kind == 'b' else 'mask key'} has {len(shares)} "
                          f"shares from surviving clients; the threshold is {t}")
    secret = shamir_join(dict(sorted(shares.items())[:t]))
    tr.reconstructed[v] = kind
    if kind == "b":
        return ring_sub(total, prg(secret, total.numel()))
    s_sk = X25519PrivateKey.from_private_bytes(secret)
    for u in sorted(neighbors & survivors):  # u added +PRG(s_uv) if v > u, −PRG(s_uv) if v < u
        mask = prg(agree(s_sk, roster[u][1], b"mask"), total.numel())
        total = ring_sub(total, mask) if v > u else ring_add(total, mask)
    return total


# ---- named tensors ------------------------------------------------------------------------------------------------
def flatten(tensors: Mapping[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    return torch.cat([tensors[k].detach().double().flatten() for k in keys]) if keys else torch.zeros(0)


def unflatten(flat: torch.Tensor, like: Mapping[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    out, i = {}, 0
    for k in keys:
        n = like[k].numel()
        out[k] = flat[i:i + n].reshape(like[k].shape)
        i += n
    return out
