"""Separate knowledge: a partition's ground truth (true client clusters) reaches diagnostics, never an algorithm's
training hooks.  What the server may know is the clients' sizes and replies."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.config import RunConfig, apply
from fedfuse.engine.context import RunContext
from fedfuse.engine.loop import Experiment
from fedfuse.outputs import output_callbacks
from fedfuse.types import GROUND_TRUTH_INFO, ClientData, Federation, Split


class Spy(FedAvg):
    """FedAvg that records what each hook was handed."""

    seen: dict[str, list[Any]]

    def __init__(self, ctx, options=None) -> None:
        super().__init__(ctx, options)
        self.seen = {"setup": [], "program": [], "evaluate": [], "diagnostics": [], "finish": []}

    def setup(self, fed: Federation) -> Federation:
        self.seen["setup"].append((fed.groups(), [c.group for c in fed.clients],
                                   sorted(set(fed.info) & set(GROUND_TRUTH_INFO))))
        return fed

    def client_program(self, payload, client_state, data: ClientData):
        self.seen["program"].append(data.group)
        return super().client_program(payload, client_state, data)

    def evaluate(self, payload, client_state, data: ClientData, gen: torch.Generator) -> dict[str, float]:
        self.seen["evaluate"].append(data.group)
        return super().evaluate(payload, client_state, data, gen)

    def diagnostics(self, state, fed: Federation, info) -> dict[str, Any]:
        self.seen["diagnostics"].append(fed.groups())
        return {}

    def finish(self, state, fed: Federation, out_dir) -> None:
        self.seen["finish"].append(fed.groups())


def _cfg(executor: str, out: str | None) -> RunConfig:
    return apply(RunConfig(), dict(
        algorithm="fedavg", dataset="digits", model="mlp", model_options={"widths": [8]}, clients=4,
        clients_per_round=4, rounds=1, batch_size=32, seed=0, plots=False, executor=executor, out=out,
        partition="label-cluster", partition_options={"clusters": 2}))


@pytest.mark.parametrize("executor", ["sequential", "batched"])
def test_training_hooks_never_see_the_true_clusters_but_diagnostics_do(executor, tmp_path):
    exp = Experiment(_cfg(executor, str(tmp_path)), Spy)
    exp.attach(*output_callbacks(exp.fed))  # the run directory's files for the user, as fedfuse.runner attaches
    truth = exp.fed.groups()
    assert truth == [0, 0, 1, 1]  # label-cluster with 2 clusters over 4 consecutive client ids
    assert "clusters_classes" in exp.fed.info and "group_sizes" in exp.fed.info
    exp.run()
    spy = exp.algo
    assert spy.seen["setup"] == [(None, [None] * 4, [])]
    assert len(spy.seen["program"]) == 4 and set(spy.seen["program"]) == {None}
    assert len(spy.seen["evaluate"]) == 4 and set(spy.seen["evaluate"]) == {None}
    assert spy.seen["diagnostics"] == [truth] and spy.seen["finish"] == [truth]
    # the run's own outputs keep the ground truth (partition.json is written for the user, not the algorithm)
    import json

    written = json.loads((tmp_path / "partition.json").read_text())
    assert [c["group"] for c in written["clients"]] == truth


def test_the_run_context_holds_no_ground_truth():
    names = {f.name for f in dataclasses.fields(RunContext)}
    assert not any("group" in n or "truth" in n for n in names), names


def test_blinding_keeps_the_data_and_drops_only_the_truth():
    split = Split(torch.arange(6.0).view(3, 2), torch.tensor([0, 1, 0]))
    fed = Federation([ClientData(0, split, split, split, group=1), ClientData(1, split, split, split, group=0)],
                     split, 2, (2,), info={"name": "x", "group_sizes": [1, 1], "client_classes": [[0], [1]]})
    blind = fed.blinded()
    assert blind.groups() is None and blind.info == {"name": "x"}
    assert blind.clients[0].train.x is fed.clients[0].train.x  # no copy of the data
    assert fed.groups() == [1, 0]  # the original is untouched
    back = dataclasses.replace(blind, info={**blind.info, "public_size": 3}).with_truth_of(fed)
    assert back.groups() == [1, 0] and back.info == {"name": "x", "public_size": 3, "group_sizes": [1, 1],
                                                     "client_classes": [[0], [1]]}
