"""Several models in one message, and the E-step of a mixture of models (IFCA, FedEM, FedEM-LoRA).

Pure functions on named tensors: :func:`pack` / :func:`unpack` carry ``count`` state dicts in one
:class:`~fedfuse.types.Message` (key ``m{j}/{name}``); :func:`e_step` turns per-sample losses of M models into
responsibilities and new mixture weights; :func:`mixture_objective` is the M-step's per-sample loss of M models
trained as one module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

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


def mixture_objective(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ_m q_m ℓ_m per sample, the M-step objective of M models stacked into one module (FedEM, FedEM-LoRA).

    Classification: ``logits`` (B, M, C), ``targets`` (B, 1 + M) = [label, q_1 … q_M], ℓ_m the cross-entropy.
    Sequences: ``logits`` (B, M, T, V), ``targets`` (B, T + M) = [token ids as floats (−100 = not counted),
    q_1 … q_M], ℓ_m the row's summed token loss over its counted tokens.  The models share no parameter, so
    each one's gradient is that of its own q-weighted loss.
    """
    M = logits.shape[1]
    if logits.dim() == 3:  # one target per sample
        logits = logits.unsqueeze(2)
    y = targets[:, :-M].long()
    q = targets[:, -M:]
    tok = F.cross_entropy(logits.permute(0, 3, 1, 2), y.unsqueeze(1).expand(-1, M, -1), reduction="none")
    counted = (y != -100).sum(1).clamp_min(1).to(tok.dtype)
    return (q * tok.sum(2)).sum(1) / counted


def mixture_loss(batch: Any) -> torch.Tensor:
    """The M-step loss of a client program (``ClientProgram(loss=mixture_loss)``): :func:`mixture_objective` of a
    :class:`fedfuse.engine.program.Batch`'s logits and targets, averaged over its real samples."""
    return batch.mean(mixture_objective(batch.logits, batch.y))


__all__ = ["e_step", "mixture_loss", "mixture_objective", "pack", "unpack"]
