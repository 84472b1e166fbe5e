"""FedPer (Arivazhagan, Aggarwal, Singh and Choudhary, 2019): federated base layers, personalisation layers.

The model is a shared *base* followed by ``personal_layers`` *personalisation layers* (the last parametrised
layers of ``model.layers()``; the paper's best setting keeps the last one or two fully connected layers).  Every
round the clients train the whole model with the standard step; the server averages the base as FedAvg does, and
the personalisation layers never leave their client: they are declared ``stays_local``, so the engine keeps each
client's own (initialised from the run's initial model), merges them for training and evaluation and sends only
the base (:mod:`fedfuse.engine.personal`).  Each client evaluates the base with its own personalisation layers;
there is no global model.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfuse.algorithms.base import StaysLocal
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.errors import UserError
from fedfuse.options import opt
from fedfuse.types import Privacy, ServerView, not_built


class FedPer(FedAvg):
    name = "fedper"
    description = "FedPer: FedAvg on the base layers; the last personalisation layers stay on each client"
    requires = frozenset({"head"})
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                "the sample-weighted mean of the base needs only its sums; the personalisation layers never leave",
                central_dp=not_built("DP-FedAvg on the base only: the noised mean is not wired for entries that stay "
                                     "on the client"),
                local_dp=not_built("DP-SGD through Opacus would train the personalisation layers too; their "
                                   "accounting is not wired"),
                secagg=not_built("the masked sum would carry the base only; not wired")),
    )

    @dataclass
    class Options(FedAvg.Options):
        personal_layers: int = opt(1, "the last parametrised layers kept on each client (the paper: 1 or 2)", ge=1)

    def __init__(self, ctx, options=None) -> None:
        super().__init__(ctx, options)
        model = ctx.model()
        layers = [lay for lay in model.layers() if any(k in ctx.param_keys() for k in lay.keys)]
        if int(self.opt.personal_layers) >= len(layers):
            raise UserError(f"fedper: personal_layers={self.opt.personal_layers} leaves no base layer to share "
                            f"({type(model).__name__} has {len(layers)} parametrised layers)")

    @property
    def stays_local(self) -> StaysLocal:  # type: ignore[override]
        return StaysLocal(last_layers=int(self.opt.personal_layers))
