"""docs/extending.md runs: its Python blocks, in order, form a module whose algorithm reproduces the shipped
SCAFFOLD bit for bit (so the walk-through and the code cannot drift apart)."""

from __future__ import annotations

import re
import sys
import types

import torch

from fedfuse.algorithms import ALGORITHMS
from fedfuse.algorithms.base import Algorithm
from fedfuse.config import RunConfig, apply
from fedfuse.engine.loop import Experiment, strip_timing
from fedfuse.runner import experiment
from support import ROOT

DOC = ROOT / "docs" / "extending.md"


def walkthrough_module() -> types.ModuleType:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 5
    module = types.ModuleType("walkthrough_scaffold")
    sys.modules[module.__name__] = module  # dataclasses resolve the module's annotations through sys.modules
    try:
        exec(compile("".join(blocks), str(DOC), "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module


def test_the_walkthrough_defines_the_shipped_scaffold():
    mod = walkthrough_module()
    cls = mod.Scaffold
    assert issubclass(cls, Algorithm) and cls.name == "scaffold" and cls is not ALGORITHMS["scaffold"]
    cfg = apply(RunConfig(), dict(algorithm="scaffold", dataset="digits", model="mlp", clients=4,
                                  clients_per_round=3, rounds=2, batch_size=32, lr=0.05, seed=1, plots=False,
                                  local_epochs=1, model_options={"widths": [16]},
                                  partition_options={"alpha": 1.0, "min_size": 20}))
    doc = Experiment(cfg, cls)
    doc.run()
    shipped = experiment(cfg)
    shipped.run()
    assert type(doc.algo) is cls and type(shipped.algo) is ALGORITHMS["scaffold"]
    assert [strip_timing(h) for h in doc.history] == [strip_timing(h) for h in shipped.history]
    assert all(torch.equal(doc.state["c"][k], shipped.state["c"][k]) for k in shipped.state["c"])
