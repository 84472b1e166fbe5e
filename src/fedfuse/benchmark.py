"""The benchmark matrix of ``fedfuse bench``: methods × heterogeneity regimes × seeds under one protocol
(docs/benchmark.md), planned as a :class:`fedfuse.reproduce.preset.Family` and run by the reproductions'
machinery (runs cached by config hash below ``--out``, resumable, ``--jobs``).

A *regime* is a data split of a dataset (:data:`REGIMES`); a *scale* (:data:`SCALES`) fixes the dataset, model,
federation size, round budget and local work.  Every method of a regime trains the same model class on the same
client data: a cell's config differs from FedAvg's only in ``algorithm`` and ``algorithm_options``.  Methods are
planned from the algorithm registry: a name of :data:`SINGLE` or :data:`WIDTH` that is not registered is left
out with a note (:func:`plan_methods`), so personalised methods join the matrix as they land.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedfuse.reproduce.common import data_root
from fedfuse.reproduce.preset import Family, Table

#: The single-architecture track: every client trains the same model class (the order of the rendered tables).
SINGLE: tuple[str, ...] = (
    "fedavg", "fedprox", "scaffold", "feddyn", "fednova", "fedavgm", "fedadam", "fedmr", "fedmut", "fedexp",
    "fedma", "fedmerge", "ifca", "fedem", "pfedmoe", "local", "fedavg-ft",
    "fedbn", "fedper", "fedrep", "ditto", "moon",  # the personalised methods (a name not registered is left out)
)
#: The width-sliced track: clients hold a slice of the full model (their own table per regime).
WIDTH: tuple[str, ...] = ("msfusion", "heterofl", "fedrolex")
#: The baseline of every paired test of the single-architecture track ...
BASELINE = "fedavg"
#: ... and of the width-sliced track (static first-k slices: the simplest width-sliced method).
WIDTH_BASELINE = "heterofl"


def baseline(track: str) -> str:
    """The paired tests' baseline of a track."""
    return BASELINE if track == "single" else WIDTH_BASELINE

#: Regimes by name: (partition, partition options, dataset options, description).  ``natural`` needs a dataset
#: with writers (FEMNIST); ``rotated`` deals each image a rotation group (``rotate_domains=4``: 0/90/180/270°)
#: and gives client group g the images of rotation g (feature shift, the same labels everywhere).
REGIMES: dict[str, tuple[str, dict[str, Any], dict[str, Any], str]] = {
    "iid": ("iid", {}, {}, "IID data (every client samples the same distribution)"),
    "dir0.5": ("dirichlet", {"alpha": 0.5}, {}, "moderate label skew (Dirichlet α = 0.5)"),
    "dir0.1": ("dirichlet", {"alpha": 0.1}, {}, "strong label skew (Dirichlet α = 0.1: most clients hold 1-3 classes)"),
    "shards2": ("shards", {"classes_per_client": 2}, {}, "pathological shards (2 classes per client)"),
    "clusters": ("label-cluster", {"clusters": 5}, {}, "5 client groups with disjoint label sets (2 classes "
                                                        "each)"),
    "rotated": ("domain", {}, {"rotate_domains": 4}, "feature shift (4 client groups see inputs rotated by 0, "
                                                     "90, 180 or 270 degrees)"),
    "natural": ("natural", {}, {}, "a natural split (one client per FEMNIST writer)"),
}


@dataclass(frozen=True)
class Scale:
    """A dataset at a stated scale: model, federation, round budget and local training shared by every cell."""

    dataset: str
    model: str
    regimes: tuple[str, ...]
    clients: int
    per_round: int
    rounds: int
    eval_every: int
    training: dict[str, Any]
    dataset_options: dict[str, Any]
    methods: tuple[str, ...] = ()  # () = every registered method of both tracks
    seeds: int = 3
    window: int = 5  # the headline: mean of the last `window` evaluations
    input_shape: tuple[int, ...] = (1, 28, 28)  # the dataset's inputs and classes: what the model is built for
    num_classes: int = 10
    left_out: tuple[tuple[str, str], ...] = ()  # (method, why): left out of this scale's default plan


#: FedMA's layer-wise matching costs ~20 CPU-seconds a round at the MNIST scale (FedAvg: ~0.6; docs/benchmark.md
#: "Cost"), ~10 CPU-hours for its 18 runs: more than the rest of the matrix.  It is run on request (--methods).
_FEDMA_COST = (("fedma", "its matching costs ~30x FedAvg's round at this scale (docs/benchmark.md, Cost); "
                         "run it with --methods fedma"),)
_SGD = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0, "batch_size": 32, "local_epochs": 2,
        "val_fraction": 0.1}
