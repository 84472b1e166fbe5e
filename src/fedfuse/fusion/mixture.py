"""Several models in one message, and the E-step of a mixture of models (IFCA, FedEM, FedEM-LoRA).

Pure functions on named tensors: :func:`pack` / :func:`unpack` carry ``count`` state dicts in one
:class:`~fedfuse.types.Message` (key ``m{j}/{name}``); :func:`e_step` turns per-sample losses of M models into
responsibilities and new mixture weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedfuse.types import TensorDict


def pack(states: Sequence[Mapping[str, torch.Tensor]]) -> TensorDict:
    """Several state dicts in one message: key ``m{j}/{name}``."""
    return {f"m{j}/{k}": v for j, s in enumerate(states) for k, v in s.items()}


def unpack(tensors: Mapping[str, torch.Tensor], count: int) -> list[TensorDict]:
    """The inverse of :func:`pack`: ``count`` state dicts."""
    out: list[TensorDict] = [{} for _ in range(count)]
    for key, v in tensors.items():
        j, _, name = key.partition("/")
        out[int(j[1:])][name] = v
    return out


def e_step(losses: torch.Tensor, pi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Responsibilities q (n × M, rows sum to 1) from per-sample losses (M × n) and priors π; new π = mean q."""
    logq = torch.log(pi.to(torch.float64).clamp_min(1e-300))[None, :] - losses.to(torch.float64).T
    q = torch.softmax(logq, dim=1)
    return q, q.mean(0) if q.shape[0] else pi.to(torch.float64)


__all__ = ["e_step", "pack", "unpack"]
