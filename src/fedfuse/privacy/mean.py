"""The mechanisms a server update of the form "mean of client deltas" can wear: central DP and secure aggregation.

An algorithm declares the form of its server update with ``server_update = MeanOfDeltas(...)``
(:class:`fedfuse.algorithms.mean_base.DeltaMean`).  The server sent a base b (the model; SCAFFOLD: the model and
zeros for its control-variate updates), client i replies, Δ_i = reply_i − b over b's floating entries, and the
server's update reads nothing but

    mean = b + Σ_i w_i·Δ_i / D

before its own server step (an SGD step with a server learning rate, momentum, Adam, ...: post-processing of the
mean).  Plain, w_i is the client's weight (n_i, or 1 for uniform weighting) and D = Σ_i w_i; the entries under a
prefix of ``MeanOfDeltas.unweighted`` enter with weight 1 whatever w_i is (the rule reads their plain sum
D·(mean − b), as SCAFFOLD's c ← c + Σ Δc_i / N does).  Because the sum is all the step reads, a mechanism only
changes how the sum is made, never the step:

* **central DP** (:class:`~fedfuse.privacy.central.CentralDP`): every Δ_i clipped as one vector, w_i = 1, Gaussian
  noise on the sum, D = m (the configured clients per round) — DP-FedAvg's noised mean;
* **secure aggregation** (:class:`SecureSum`): each client adds its own w_i·Δ_i and w_i to a masked sum
  (:mod:`fedfuse.privacy.secure` runs the protocol); the server decodes the two sums alone and forms the mean.
  With central DP as well, each client adds its clipped Δ_i and its centred bit b_i − ½ instead, and the server
  noises the decoded sum exactly as central DP without SecAgg noises the sum it computes itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedfuse.fusion.privacy import noised_keys
from fedfuse.privacy.central import CentralDP
from fedfuse.privacy.secure import WEIGHT_KEY
from fedfuse.types import TensorDict


@dataclass(frozen=True)
class MeanOfDeltas:
    """The declaration that a server update is a (weighted) mean of client deltas followed by the algorithm's own
    step (see the module docstring).  ``releases``: what a client's delta is, in words (the privacy declaration
    derived from it quotes it); ``unweighted``: key prefixes summed with weight 1 whatever the client weights;
    ``note``: what else the declaration should say (what stays on the client, an option that changes the view)."""

    releases: str = "Δ_i = θ_i − θ"
    unweighted: tuple[str, ...] = ()
    note: str = ""

    def weighted(self, key: str) -> bool:
        """Whether entry ``key`` of a delta is scaled by the client's weight w_i."""
        return not any(key.startswith(p) for p in self.unweighted)


class SecureSum:
    """Secure aggregation as a way to compute the sum of a :class:`MeanOfDeltas` update: what each client masks
    (:meth:`contribution`, run by the client) and the mean the server forms from the decoded sum alone
    (:meth:`mean`).  ``central``: the run's central-DP step when ``dp=central`` (clients then clip themselves)."""

    def __init__(self, declaration: MeanOfDeltas, central: CentralDP | None = None) -> None:
        self.declaration, self.central = declaration, central

    def contribution(self, base: Mapping[str, torch.Tensor], reply: Mapping[str, torch.Tensor], weight: float,
                     meta: Mapping[str, Any]) -> TensorDict:
        """**Client side**: w·Δ over ``base``'s floating entries (weight 1 on the unweighted ones; an entry the
        reply lacks is a zero delta) and w in :data:`WEIGHT_KEY`; under central DP, Δ clipped at the clip the
        payload's ``meta`` carries and the centred bit b − ½ in :data:`WEIGHT_KEY`."""
        if self.central is not None:
            upd, bit = self.central.contribution(base, reply, meta)
            return {**upd, WEIGHT_KEY: torch.tensor([bit], dtype=torch.float64)}
        out: TensorDict = {}
        for k in noised_keys(base):
            delta = (reply[k].double() - base[k].double() if k in reply
                     else torch.zeros_like(base[k], dtype=torch.float64))
            out[k] = delta * weight if self.declaration.weighted(k) else delta
        return {**out, WEIGHT_KEY: torch.tensor([float(weight)], dtype=torch.float64)}

    def mean(self, state: Mapping[str, Any], base: Mapping[str, torch.Tensor], total: Mapping[str, torch.Tensor],
             round_index: int, stage: int = 0) -> tuple[TensorDict | None, float, dict[str, float] | None]:
        """**Server side**, from the decoded sum ``total`` alone: (the mean b + Σ/D, its denominator D, central
        DP's record or None).  Without DP, D is the decoded weight sum and a sum of zero weight gives no mean
        (None); under central DP, D = m and the mean carries the mechanism's noise (an empty round's too).
        Entries of ``base`` that are not summed (integer buffers) are kept as they are."""
        count = float(total[WEIGHT_KEY].sum())
        sums = {k: v for k, v in total.items() if k != WEIGHT_KEY}
        if self.central is not None:
            mean, record = self.central.mean_of_sums(state, base, sums, count, round_index, stage)
            return mean, float(self.central.per_round), record
        if count <= 0:
            return None, 0.0, None
        mean = {k: (base[k].double() + sums[k] / count).to(base[k].dtype) if k in sums else base[k].clone()
                for k in base}
        return mean, count, None


__all__ = ["WEIGHT_KEY", "MeanOfDeltas", "SecureSum"]
