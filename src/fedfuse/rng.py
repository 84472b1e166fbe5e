"""Counter-based random streams.

Every random draw in fedfuse comes from a generator derived from ``(seed, purpose, round, client)``,
so a client's work gives the same result whatever order or process it runs in.

The exception is randomness that protects someone (differential-privacy noise and sampling): it must not be a
function of the run seed, which is in config.yaml and every record.  :func:`secure_numpy_rng` seeds a generator
from the OS's secure source instead.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed that depends only on ``seed`` and ``keys`` (stable across processes)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(str(int(seed)).encode())
    for k in keys:
        h.update(b"\x1f")
        h.update(str(k).encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def torch_generator(seed: int, *keys: int | str, device: torch.device | str = "cpu") -> torch.Generator:
    """A :class:`torch.Generator` seeded from ``derive_seed(seed, *keys)``."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, *keys))
    return g


def numpy_rng(seed: int, *keys: int | str) -> np.random.Generator:
    """A NumPy generator seeded from ``derive_seed(seed, *keys)``."""
    return np.random.default_rng(derive_seed(seed, *keys))


def secure_numpy_rng() -> np.random.Generator:
    """A NumPy generator (PCG64DXSM) seeded once with 256 bits of ``os.urandom``, returned and never stored: nobody
    who knows the run's seed, config or outputs can regenerate its draws (nor can this process, later)."""
    entropy = int.from_bytes(os.urandom(32), "little")
    return np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(entropy)))