_IMAGE_REGIMES = ("iid", "dir0.5", "dir0.1", "shards2", "clusters", "rotated")

#: The scales of ``--scale``; ``quick`` is ``--quick`` (3 methods × 2 regimes × 2 seeds on the bundled digits).
#: CIFAR-10's and FEMNIST's shared learning rates are FedAvg's best validation accuracy over 0.02/0.05/0.1/0.2
#: (0.5 too for FEMNIST) at 40 rounds (``benchmarks/scale_lr.py``); MNIST's 0.05 was set before that rule.
SCALES: dict[str, Scale] = {
    "mnist": Scale("mnist", "mlp", _IMAGE_REGIMES, 50, 10, 100, 5, _SGD,
                   {"train_limit": 10000, "test_limit": 2000}, left_out=_FEDMA_COST),
    "cifar10": Scale("cifar10", "cnn-cifar", ("dir0.5", "dir0.1"), 50, 10, 100, 5, {**_SGD, "lr": 0.05},
                     {"train_limit": 10000, "test_limit": 2000}, input_shape=(3, 32, 32),
                     left_out=_FEDMA_COST),
    "femnist": Scale("femnist", "cnn-femnist", ("natural",), 105, 10, 100, 5, {**_SGD, "lr": 0.2}, {},
                     num_classes=62, left_out=_FEDMA_COST),
    "quick": Scale("digits", "mlp", ("iid", "dir0.1"), 10, 5, 4, 2, {**_SGD, "local_epochs": 1}, {},
                   methods=("fedavg", "scaffold", "local"), seeds=2, window=2, input_shape=(1, 8, 8)),
}


def plan_methods(wanted: Sequence[str] = (), track: str = "single") -> tuple[list[str], list[str]]:
    """(the methods of ``track`` to run, the names left out because no algorithm is registered under them);
    ``wanted`` narrows the track (an unknown name raises :class:`SystemExit`)."""
    from fedfuse.algorithms import ALGORITHMS

    names = SINGLE if track == "single" else WIDTH
    unknown = [w for w in wanted if w not in (*SINGLE, *WIDTH)]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {', '.join((*SINGLE, *WIDTH))}")
    chosen = [n for n in names if not wanted or n in wanted]
    return [n for n in chosen if n in ALGORITHMS], [n for n in chosen if n not in ALGORITHMS]


def unfit_methods(scale: Scale, methods: Sequence[str]) -> dict[str, str]:
    """method -> why the scale's model cannot run it: what the algorithm declares it needs of a model
    (``requires``, e.g. FedBN's BatchNorm layers) that the scale's model lacks.  Such a method is left out of the
    scale's matrix with that reason rather than run on a model where its rule does nothing."""
    from fedfuse.algorithms import ALGORITHMS
    from fedfuse.engine.personal import REQUIREMENTS, unmet_requirements
    from fedfuse.models.registry import build_model

    model = build_model(scale.model, scale.input_shape, scale.num_classes)
    out = {}
    for m in methods:
        unmet = unmet_requirements(model, getattr(ALGORITHMS[m], "requires", ()) or ())
        if unmet:
            out[m] = f"it needs a model with {' and '.join(REQUIREMENTS[n] for n in unmet)}; {scale.model} has none"
    return out


def cell_config(scale: Scale, regime: str, method: str, data_dir: str, threads: int = 1) -> dict[str, Any]:
    """The ``RunConfig`` dict of one cell (without its seed): the scale's shared settings, the regime's split and
    the method with its default options."""
    partition, p_opts, d_opts, _ = REGIMES[regime]
    return {**copy.deepcopy(scale.training), "dataset": scale.dataset, "model": scale.model,
            "dataset_options": {**scale.dataset_options, **d_opts}, "partition": partition,
            "partition_options": dict(p_opts), "clients": scale.clients, "clients_per_round": scale.per_round,
            "rounds": scale.rounds, "eval_every": scale.eval_every, "checkpoint_every": scale.rounds,
            "data_dir": data_dir, "threads": threads, "plots": False, "algorithm": method, "algorithm_options": {}}


def table_id(scale: Scale, regime: str, track: str) -> str:
    """``mnist-dir0.1`` (single track) or ``mnist-dir0.1-width``."""
    return f"{scale.dataset}-{regime}" + ("-width" if track == "width" else "")


