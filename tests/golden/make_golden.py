"""Golden final metrics: every registered algorithm on a tiny run under every deterministic in-process executor.

``python tests/golden/make_golden.py`` rewrites ``tests/golden/metrics.json``; ``tests/system/test_golden.py`` re-runs
the cells and compares bit for bit.  Regenerate only for a change that is *meant* to move a number, and list the
cell with its before/after in the commit message (docs/design.md, "Golden metrics").

The setting: bundled digits, a 64-16-10 MLP, 4 clients (3 per round), 3 rounds, seed 1; the LoRA algorithms and
Simple-FedMA run on generated token sequences with a tiny transformer (as in the conformance suite).  ``auto``
is left out: it picks an executor by timing, so its cell would depend on the machine's load.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

GOLDEN = Path(__file__).with_name("metrics.json")
EXECUTORS = ("sequential", "batched", "processes")
ROUNDS = 3


def lora_base() -> str:
    from fedfuse.models.transformer import TransformerModel

    torch.manual_seed(0)
    kw = {"d_model": 8, "n_heads": 2, "n_layers": 1, "d_ff": 12, "dropout": 0.0, "max_len": 16}
    path = Path(tempfile.mkdtemp()) / "base.pt"
    torch.save({"kind": "fedfuse-lm", "model": kw, "vocab": [str(i) for i in range(30)],
                "state": TransformerModel(30, 30, task="lm", **kw).state_dict()}, path)
    return f"fedfuse:{path}"


def token_federation():
    from fedfuse.types import ClientData, Federation, Split

    g = torch.Generator().manual_seed(0)

    def split(n: int) -> Split:
        x = torch.randint(0, 30, (n, 10), generator=g)
        return Split(x, torch.roll(x, -1, dims=1))

    clients = [ClientData(c, split(n), split(4), split(6)) for c, n in enumerate((20, 17, 24))]
    return Federation(clients, split(12), 30, (10,), task="lm", dataset="tiny-shakespeare", partition="iid")


def is_lora(algorithm: str) -> bool:
    from fedfuse.algorithms import ALGORITHMS

    return ALGORITHMS[algorithm].__module__ in ("fedfuse.algorithms.fedit", "fedfuse.algorithms.fedmerge_lora")


#: The tiny runs' image models, first match wins: an algorithm runs on the first one that has what it declares it
#: ``requires`` (``fedfuse.engine.personal.REQUIREMENTS``).  The BatchNorm ResNet trains with a smaller step: at
#: 0.05 its second round is chaotic enough that float summation order (batched vs sequential) moves a client's
#: weights by 0.05.
TINY_MODELS: tuple[dict[str, Any], ...] = (
    dict(model="mlp", model_options={"widths": [16]}, lr=0.05),
    dict(model="resnet9", model_options={"width_mult": 0.25}, lr=0.01),
)


def tiny_model(algorithm: str) -> dict[str, Any]:
    """The model (``model``, ``model_options``, ``lr``) of ``algorithm``'s tiny digits run: the first of
    :data:`TINY_MODELS` that meets what the algorithm ``requires``."""
    from fedfuse.algorithms import ALGORITHMS
    from fedfuse.engine.personal import unmet_requirements
    from fedfuse.models import build_model

    requires = ALGORITHMS[algorithm].requires
    for choice in TINY_MODELS:
        model = build_model(choice["model"], (1, 8, 8), 10, **choice["model_options"])
        if not unmet_requirements(model, requires):
            return dict(choice)
    raise LookupError(f"no tiny model has what {algorithm} requires: {sorted(requires)}")


def config(algorithm: str, executor: str, base: str | None = None) -> dict[str, Any]:
    """The tiny run's configuration (a dict for ``fedfuse.config.apply``)."""
    common = dict(algorithm=algorithm, rounds=ROUNDS, seed=1, plots=False, executor=executor, local_epochs=1,
                  eval_every=1)
    if is_lora(algorithm):
        return dict(common, dataset="tiny-shakespeare", model="transformer", clients=3, clients_per_round=3,
                    batch_size=8, lr=0.01, optimizer="adam", partition="iid",
                    algorithm_options=dict(base=base, rank=2, rouge_samples=2, prompt_len=4, gen_tokens=3,
                                           lora_dropout=0.0))
    if algorithm == "simple-fedma":
        return dict(common, dataset="tiny-shakespeare", model="transformer", clients=3, clients_per_round=3,
                    batch_size=8, lr=0.1, partition="iid",
                    model_options=dict(d_model=8, n_heads=2, n_layers=1, d_ff=12, dropout=0.0, persistent_pe=True))
    return dict(common, dataset="digits", clients=4, clients_per_round=3, batch_size=32, **tiny_model(algorithm),
                partition_options={"alpha": 1.0, "min_size": 20})


def final_metrics(algorithm: str, executor: str, base: str | None = None) -> dict[str, Any]:
    """The last round's record of the tiny run, without wall-clock fields."""
    from fedfuse.config import RunConfig, apply
    from fedfuse.engine.loop import strip_timing
    from fedfuse.runner import experiment

    lm = is_lora(algorithm) or algorithm == "simple-fedma"
    cfg = apply(RunConfig(), config(algorithm, executor, base))
    exp = experiment(cfg, fed=token_federation() if lm else None)
    exp.run()
    rec = strip_timing(exp.history[-1])
    return json.loads(json.dumps(rec))  # as the file holds it (floats round-trip exactly)


def main() -> None:
    from fedfuse.algorithms import ALGORITHMS

    torch.set_num_threads(1)
    base = lora_base()
    only = set(sys.argv[1:])
    out: dict[str, dict[str, Any]] = json.loads(GOLDEN.read_text()) if GOLDEN.exists() and only else {}
    for algorithm in sorted(ALGORITHMS):
        if only and algorithm not in only:
            continue
        out[algorithm] = {ex: final_metrics(algorithm, ex, base) for ex in EXECUTORS}
        print(algorithm, {ex: out[algorithm][ex].get("global_accuracy") for ex in EXECUTORS}, flush=True)
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
