"""FedBN (Li, Jiang, Zhang, Kamp and Dou, ICLR 2021): FedAvg in which every client keeps its BatchNorm layers.

Under feature shift (each client's inputs come from another distribution: other scanners, domains, rotations)
a client's BatchNorm statistics and affine parameters describe its own inputs.  FedBN (Algorithm 1) averages
every other entry as FedAvg does and never sends, receives or averages the BN layers' ``weight``, ``bias``,
``running_mean``, ``running_var`` and ``num_batches_tracked``: they are declared ``stays_local`` and the engine
keeps them on the client (:mod:`fedfuse.engine.personal`).  Each client evaluates the shared entries with its
own BN layers; there is no global model to test on the global test set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfuse.algorithms.base import StaysLocal
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.options import opt
from fedfuse.types import Privacy, ServerView, no, not_built


class FedBN(FedAvg):
    name = "fedbn"
    description = "FedBN: FedAvg in which each client keeps its BatchNorm layers (affine and statistics)"
    requires = frozenset({"batchnorm"})
    stays_local = StaysLocal(kinds=("bn",))
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                "the sample-weighted mean of the shared entries needs only their sums; BN layers never leave",
                central_dp=not_built("DP-FedAvg on the shared entries: the clipped norm would have to leave out "
                                     "the BN entries, which the noised mean does not do"),
                local_dp=no("BatchNorm mixes the samples of a batch: there is no per-sample gradient to clip"),
                secagg=not_built("the masked sum would carry the shared entries only; not wired")),
    )

    @dataclass
    class Options:
        weighting: str = opt("samples", "client weights of the mean: samples (n_i, the paper) or uniform",
                             choices=("samples", "uniform"))
        fusion: str = opt("mean", "fusion rule of the shared entries: mean (weighted, the paper), median or "
                                  "trimmed-mean (robust rules are unweighted)",
                          choices=("mean", "median", "trimmed-mean"))
        trim: float = opt(0.1, "trimmed-mean: fraction of values cut at each end of every coordinate",
                          ge=0.0, lt=0.5)
        clip_norm: float = opt(0.0, "clip every client's update to this L2 norm before fusion (0 = off)", ge=0.0)
        server_lr: float = opt(1.0, "server learning rate on the averaged update (1 = plain FedBN)", gt=0.0)
        int_policy: ClassVar[str] = "max"  # not an option: no BatchNorm counter reaches the server
