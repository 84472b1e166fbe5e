"""Counter-based random streams.

Every random draw in fedfuse comes from a generator derived from ``(seed, purpose, round, client)``,
so a client's work gives the same result whatever order or process it runs in.
"""

from __future__ import annotations

import hashlib

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
