"""Sealed envelopes for a peer exchange of model units (FedMR's secure recombination, App. B): X25519 key
agreement, HKDF-SHA256, AES-256-GCM, and a unit's tensors as raw bytes.

Pure functions: keys come from the operating system's randomness, never from the run's seed (the server knows it);
a sealed envelope is a uint8 tensor ``nonce || ciphertext || tag`` that a relay can route like any tensor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from fedfuse.types import TensorDict

Unit = tuple[str, ...]  # the state-dict keys that travel together

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
