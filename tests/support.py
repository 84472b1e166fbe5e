"""Helpers shared by several test files (``tests/`` is on ``sys.path`` through ``conftest.py``): the repository's
paths, the conformance suite's tiny run per algorithm and FedMR's tiny run."""

from __future__ import annotations

from pathlib import Path

from fedfuse.algorithms import ALGORITHMS
from fedfuse.config import RunConfig, apply
from golden.make_golden import lora_base

ROOT = Path(__file__).resolve().parent.parent
"""The repository (worktree) root."""
SHARED_DATA = ROOT.parent / "shared" / "data"
"""Shared datasets beside the repository (``../shared/data``)."""


LORA = {name for name, cls in ALGORITHMS.items() if cls.__module__ in ("fedfuse.algorithms.fedit",
                                                                       "fedfuse.algorithms.fedmerge_lora")}
_BASE: dict[str, str] = {}


def _lora_base() -> str:
    """A tiny frozen base (fedfuse transformer, vocabulary 30) for the LoRA algorithms, written once."""
    if "path" not in _BASE:
        _BASE["path"] = lora_base()
    return _BASE["path"]


def conformance_cfg(algorithm: str, executor: str) -> RunConfig:
    """A tiny run of ``algorithm`` under ``executor``: digits + MLP, or generated token sequences + a transformer
    for Simple-FedMA and the LoRA algorithms (the conformance, options-act and Flower suites share it)."""
    if algorithm in LORA:  # LoRA adapters on a frozen base LM: generated token sequences
        return apply(RunConfig(), dict(
            algorithm=algorithm, dataset="tiny-shakespeare", model="transformer", clients=3, clients_per_round=3,
            rounds=2, batch_size=8, lr=0.01, optimizer="adam", seed=2, plots=False, executor=executor,
            local_epochs=1, eval_every=2, partition="iid",
            algorithm_options=dict(base=_lora_base(), rank=2, rouge_samples=2, prompt_len=4, gen_tokens=3)))
    if algorithm == "simple-fedma":
        return apply(RunConfig(), dict(
            algorithm=algorithm, dataset="tiny-shakespeare", model="transformer", clients=3, clients_per_round=3,
            rounds=2, batch_size=8, lr=0.1, seed=2, plots=False, executor=executor, local_epochs=1,
            eval_every=2, partition="iid",
            model_options=dict(d_model=8, n_heads=2, n_layers=1, d_ff=12, dropout=0.0, persistent_pe=True),
        ))
    return apply(RunConfig(), dict(
        algorithm=algorithm, dataset="digits", model="mlp", clients=4, clients_per_round=3, rounds=2,
        batch_size=32, lr=0.05, seed=1, plots=False, executor=executor, local_epochs=1, eval_every=2,
        model_options={"widths": [16]}, partition_options={"alpha": 1.0, "min_size": 20},
    ))


def fedmr_cfg(tmp_path=None, **kw) -> RunConfig:
    """FedMR on digits (6 clients, 3 per round, 3 rounds, MLP 64-16-16-10); ``kw`` overrides any key."""
    base = dict(
        algorithm="fedmr", dataset="digits", partition="dirichlet", model="mlp", clients=6, clients_per_round=3,
        rounds=3, local_epochs=1, batch_size=32, lr=0.05, seed=5, plots=False,
        out=str(tmp_path / "run") if tmp_path is not None else None,
        model_options={"widths": [16, 16]}, partition_options={"alpha": 0.5, "min_size": 20},
    )
    base.update(kw)
    return apply(RunConfig(), base)
