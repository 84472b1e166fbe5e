"""Representation terms: loss terms on the model's penultimate features and on frozen models' features.

A :class:`~fedfuse.engine.program.ClientProgram` that declares ``features=True`` hands its loss and terms the
trained model's penultimate representation as ``batch.features`` (one forward pass gives features and logits).
A term may also read the representation of *other* models — MOON's global and previous local models, MSfusion's
aggregated and previous sub-models — under two rules that keep it the same in every executor:

- the other model is **frozen**: its tensors are per-client constants in the program's ``refs`` (under a
  prefix), its module is a template of its own (never the trained one: putting a shared template in eval mode
  would change the training pass), and :func:`frozen_features` evaluates it functionally without gradient;
- the **algorithm counts the extra forward passes** in its reply's FLOPs (:func:`features_flops_per_sample` ×
  samples processed, once per frozen model): ``Algorithm.fit_stats`` counts the trained model's forward and
  backward only.

:func:`contrastive_loss` is the model-contrastive objective both methods share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedfuse.engine.client import forward_flops_per_sample
from fedfuse.errors import UserError
from fedfuse.types import TensorDict


def contrastive_loss(z: torch.Tensor, z_pos: torch.Tensor, z_neg: torch.Tensor, tau: float = 0.5,
                     similarity: str = "cosine", reduction: str = "mean") -> torch.Tensor:
    """−log(e^{sim(z, z⁺)/τ} / (e^{sim(z, z⁺)/τ} + e^{sim(z, z⁻)/τ})) = softplus((sim(z, z⁻) − sim(z, z⁺))/τ),
    averaged over samples (MOON's ℓ_con, Eq. 3; MSfusion's Eq. 7).

    Inputs are (B, D) (or (B, L, D), flattened to tokens).  ``similarity="cosine"`` normalises the vectors,
    ``"dot"`` takes the raw dot product.  ``reduction="none"`` returns one value per sample (per token for
    (B, L, D) inputs).  Zeroed entries (masked units) contribute nothing to either similarity.
    """
    if z.shape[-1] == 0:  # no common unit: the term is undefined and contributes nothing
        return z.sum() * 0.0
    z, z_pos, z_neg = (t.reshape(-1, t.shape[-1]) for t in (z, z_pos, z_neg))
    if similarity == "cosine":
        pos, neg = F.cosine_similarity(z, z_pos, dim=-1), F.cosine_similarity(z, z_neg, dim=-1)
    elif similarity == "dot":
        pos, neg = (z * z_pos).sum(-1), (z * z_neg).sum(-1)
    else:
        raise UserError(f"similarity={similarity!r}; choose dot or cosine")
    per = F.softplus((neg - pos) / tau)
    return per if reduction == "none" else per.mean()


class FeatureView(nn.Module):
    """``forward`` = the wrapped model's penultimate ``features`` (for ``functional_call`` on frozen copies)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.features(x)


def prefixed(refs: TensorDict, prefix: str) -> TensorDict:
    """The entries of ``refs`` under ``prefix``, renamed for a :class:`FeatureView` (``model.<key>``)."""
    return {"model." + k[len(prefix):]: v for k, v in refs.items() if k.startswith(prefix)}


def frozen_features(view: FeatureView, refs: TensorDict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """The features of the frozen model whose tensors are ``refs[prefix + key]``, on ``x``, without gradient."""
    with torch.no_grad():
        return functional_call(view, prefixed(refs, prefix), (x,), strict=False)


def features_flops_per_sample(view: FeatureView, x: torch.Tensor, key: tuple = ()) -> float:
    """Forward FLOPs of one sample through ``view`` (the features only, not the head)."""
    return forward_flops_per_sample(view, x, key=("features", *key))


__all__ = ["FeatureView", "contrastive_loss", "features_flops_per_sample", "frozen_features", "prefixed"]
