"""docs/extending.md runs: its Python blocks, in order, form modules — a block that starts with
``from __future__ import annotations`` starts the next one (an empty file) — whose algorithms reproduce the shipped
SCAFFOLD and FedBN bit for bit (so the walk-throughs and the code cannot drift apart)."""

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


def walkthrough_modules() -> list[types.ModuleType]:
    """The doc's walk-throughs as modules, in the order they are written."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    files: list[list[str]] = []
    for block in blocks:
        if block.startswith("from __future__ import annotations") or not files:
            files.append([])
        files[-1].append(block)
    modules = []
    for i, parts in enumerate(files):
        module = types.ModuleType(f"walkthrough_{i}")
        sys.modules[module.__name__] = module  # dataclasses resolve the module's annotations through sys.modules
        try:
            exec(compile("".join(parts), str(DOC), "exec"), module.__dict__)
        finally:
            del sys.modules[module.__name__]
        modules.append(module)
    return modules


def walkthrough_module() -> types.ModuleType:
    """SCAFFOLD's walk-through (the first)."""
    mod = walkthrough_modules()[0]
    assert len(re.findall(r"```python\n", DOC.read_text())) >= 5
    return mod


def _tiny(algorithm: str, **kw) -> RunConfig:
    base = dict(algorithm=algorithm, dataset="digits", model="mlp", clients=4, clients_per_round=3, rounds=2,
                batch_size=32, lr=0.05, seed=1, plots=False, local_epochs=1, model_options={"widths": [16]},
                partition_options={"alpha": 1.0, "min_size": 20})
    base.update(kw)
    return apply(RunConfig(), base)


def test_the_walkthrough_defines_the_shipped_scaffold():
    mod = walkthrough_module()
    cls = mod.Scaffold
    assert issubclass(cls, Algorithm) and cls.name == "scaffold" and cls is not ALGORITHMS["scaffold"]
    cfg = _tiny("scaffold")
    doc = Experiment(cfg, cls)
    doc.run()
    shipped = experiment(cfg)
    shipped.run()
    assert type(doc.algo) is cls and type(shipped.algo) is ALGORITHMS["scaffold"]
    assert [strip_timing(h) for h in doc.history] == [strip_timing(h) for h in shipped.history]
    assert all(torch.equal(doc.state["c"][k], shipped.state["c"][k]) for k in shipped.state["c"])


def test_the_walkthrough_defines_the_shipped_fedbn():
    """Section 8's two blocks, run as a file of their own, define FedBN; on a BatchNorm ResNet (every client taking
    part, evaluated every round) its run equals the shipped FedBN's bit for bit — metrics, the server's model and
    every client's own BatchNorm layers."""
    from fedfuse.engine.personal import OWN

    mod = walkthrough_modules()[1]
    cls = mod.FedBN
    assert issubclass(cls, Algorithm) and cls.name == "fedbn" and cls is not ALGORITHMS["fedbn"]
    assert cls.requires == ALGORITHMS["fedbn"].requires and cls.stays_local == ALGORITHMS["fedbn"].stays_local
    assert cls.privacy == ALGORITHMS["fedbn"].privacy
    cfg = _tiny("fedbn", model="resnet9", model_options={"width_mult": 0.25}, lr=0.01, clients_per_round=4,
                eval_every=1)
    doc = Experiment(cfg, cls)
    doc.run()
    shipped = experiment(cfg, fed=doc.fed)
    shipped.run()
    assert type(doc.algo) is cls and type(shipped.algo) is ALGORITHMS["fedbn"]
    assert [strip_timing(h) for h in doc.history] == [strip_timing(h) for h in shipped.history]
    assert all(torch.equal(doc.state["global"][k], v) for k, v in shipped.state["global"].items())
    for c, st in shipped.client_states.items():
        assert all(torch.equal(doc.client_states[c][OWN][k], v) for k, v in st[OWN].items())
