"""Simple-FedMA (Holm, Sajjad, Matjasec, L46 report §3.2): align transformer clients by permutation, then average.

Each round the clients train the global model (FedAvg-style; round 0 from the shared initialisation, or from
their own with ``init="distinct"`` as in the report's distinct-initialisation experiment).  The server takes
the first client (lowest id) as the reference, permutes every other client's model onto it with hard
permutations (no growth, no retraining) and averages (``weighting="uniform"`` as in the report, or by
samples).  Permutation groups and their order follow the report (the groups the transformer declares,
:meth:`~fedfuse.models.transformer.TransformerModel.perm_groups`): residual stream (determined by the embedding
columns), per block Q/K together, V, MLP hidden; the cost is the L1 distance between the determining rows (report's
code) and the assignment is solved by ``linear_sum_assignment`` (:func:`~fedfuse.fusion.align.align_to`).
Extensions beyond the report: several heads (whole heads first, then within each head, Q/K and V sharing the
head order), several blocks, N clients (all aligned to the reference), ``metric="l2"``.
The residual stream can only be permuted when the positional table is in the state dict: build the model
with ``--set persistent_pe=true``; otherwise that group is skipped (``residual="auto"``).
``diagnostics`` reports how many units moved per group (the report's "number of permutations").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState
from fedfuse.engine.context import client_initial_state
from fedfuse.engine.program import ClientProgram
from fedfuse.errors import UnsupportedModel, UserError
from fedfuse.fusion.align import align_to
from fedfuse.fusion.average import weighted_average
from fedfuse.fusion.permute import PermGroup, perm_spec
from fedfuse.options import opt
from fedfuse.types import ClientData, Message, Privacy, ServerView, TensorDict, no, not_built


class SimpleFedMA(Algorithm):
    name = "simple-fedma"
    description = "Simple-FedMA: permute transformer clients onto a reference (residual, Q/K, V, MLP), then average"
    privacy = (
        Privacy(ServerView.MODELS,
                "each client's transformer is permuted onto a reference by comparing its own weights",
                central_dp=no('the permutation is chosen per client from its weights, before any sum is formed'),
                local_dp=not_built('DP-SGD on the client step would protect the examples; alignment still sees'
                                    ' each model'),
                secagg=no('masked weights cannot be aligned: the permutation must be found before summing')),
    )

    @dataclass
    class Options:
        metric: str = opt("l1", "permutation cost between rows (report's code: L1)", choices=("l1", "l2"))
        weighting: str = opt("uniform", "average of the aligned models: plain (report) or by samples",
                             choices=("uniform", "samples"))
        init: str = opt("shared", "round-0 client models: one shared or distinct initialisations (report §4.2.3)",
                        choices=("shared", "distinct"))
        residual: str = opt("auto", "permute the residual stream: 'auto' (when the positional table is "
                            "persistent), 'yes' or 'no'", choices=("auto", "yes", "no"))

    def __init__(self, ctx, options=None) -> None:
        super().__init__(ctx, options)
        if getattr(ctx.model(), "perm_groups", None) is None:  # the model declares its permutation groups
            raise UnsupportedModel(f"simple-fedma permutes transformer layers; model {ctx.model_name!r} is not a "
                                   "transformer (use --model transformer, or fedma / oneshot-match for MLPs and CNNs)")

    def _spec(self):
        flag = {"auto": None, "yes": True, "no": False}[self.opt.residual]
        return perm_spec(self.ctx.model(), residual=flag)

    def init_state(self) -> ServerState:
        return {**super().init_state(), "moved": {}}

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        if info.index == 0 and self.opt.init == "distinct":
            return {c: Message(meta={"init": "distinct"}) for c in clients}
        msg = Message(state["global"])
        return {c: msg for c in clients}

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """The standard step, from the client's own seeded initialisation in round 0 with ``init=distinct``
        (the code's distinct initial models) and from the received global model afterwards."""
        if payload.meta.get("init") == "distinct":
            payload = Message(client_initial_state(self.ctx, data.cid, "distinct"))
        return self.standard_program(payload, client_state, data)

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        cids = sorted(results)
        if self.opt.weighting == "samples":
            w = [float(results[c].num_examples) for c in cids]
        elif self.opt.weighting == "uniform":
            w = [1.0] * len(cids)
        else:
            raise UserError(f"weighting={self.opt.weighting!r}; choose uniform or samples")
        merged, moved = merge([results[c].tensors for c in cids], self._spec(), self.opt.metric, w,
                              base=state["global"])
        return {**state, "global": merged, "moved": moved}

    def diagnostics(self, state: ServerState, fed, info: RoundInfo) -> dict[str, Any]:
        return {f"moved/{k}": v for k, v in state["moved"].items()}


def merge(
    states: Sequence[TensorDict], spec: Sequence[PermGroup], metric: str = "l1",
    weights: Sequence[float] | None = None, base: TensorDict | None = None,
) -> tuple[TensorDict, dict[str, int]]:
    """Simple-FedMA's server step: align every state to ``states[0]`` (:func:`~fedfuse.fusion.align.align_to`),
    then average with ``weights`` (default uniform, as in the report).

    Returns the merged state and, per permutation group, how many units moved (summed over clients).
    """
    ref = states[0]
    aligned = [ref]
    moved: dict[str, int] = {}
    for other in states[1:]:
        st, perms = align_to(ref, other, spec, metric)
        aligned.append(st)
        for name, pm in perms.items():
            moved[name] = moved.get(name, 0) + int((pm != np.arange(len(pm))).sum())
    w = [1.0] * len(states) if weights is None else list(weights)
    return weighted_average(aligned, w, base=base), moved
