"""FedRolex (Alam et al., NeurIPS 2022/2023): HeteroFL with a *rolling* sub-model window.

At round t every client of ratio μ keeps the units ``roll(arange(K), t)[:⌈μK⌉]`` of every hidden group
(:func:`fedfuse.fusion.slicing.rolling_indices`; the authors' code ``AIoT-MLSys-Lab/FedRolex`` rolls with
``torch.roll(arange(K), t % K)``), so the window's start moves by one unit per round and wraps; it is the same
for every client and every layer of a residual stream.  Everything else is HeteroFL's (holder averaging,
label-split head, masked cross-entropy, Scaler), except BN: static BN without running statistics and **no**
recompute pass (the global model is evaluated with batch statistics).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfuse.algorithms.heterofl import HeteroFL
from fedfuse.fusion.slicing import Selection, rolling_indices
from fedfuse.options import opt
from fedfuse.types import Privacy, ServerView, not_built


class FedRolex(HeteroFL):
    name = "fedrolex"
    description = "FedRolex: HeteroFL with a rolling width window (start moves one unit per round)"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                "HeteroFL's holder averaging with a rolling window: sums of zero-padded sub-models",
                central_dp=not_built('per-coordinate holder counts change the sensitivity per coordinate; not '
                                      'wired'),
                local_dp=not_built('DP-SGD on the sub-model step would fit'),
                secagg=not_built('mask the zero-padded sub-model and its holder indicator: only the sums '
                                  'remain')),
    )

    @dataclass
    class Options(HeteroFL.Options):
        sbn: bool = opt(False, "recompute BN statistics before evaluation (FedRolex: no, batch statistics at "
                        "evaluation)")

    def selection(self, n: int, r: int) -> Selection:
        mu = self.mu_of(n)
        return {g: rolling_indices(k, mu, r) for g, k in self.spec.groups.items()}