def _names(text: str) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def resolve(args: Any) -> tuple[Scale, list[str]]:
    """The scale of ``--quick``/``--scale`` (its shared local rate replaced by ``--lr``) and its regimes narrowed
    by ``--regimes``."""
    scale = SCALES["quick" if getattr(args, "quick", False) else getattr(args, "scale", "mnist")]
    lr = getattr(args, "lr", None)
    if lr is not None:
        if not float(lr) > 0:
            raise SystemExit(f"--lr: must be positive, got {lr}")
        scale = dataclasses.replace(scale, training={**scale.training, "lr": float(lr)})
    regimes = _names(getattr(args, "regimes", ""))
    bad = [r for r in regimes if r not in scale.regimes]
    if bad:
        raise SystemExit(f"--regimes: {bad} not in scale {scale.dataset!r}; choose from {', '.join(scale.regimes)}")
    return scale, regimes or list(scale.regimes)


def tables(args: Any) -> list[Table]:
    """One table per (regime, track), the track's baseline first; rows are methods, every row the regime's
    shared config; a track without a chosen registered method has no tables."""
    scale, regimes = resolve(args)
    wanted = _names(getattr(args, "methods", "")) or list(scale.methods)
    where, threads = data_root(args), int(getattr(args, "threads", 1) or 1)
    out = []
    for track in ("single", "width"):
        methods, missing = plan_methods(wanted, track)
        if missing:
            print(f"fedfuse bench: not registered, left out: {', '.join(missing)}")
        unfit = unfit_methods(scale, methods)
        if not wanted:  # the scale's own exclusions apply to the default plan; --methods names them explicitly
            unfit.update({m: why for m, why in scale.left_out if m in methods})
        for m, why in unfit.items():
            print(f"fedfuse bench: {m} left out of the {scale.dataset} matrix: {why}")
        methods = [m for m in methods if m not in unfit]
        if not methods:
            continue
        methods = sorted(methods, key=lambda m: m != baseline(track))
        for regime in regimes:
            base = cell_config(scale, regime, BASELINE, where, threads)
            base = {k: v for k, v in base.items() if k not in ("algorithm", "algorithm_options")}
            rows = {m: {"algorithm": m, "algorithm_options": {}} for m in methods}
            title = (f"{scale.dataset} {regime} ({REGIMES[regime][3]}), {track} track: {scale.model}, "
                     f"{scale.clients} clients ({scale.per_round} per round), {scale.rounds} rounds, local lr "
                     f"{scale.training['lr']:g}; headline = "
                     f"mean of the last {scale.window} evaluations")
            out.append(Table(table_id(scale, regime, track), title, base, rows, last=scale.window))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``fedfuse bench``'s own flags (``--quick``, ``--seeds``, ``--out``, ``--data-dir`` are the CLI's)."""
    p.add_argument("--scale", choices=[s for s in SCALES if s != "quick"], default="mnist",
                   help="dataset and budget of the matrix (docs/benchmark.md states each)")
    p.add_argument("--regimes", default="", help="comma list among " + ", ".join(REGIMES) + " (default: the scale's)")
    p.add_argument("--methods", default="",
                   help="comma list (default: every registered method of both tracks): " + ", ".join((*SINGLE, *WIDTH)))
    p.add_argument("--lr", type=float, default=None,
                   help="every method's local learning rate instead of the scale's shared one (its runs are cached "
                        "apart: another config); record them into another table")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per run")
    p.add_argument("--jobs", type=int, default=1, help="run up to N runs at once (metrics identical to serial)")


FAMILY = Family("the benchmark matrix: methods × heterogeneity regimes × seeds (docs/benchmark.md)", tables,
                add_arguments, docs="benchmark", seeds="3", quick_seeds="2", diverged_ok=True)


def planned(scale: Scale, track: str) -> list[str]:
    """The methods of ``track`` a scale's default plan runs: the track's names without the scale's exclusions and
    the methods its model cannot serve (:func:`unfit_methods`)."""
    names = [m for m in (SINGLE if track == "single" else WIDTH) if m not in dict(scale.left_out)]
    from fedfuse.algorithms import ALGORITHMS

    unfit = unfit_methods(scale, [m for m in names if m in ALGORITHMS])
    return [m for m in names if m not in unfit]


def spec(scale_name: str, track: str = "single", target: float = 0.9) -> dict[str, Any]:
    """The benchmark table spec of a scale and track (``results/tables/bench-<dataset>[-width].json`` holds
    it; :mod:`fedfuse.bench_report` renders it)."""
    scale = SCALES[scale_name]
    sid = f"bench-{scale.dataset}" + ("-width" if track == "width" else "")
    return {"id": sid, "kind": "benchmark", "track": track, "window": scale.window, "baseline": baseline(track),
            "target": target, "regimes": list(scale.regimes), "methods": planned(scale, track),
            "regime_text": {g: REGIMES[g][3] for g in scale.regimes}, "figures": f"docs/img/{sid}",
            "command": ("--quick" if scale_name == "quick" else f"--scale {scale_name}")
            + f" --record bench-{scale.dataset}", "records": [f"bench-{scale.dataset}"]}
