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
* ``quick`` (``--quick``, ≤ 5 min): FEMNIST with 5 writers per round, 20 rounds, evaluated every 2 rounds,
  one seed — a smoke test that every method learns.  ``--quick --settings cifar10-dir0.5`` runs a small
  CIFAR-10 Dir(0.5) federation (20 clients on 3,000 images, 5 per round) instead; after 20 rounds at the
  authors' learning rate the FedMR variants there are still near chance.

Accuracy is reported as the mean of the last 5 evaluations (``fedfuse.stats.final_mean``), mean ± std over
seeds, with a paired t-test of every method against FedAvg over the seeds both finished. ``--momentum 0.9``
re-runs a grid with the paper text's momentum (a documented paper-vs-code discrepancy). With ``--reuse``,
finished runs (``<out>/<setting>/<method>/seed<k>/summary.json``) are kept, so an interrupted grid resumes; a
run another live process is working on is skipped, so several processes may fill one ``--out`` with different
``--methods``. Tables are built from every finished run of the preset under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from fedfuse.reproduce.common import run_one
from fedfuse.stats import best_value, final_mean, mean_std, paired_test, parse_seeds
from fedfuse.tables import markdown

DESCRIPTION = ("FedMR Table 1 with the authors' settings: CIFAR-10 Dir(0.1)/Dir(0.5)/IID + FEMNIST, FedMR, "
               "two-stage, FedMR-p vs FedAvg, FedProx, FedMut, FedExP, FedASAM (--scale cpu|full|paper, --quick)")

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
    "quick": {
        "training": {**AUTHORS_TRAINING, "eval_every": 5}, "rounds": 20, "warmup": 5, "seeds": 1,
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
    p.set_defaults(seeds="")  # empty = the preset's number of seeds (3; quick: 1)


def resolve_preset(args: argparse.Namespace) -> dict[str, Any]:
    """The preset of ``--quick`` / ``--scale`` with the command-line overrides applied."""
    name = "quick" if getattr(args, "quick", False) else getattr(args, "scale", "cpu")
    preset = copy.deepcopy(PRESETS[name])
    preset["name"] = name
    training = preset["training"]
    if getattr(args, "momentum", None) is not None:
        training["momentum"] = float(args.momentum)
    if getattr(args, "local_epochs", 0):
        training["local_epochs"] = int(args.local_epochs)
    if getattr(args, "rounds", 0):
        preset["rounds"] = int(args.rounds)
    if getattr(args, "warmup", -1) >= 0:
        preset["warmup"] = int(args.warmup)
    wanted = [s for s in (getattr(args, "settings", "") or "").split(",") if s]
    unknown = [s for s in wanted if s not in preset["settings"]]
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown} for preset {name!r}; choose from {list(preset['settings'])}")
    wanted = wanted or preset.get("default_settings", [])
    if wanted:
        preset["settings"] = {k: v for k, v in preset["settings"].items() if k in wanted}
    labels = [m for m in (getattr(args, "methods", "") or "").split(",") if m]
    bad = [m for m in labels if m not in METHODS]
    if bad:
        raise ValueError(f"unknown method(s) {bad}; choose from {list(METHODS)}")
    # FedGen and CluSamp (Table 1's other baselines) run in the full presets; --quick keeps to the core methods
    preset["methods"] = labels or preset.get("default_methods") or [
        m for m in METHODS if name != "quick" or m not in ("FedGen", "CluSamp")]
    preset["seed_list"] = parse_seeds(getattr(args, "seeds", "") or preset["seeds"])
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


def _slug(label: str) -> str:
    return label.lower().replace(" ", "-").replace("(", "").replace(")", "").replace("=", "")


def run(args: argparse.Namespace) -> int:
    threads = max(1, int(getattr(args, "threads", 1) or 1))
    torch.set_num_threads(threads)
    data_dir = getattr(args, "data_dir", None) or os.environ.get("FEDFUSE_DATA") or "../shared/data"
    preset = resolve_preset(args)
    jobs = int(getattr(args, "jobs", 1) or 1)
    if jobs < 1:
        raise ValueError(f"--jobs: must be >= 1, got {jobs}")
    default_out = "runs/reproduce-fedmr-" + preset["name"]
    if preset["training"]["momentum"] != AUTHORS_TRAINING["momentum"]:
        default_out += f"-momentum{preset['training']['momentum']:g}"
    out = Path(getattr(args, "out", None) or default_out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "preset.yaml").write_text(yaml.safe_dump(
        {k: v for k, v in preset.items() if k != "seed_list"} | {"seeds": preset["seed_list"]}, sort_keys=False))
    reuse, progress = bool(getattr(args, "reuse", False)), not getattr(args, "no_progress", False)
    t_all, started = time.perf_counter(), time.time()
    workers = []
    if jobs > 1:  # siblings take runs through the claim files; none runs a run another has finished meanwhile
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        workers = [ctx.Process(target=_grid_worker, args=(preset, out, data_dir, reuse, started, threads))
                   for _ in range(jobs - 1)]
        for w in workers:
            w.start()
    try:
        run_grid(preset, out, data_dir, reuse=reuse, started=started, progress=progress and not workers,
                 on_done=lambda: write_tables(out, preset, time.perf_counter() - t_all, plots=False))
    finally:
        for w in workers:
            w.join()
    if any(w.exitcode for w in workers):
        raise RuntimeError(f"{sum(1 for w in workers if w.exitcode)} of {len(workers)} worker processes failed "
                           "(their runs are missing from the table; rerun with --reuse)")
    text = write_tables(out, preset, time.perf_counter() - t_all)
    print(text)
    return 0


