"""CluSamp (Fraboni, Vidal, Kameni, Lorenzi, ICML 2021, "Clustered sampling"): FedAvg whose participants are
drawn by clustered sampling, aggregated with Fraboni's unbiased weights.

The sampling itself is an engine policy (:mod:`fedfuse.engine.sampling`, ``sampling=clustered``), so it
combines with any algorithm; this class is the method as FedMR's Table 1 runs it ("clients clustered by
model-gradient similarity", i.e. the paper's Algorithm 2):

* ``default_sampling = "clustered"`` — with the run's ``sampling: auto`` every round draws one client from
  each of m = ``clients_per_round`` distributions built from the clients' representative gradients
  (Algorithm 2; ``sampling=clustered-size`` gives Algorithm 1, ``size-weighted`` MD sampling);
* aggregation (Eq. 2 of the paper, ``FedAvg_agregation_process`` with weights 1/m in the authors' code):
  θ ← Σ_i ω_i θ_i with ω_i = (times client i was drawn)/m, which the engine hands over as
  ``meta["sampling_weight"]``; E[ω_i] = p_i = n_i / Σ n_j (Proposition 1).  ``weighting="samples"`` uses
  FedAvg's n_i-weights over the drawn clients instead.

BatchNorm statistics are averaged with the same weights; ``num_batches_tracked`` follows ``int_policy``.
The authors' code trains a client drawn twice twice; here it trains once and counts twice (same expectation).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.options import opt
from fedfuse.types import Message, Privacy, ServerView, no, yes


class CluSamp(FedAvg):
    name = "clusamp"
    description = "CluSamp: FedAvg with clustered client sampling (gradient similarity, Fraboni et al. Alg. 2)"
    privacy = (
        Privacy(ServerView.DELTAS,
                ("clustered sampling compares every client's representative gradient (its last update) with "
                 "every other's"),
                central_dp=no('the clustering reads each update; noising only the mean leaves the per-client '
                               'updates exposed'),
                local_dp=yes('the client step is plain SGD on the task loss: DP-SGD through Opacus (BN-free models)'),
                secagg=no("masked updates are uniformly random: no angle between two clients' gradients can be"
                           ' computed')),
    )
    default_sampling = "clustered"

    @dataclass
    class Options(FedAvg.Options):
        weighting: str = opt("sampling", "aggregation weights: sampling = (times drawn)/m (paper and code); "
                             "samples = n_i over the drawn clients; uniform", choices=("sampling", "samples",
                                                                                        "uniform"))

    def client_weights(self, results: dict[int, Message]) -> list[float]:
        if self.opt.weighting == "sampling":
            return [float(r.meta.get("sampling_weight", 1.0 / max(len(results), 1))) for r in results.values()]
        return super().client_weights(results)
