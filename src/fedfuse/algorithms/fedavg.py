"""FedAvg (McMahan et al. 2017): sample-weighted averaging of the clients' full model state.

BatchNorm running statistics are averaged with the same sample weights; ``num_batches_tracked`` follows
``int_policy`` (default ``"max"``; see :mod:`fedfuse.fusion.average`).  Server learning rate
``server_lr`` scales the averaged update (1.0 = plain FedAvg).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfuse.algorithms.base import Algorithm, RoundInfo, ServerState
from fedfuse.fusion.average import add_scaled, delta, weighted_average
from fedfuse.types import Message


class FedAvg(Algorithm):
    name = "fedavg"
    description = "FedAvg: sample-weighted average of the clients' full state (BN statistics included)"

    @dataclass
    class Options:
        weighting: str = "samples"  # "samples" (n_i-weighted) | "uniform"
        int_policy: str = "max"  # num_batches_tracked: "max" | "sum" | "first"
        server_lr: float = 1.0

    def client_weights(self, results: dict[int, Message]) -> list[float]:
        if self.opt.weighting == "uniform":
            return [1.0] * len(results)
        if self.opt.weighting != "samples":
            raise ValueError(f"weighting={self.opt.weighting!r}; choose samples or uniform")
        return [float(r.meta["num_examples"]) for r in results.values()]

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        avg = weighted_average(
            [r.tensors for r in results.values()],
            self.client_weights(results),
            base=state["global"],
            int_policy=self.opt.int_policy,  # type: ignore[arg-type]
        )
        if self.opt.server_lr != 1.0:
            avg = add_scaled(state["global"], delta(avg, state["global"]), self.opt.server_lr)
        return {**state, "global": avg}