def run_grid(preset: dict[str, Any], out: Path, data_dir: str, *, reuse: bool, started: float, progress: bool,
             on_done: Any = None) -> None:
    """Run every (setting, method, seed) of ``preset`` under ``out`` that no other process holds (claim files)
    and that is not finished: with ``reuse`` a finished run is kept; a run finished at or after ``started``
    (by a sibling process of this invocation) is always kept."""
    for setting in preset["settings"]:
        for label in preset["methods"]:
            for seed in preset["seed_list"]:
                run_dir = out / setting / _slug(label) / f"seed{seed}"
                if _finished(run_dir, None if reuse else started):
                    continue
                if not _claim(run_dir):
                    print(f"[fedmr] {setting} {label} seed {seed}: running in another process, skipped", flush=True)
                    continue
                if _finished(run_dir, None if reuse else started):
                    _marker(run_dir).unlink(missing_ok=True)  # finished by another process meanwhile
                    continue
                t0 = time.perf_counter()
                try:
                    _, history = run_one(run_config(label, setting, seed, preset, data_dir), run_dir,
                                         progress=progress)
                finally:
                    _marker(run_dir).unlink(missing_ok=True)
                acc = final_mean(history)
                print(f"[fedmr] {setting:15s} {label:16s} seed {seed}: last-5 mean "
                      f"{100 * acc if acc is not None else float('nan'):.2f} % ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
                if on_done is not None:
                    on_done()


def _grid_worker(preset: dict[str, Any], out: Path, data_dir: str, reuse: bool, started: float,
                 threads: int) -> None:
    """A ``--jobs`` sibling: the same grid, no progress bars, no tables (the parent writes them)."""
    torch.set_num_threads(threads)
    run_grid(preset, out, data_dir, reuse=reuse, started=started, progress=False)


def _finished(run_dir: Path, since: float | None) -> bool:
    """Finished (summary and metrics written), and with ``since`` at or after that time."""
    summary = run_dir / "summary.json"
    if not (summary.exists() and (run_dir / "metrics.jsonl").exists()):
        return False
    return since is None or summary.stat().st_mtime >= since


def _marker(run_dir: Path) -> Path:
    """The claim file of ``run_dir``: a sibling (``.seed0.running``), because a fresh start of a run deletes its
    directory (``sweep._run_job``) — a marker inside it vanished at once and another process ran the same run."""
    return run_dir.with_name(f".{run_dir.name}.running")


def _claim(run_dir: Path) -> bool:
    """Mark ``run_dir`` as run by this process, atomically (``O_EXCL``): ``False`` when a live other process
    holds it.  A claim left by a process that is gone is replaced."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    marker = _marker(run_dir)
    for _ in range(3):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _claimed_by_other(run_dir):
                return False
            marker.unlink(missing_ok=True)  # stale (its process is gone) or our own leftover
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def _claimed_by_other(run_dir: Path) -> bool:
    """True when another live process of this machine is running ``run_dir`` (its claim file holds a pid)."""
    try:
        pid = int(_marker(run_dir).read_text().strip())
    except (OSError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _load_history(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def collect(out: Path, preset: dict[str, Any]) -> dict[str, dict[str, dict[int, list[dict[str, Any]]]]]:
    """{setting: {method: {seed: history}}} of every finished run of ``preset`` under ``out``."""
    found: dict[str, dict[str, dict[int, list[dict[str, Any]]]]] = {}
    for setting in preset["settings"]:
        for label in METHODS:
            for seed in preset["seed_list"]:
                d = out / setting / _slug(label) / f"seed{seed}"
                if (d / "summary.json").exists() and (d / "metrics.jsonl").exists():
                    found.setdefault(setting, {}).setdefault(label, {})[seed] = _load_history(d)
    return found


def write_tables(out: Path, preset: dict[str, Any], wall: float, plots: bool = True) -> str:
    """Write ``results.json``, ``table.md`` and (``plots``) one curve plot per setting from the finished runs."""
    found = collect(out, preset)
    tr = preset["training"]
    header = (
        f"Global test accuracy (%), mean of the last 5 evaluations, mean ± std over seeds "
        f"{preset['seed_list']} (preset `{preset['name']}`): {preset['rounds']} rounds, {tr['local_epochs']} local "
        f"epochs, batch {tr['batch_size']}, SGD lr {tr['lr']} momentum {tr['momentum']}, fresh optimiser per "
        f"round, val_fraction {tr['val_fraction']}, two-stage switch round {preset['warmup']}. "
        f"Wall time of this invocation {wall / 60:.1f} min."
    )
    rows, results, curves, paired = [], [], {}, []
    for setting, per in found.items():
        row: dict[str, Any] = {"setting": setting}
        curves[setting] = {}
        for label in METHODS:
            hists = per.get(label)
            if not hists:
                continue
            finals = [final_mean(h) for h in hists.values()]
            ms = mean_std(finals)
            row[label] = ms.fmt(scale=100) + ("" if ms.n == len(preset["seed_list"]) else f" (n={ms.n})")
            results.append({"setting": setting, "method": label, "seeds": list(hists),
                            "last5_mean": finals, "best": [best_value(h) for h in hists.values()],
                            "mean": ms.mean, "std": ms.std})
            curves[setting][label] = _mean_curve(list(hists.values()))
        rows.append(row)
        paired += paired_vs_baseline(setting, per)
    (out / "results.json").write_text(json.dumps({"preset": {k: v for k, v in preset.items()}, "results": results,
                                                  "paired": paired, "curves": curves}, indent=1, default=str))
    text = [header, "", markdown(rows), ""]
    if paired:
        text += [f"Paired t-test against {BASELINE} over the seeds both ran (`fedfuse.stats.paired_test`; "
                 "difference in points of the last-5 mean; `*` p < 0.05, `(n.s.)` otherwise):", "",
                 markdown([{"setting": r["setting"], "method": r["method"], "seeds": r["n"],
                            f"− {BASELINE} (points)": f"{r['diff']:+.2f}",
                            "p (paired t)": "n/a (n < 2)" if r["p"] is None else f"{r['p']:.2g} {r['mark']}"}
                           for r in paired]), ""]
    text += [f"Paper direction: {PAPER_DIRECTION}.", ""]
    for setting, per in curves.items():
        if not per:
            continue
        axis = sorted({r for pts in per.values() for r, _ in pts})
        step = max(1, len(axis) // 10)
        shown = axis[step - 1::step] if len(axis) > 10 else axis
        crow = [{"method": m, **{f"r{r}": round(100 * dict(pts).get(r, float("nan")), 1) for r in shown}}
                for m, pts in per.items()]
        text += [f"**{setting}**: global accuracy (%) per evaluation round, mean over seeds "
                 f"(plot: `curves-{setting}.png`)", "", markdown(crow), ""]
        if plots:
            _plot(out / f"curves-{setting}.png", f"{setting} ({preset['name']}, momentum {tr['momentum']})", per)
    (out / "table.md").write_text("\n".join(text))
    return "\n".join(text)


#: The baseline every method is compared with (paired over seeds) in ``table.md``.
BASELINE = "FedAvg"


def paired_vs_baseline(setting: str, per: dict[str, dict[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Each method's last-5 mean vs :data:`BASELINE`'s on the seeds both finished: a paired t-test per method."""
    base = per.get(BASELINE)
    if not base:
        return []
    rows = []
    for label, hists in per.items():
        seeds = sorted(set(hists) & set(base))
        if label == BASELINE or not seeds:
            continue
        t = paired_test([final_mean(hists[s]) for s in seeds], [final_mean(base[s]) for s in seeds])
        rows.append({"setting": setting, "method": label, "seeds": seeds, "n": t.n, "diff": 100 * t.diff,
                     "p": None if t.p_value != t.p_value else t.p_value, "mark": t.mark()})
    return rows


def _mean_curve(histories: list[list[dict[str, Any]]]) -> list[tuple[int, float]]:
    by_round: dict[int, list[float]] = {}
    for h in histories:
        for rec in h:
            if rec.get("global_accuracy") is not None:
                by_round.setdefault(int(rec["round"]), []).append(float(rec["global_accuracy"]))
    return [(r, sum(v) / len(v)) for r, v in sorted(by_round.items())]


def _plot(path: Path, title: str, per: dict[str, list[tuple[int, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, pts in per.items():
        if pts:
            r, a = zip(*pts)
            ax.plot(r, [100 * x for x in a], marker="o", ms=2, label=m,
                    lw=2.0 if m.startswith("FedMR") else 1.2, ls="-" if m.startswith("FedMR") else "--")
    ax.set_xlabel("round")
    ax.set_ylabel("global test accuracy (%), mean over seeds")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
