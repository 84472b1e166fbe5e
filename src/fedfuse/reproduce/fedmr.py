"""FedMR (Hu et al.) Table 1 under the authors' own training settings, at four scales.

Every run uses the FedMR authors' optimiser and client loop (``HMHelloWorld/FedMR``: ``utils/options.py``,
``Training_*.py``): SGD lr 0.01, **momentum 0.5** (the code's default; the paper's text says 0.9, see
below), no weight decay, a fresh optimiser every round, batch 50, 5 local epochs, 10 % participation, no
validation hold-out (``val_fraction 0``: clients train on all their data, as in the code), global test
accuracy every 10 rounds.  Data: CIFAR-10 with Dirichlet(0.1), Dirichlet(0.5) and IID splits and the
``cnn-cifar`` CNN; LEAF FEMNIST with its natural writer partition, the authors' FEMNIST CNN
(``cnn-femnist``) and their ``(0.5 − x)/0.5`` pixel scaling.  Baselines follow the FedMR authors'
benchmark code: FedProx μ = 0.01 (CIFAR-10) / 0.1 (FEMNIST) as the paper's text says, FedExP with data
weights and ε = 0.1 per client, FedASAM ρ = 0.1, η = 0, FedMut α = 4 with its radius decaying over 50 rounds
(FedMut's own code).  Two-stage FedMR switches from FedAvg to recombination at a fixed round (paper: 100
rounds for ResNet-20/VGG-16); FedMR-p recombines p = 2 contiguous segments (§5.4.2).

Scales (``PRESETS``, printed to ``preset.yaml`` and into every run's ``config.yaml``):

* ``paper`` (``--scale paper``, for a GPU): 100 CIFAR-10 clients on all 50,000 images, the 105 FEMNIST
  writers staged here (paper: 180), 500 rounds (the code's ``--epochs`` default), switch round 100.
* ``cpu`` (default): the same recipe on a CIFAR-10 subset sized for a 2-core CPU — 50 clients on a
  stratified 10,000-image subset (200 images each, 10 sampled per round), a 2,000-image test subset,
  FEMNIST unchanged; fewer rounds and the switch round scaled with them.  ``--settings mnist-dir0.1`` /
  ``mnist-dir0.5`` run the CIFAR-10 settings unchanged on MNIST with fedfuse's ``mlp`` (200-200), to check
  that the preset is not tuned to one dataset (not run by default).
* ``full`` (``--scale full``): the smallest federation measured to show FedMR's effect on the CNN, sized for a
  2-core CPU — CIFAR-10 Dir(0.1), 50 clients on a stratified 25,000-image subset (500 images each, the paper's
  data per client; 10 sampled per round), the full 10,000-image test set, 300 rounds, switch round 60, FedAvg
  and FedMR by default (``--methods`` adds others), 3 seeds.  Six runs of ≈ 22 CPU-minutes: ≈ 66 minutes with
  ``--jobs 2``.  ``--settings mnist-dir0.1`` etc. run the same federation on MNIST with ``mlp``.
* ``quick`` (``--quick``, ≤ 3 CPU-minutes): FEMNIST with 5 writers per round, 10 rounds, evaluated every 2
  rounds, one seed — a smoke test that every method learns.  ``--quick --settings cifar10-dir0.5`` runs a small
  CIFAR-10 Dir(0.5) federation (20 clients on 3,000 images, 5 per round) instead; after 20 rounds at the
  authors' learning rate the FedMR variants there are still near chance.

Accuracy is reported as the mean of the last 5 evaluations (``fedfuse.stats.final_mean``), mean ± std over
seeds, with a paired t-test of every method against FedAvg over the seeds both finished. ``--momentum 0.9``
re-runs a grid with the paper text's momentum (a documented paper-vs-code discrepancy). Runs live in
``<out>/runs/`` named by their config hash; with ``--reuse`` finished runs are kept and interrupted ones resume;
``--jobs N`` runs N at once (``fedfuse.sweep.Sweep.execute``, metrics identical to a serial run).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import yaml

from fedfuse.reproduce.common import data_root
from fedfuse.reproduce.preset import Family, Table
from fedfuse.result_table import ResultTable

#: The authors' local training (FedMR code ``utils/options.py`` defaults and ``LocalUpdate_*``).
AUTHORS_TRAINING: dict[str, Any] = dict(
    optimizer="sgd", lr=0.01, momentum=0.5, weight_decay=0.0, grad_clip=0.0, batch_size=50, local_epochs=5,
    val_fraction=0.0, eval_every=10,
)

#: Table 1's methods: label -> (algorithm, options).  ``{warmup}`` and ``{mu}`` are filled per preset/setting.
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "FedAvg": ("fedavg", {}),
    "FedProx": ("fedprox", {"mu": "{mu}"}),
    "FedMut": ("fedmut", {"alpha": 4.0, "r0": 0.3, "bound": 50}),
    "FedExP": ("fedexp", {"weighting": "samples", "eps": 0.1, "eps_decay": 1.0}),
    "FedASAM": ("fedasam", {"rho": 0.1, "eta": 0.0}),
    "FedMR": ("fedmr", {}),
    "FedMR two-stage": ("fedmr", {"warmup_rounds": "{warmup}"}),
    "FedMR-p (p=2)": ("fedmr", {"segments": 2}),
    "FedGen": ("fedgen", {}),  # server generator settings of the FedGen code (the paper says it reused them)
    "CluSamp": ("clusamp", {}),  # clustered sampling by gradient similarity (Fraboni et al. Alg. 2)
}

_CIFAR_SPLITS = {
    "cifar10-dir0.1": {"partition": "dirichlet", "partition_options": {"alpha": 0.1}},
    "cifar10-dir0.5": {"partition": "dirichlet", "partition_options": {"alpha": 0.5}},
    "cifar10-iid": {"partition": "iid", "partition_options": {}},
}
_FEMNIST = {"dataset": "femnist", "partition": "natural", "model": "cnn-femnist",
            "dataset_options": {"normalize": "authors"}, "partition_options": {}}
PROX_MU = {"cifar10": 0.01, "femnist": 0.1}  # paper §5.1: best μ per dataset


def _cifar(clients: int, per_round: int, limits: dict[str, int]) -> dict[str, dict[str, Any]]:
    base = {"dataset": "cifar10", "model": "cnn-cifar", "clients": clients, "clients_per_round": per_round,
            "dataset_options": dict(limits)}
    return {name: {**base, **split} for name, split in _CIFAR_SPLITS.items()}


def _mnist(clients: int, per_round: int, limits: dict[str, int]) -> dict[str, dict[str, Any]]:
    """MNIST with the CIFAR-10 settings' federation and splits (Dir(0.1), Dir(0.5)) and fedfuse's ``mlp``
    (200-200): a second 10-class image set to check that the preset is not tuned to CIFAR-10."""
    base = {"dataset": "mnist", "model": "mlp", "clients": clients, "clients_per_round": per_round,
            "dataset_options": dict(limits)}
    return {"mnist-" + name.split("-", 1)[1]: {**base, **split}
            for name, split in _CIFAR_SPLITS.items() if name != "cifar10-iid"}


#: One place for every reproduction scale: training recipe, horizon, switch round and data settings.
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "training": AUTHORS_TRAINING, "rounds": 500, "warmup": 100, "seeds": 3,
        "settings": {**_cifar(100, 10, {}), "femnist": {**_FEMNIST, "clients": 105, "clients_per_round": 10}},
    },
    "cpu": {
        "training": AUTHORS_TRAINING, "rounds": 120, "warmup": 24, "seeds": 3,
        "settings": {**_cifar(50, 10, {"train_limit": 10000, "test_limit": 2000}),
                     "femnist": {**_FEMNIST, "clients": 105, "clients_per_round": 10},
                     **_mnist(50, 10, {"train_limit": 10000, "test_limit": 2000})},
        "default_settings": [*_CIFAR_SPLITS, "femnist"],  # the MNIST check runs only with --settings
    },
    "full": {  # the effect within 90 minutes on 2 cores (--jobs 2): the paper's 500 images per client, half the
        # clients, 300 rounds; FedAvg and FedMR unless --methods names more
        "training": AUTHORS_TRAINING, "rounds": 300, "warmup": 60, "seeds": 3,
        "settings": {**_cifar(50, 10, {"train_limit": 25000}), **_mnist(50, 10, {"train_limit": 25000})},
        "default_settings": ["cifar10-dir0.1"], "default_methods": ["FedAvg", "FedMR"],
    },
    "quick": {  # a smoke test of the whole FEMNIST row in <= 3 CPU-minutes: 10 rounds (20 took 336 CPU-s)
        "training": {**AUTHORS_TRAINING, "eval_every": 5}, "rounds": 10, "warmup": 3, "seeds": 1,
        "settings": {"femnist": {**_FEMNIST, "clients": 105, "clients_per_round": 5, "eval_every": 2},
                     "cifar10-dir0.5": _cifar(20, 5, {"train_limit": 3000, "test_limit": 1000})["cifar10-dir0.5"]},
        "default_settings": ["femnist"],
    },
}

PAPER_DIRECTION = (
    "FedMR has the best accuracy on every row of the paper's Table 1 (CNN, ResNet-20, VGG-16; CIFAR-10, "
    "CIFAR-100, FEMNIST), e.g. ResNet-20 on CIFAR-10 Dir(0.1): FedMR 58.40 % vs FedMut 50.75 % (second); "
    "on FEMNIST its margin is small"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", choices=("cpu", "full", "paper"), default="cpu",
                   help="cpu: the whole grid on small federations (default); full: CIFAR-10 Dir(0.1) at the paper's "
                        "data per client, FedAvg vs FedMR, ≈ 66 min on 2 cores with --jobs 2; paper: the paper's "
                        "federation sizes (GPU)")
    p.add_argument("--settings", default="", help="comma list among " + ",".join(PRESETS["cpu"]["settings"]))
    p.add_argument("--methods", default="", help="comma list of method labels (default: all): " + ",".join(METHODS))
    p.add_argument("--rounds", type=int, default=0, help="override the preset's number of rounds")
    p.add_argument("--warmup", type=int, default=-1, help="override the two-stage switch round")
    p.add_argument("--momentum", type=float, default=None,
                   help="override SGD momentum (preset: 0.5 as the authors' code; the paper's text says 0.9)")
    p.add_argument("--local-epochs", type=int, default=0, help="override the preset's 5 local epochs")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest for these CNNs)")
    p.add_argument("--jobs", type=int, default=1,
                   help="run up to N runs at once (N - 1 worker processes beside this one, each with --threads "
                        "torch threads; metrics identical to a serial run)")


def _overrides(preset: dict[str, Any], args: argparse.Namespace) -> None:
    """Apply ``--momentum``, ``--local-epochs``, ``--rounds`` and ``--warmup`` to ``preset`` in place."""
    training = preset["training"]
    if getattr(args, "momentum", None) is not None:
        training["momentum"] = float(args.momentum)
    if getattr(args, "local_epochs", 0):
        training["local_epochs"] = int(args.local_epochs)
    if getattr(args, "rounds", 0):
        preset["rounds"] = int(args.rounds)
    if getattr(args, "warmup", -1) >= 0:
        preset["warmup"] = int(args.warmup)


def _select(names: str, known: dict[str, Any] | list[str], what: str, preset: str = "") -> list[str]:
    """The names of a comma list, each checked against ``known``."""
    wanted = [x for x in (names or "").split(",") if x]
    unknown = [x for x in wanted if x not in known]
    if unknown:
        where = f" for preset {preset!r}" if preset else ""
        raise ValueError(f"unknown {what}(s) {unknown}{where}; choose from {list(known)}")
    return wanted


def resolve_preset(args: argparse.Namespace) -> dict[str, Any]:
    """The preset of ``--quick`` / ``--scale`` with the command-line overrides applied."""
    name = "quick" if getattr(args, "quick", False) else getattr(args, "scale", "cpu")
    preset = copy.deepcopy(PRESETS[name])
    preset["name"] = name
    _overrides(preset, args)
    wanted = _select(getattr(args, "settings", ""), preset["settings"], "setting", name)
    wanted = wanted or preset.get("default_settings", list(preset["settings"]))
    preset["settings"] = {k: v for k, v in preset["settings"].items() if k in wanted}
    labels = _select(getattr(args, "methods", ""), METHODS, "method")
    # FedGen and CluSamp (Table 1's other baselines) run in the full presets; --quick keeps to the core methods
    preset["methods"] = labels or preset.get("default_methods") or [
        m for m in METHODS if name != "quick" or m not in ("FedGen", "CluSamp")]
    return preset


def method_options(label: str, preset: dict[str, Any], dataset: str) -> tuple[str, dict[str, Any]]:
    """(algorithm, options) of a Table 1 method with the preset's switch round and the dataset's FedProx μ."""
    algo, opts = METHODS[label]
    fill = {"{warmup}": int(preset["warmup"]), "{mu}": PROX_MU.get(dataset, 0.01)}
    return algo, {k: fill.get(v, v) if isinstance(v, str) else v for k, v in opts.items()}


def run_config(label: str, setting: str, seed: int, preset: dict[str, Any], data_dir: str) -> dict[str, Any]:
    """The full ``RunConfig`` dict of one run (what lands in its ``config.yaml``)."""
    data = preset["settings"][setting]
    algo, opts = method_options(label, preset, data["dataset"])
    return {**preset["training"], **copy.deepcopy(data), "algorithm": algo, "algorithm_options": opts,
            "rounds": preset["rounds"], "checkpoint_every": preset["rounds"], "seed": int(seed),
            "data_dir": data_dir, "plots": False}


def tables(args: argparse.Namespace) -> list[Table]:
    """One table per data setting, FedAvg (the baseline of the paired tests) first."""
    preset = resolve_preset(args)
    where = data_root(args)
    labels = sorted(preset["methods"], key=lambda m: m != BASELINE)
    out = []
    for setting in preset["settings"]:
        rows = {label: run_config(label, setting, 0, preset, where) for label in labels}
        base = {k: v for k, v in rows[labels[0]].items() if k not in ("algorithm", "algorithm_options", "seed")}
        base["threads"] = getattr(args, "threads", 1)
        rows = {k: {"algorithm": v["algorithm"], "algorithm_options": v["algorithm_options"]} for k, v in rows.items()}
        tr = preset["training"]
        title = (f"{setting} (preset `{preset['name']}`): global test accuracy, mean of the last 5 evaluations; "
                 f"{preset['rounds']} rounds, {tr['local_epochs']} local epochs, batch {tr['batch_size']}, SGD lr "
                 f"{tr['lr']} momentum {tr['momentum']}, two-stage switch round {preset['warmup']}")
        out.append(Table(setting, title, base, rows, last=5))
    return out


#: The baseline every method is compared with (paired over seeds).
BASELINE = "FedAvg"


def extra(args: argparse.Namespace, out: Path, done: dict[str, ResultTable]) -> str:
    """The resolved preset (``preset.yaml``) and the paper's direction under the tables."""
    preset = resolve_preset(args)
    from fedfuse.reproduce.common import seeds

    (out / "preset.yaml").write_text(yaml.safe_dump({**preset, "seeds": seeds(args)}, sort_keys=False))
    return f"Paper direction: {PAPER_DIRECTION}."


FAMILY = Family(
    "FedMR Table 1 with the authors' settings: CIFAR-10 Dir(0.1)/Dir(0.5)/IID + FEMNIST, FedMR, two-stage, FedMR-p "
    "vs FedAvg, FedProx, FedMut, FedExP, FedASAM (--scale cpu|full|paper, --quick)",
    tables, add_arguments, extra, seeds="3", quick_seeds="1")
