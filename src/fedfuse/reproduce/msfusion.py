"""MSfusion (the MSfusion paper) vs HeteroFL and FedRolex over several seeds: MNIST (the defaults check), real CIFAR-10
images (μ sweep, IID, ablations, ring vs fully connected topology) and a transformer LM on Penn Treebank.

Settings follow App. A.2 where they fit the budget: 10 participants, all active every round, plain SGD with a
triangular CyclicLR over all rounds whose peak is the run's ``lr``.

* ``mnist`` — the defaults check: MNIST ``shards`` with the paper's non-IID split of a 10-class dataset (H = 5
  classes per participant; the partition's own default is 2), the MLP (200-200), every other run setting and
  algorithm option at its default (20 rounds, lr 0.1, 2 local epochs, batch 32), all 60,000 training images
  (quick: a stratified 6,000-image subset); μ ∈ {0.125, 0.25, 0.5} (quick: 0.125, 0.25).
* ``cifar`` — non-IID = 5 classes per participant.  Scaled down (the paper: ResNet-18 [64,128,256,512], 500 rounds,
  batch 10, lr 0.001-0.0012): ResNet-18 at ``width_mult`` 0.25 (channels [16,32,64,128], static BN), a stratified
  CIFAR-10 subset of 3,000 images, 8 rounds (quick: 3), 1 local epoch, batch 32, CyclicLR 0.05-0.1.
* ``ablation`` / ``ring`` — CIFAR-10 non-IID at μ = 0.25 (full preset only).
* ``ptb`` — transformer LM (d_model 32, 2 blocks) on the first 100 windows of 32 tokens per participant.

Every cell is the mean ± sample std over ``--seeds`` (default 3) of the final global full-model accuracy
(perplexity for PTB); "ordering" rows compare the methods on the same seeds (paired t-test).  Every method uses the
same model, data, schedule and rounds.  The presets run at paper scale on a GPU with ``--rounds`` and larger limits.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from fedfuse.config import RunConfig, apply, validate
from fedfuse.reproduce.common import federation_for, run_one
from fedfuse.runner import experiment
from fedfuse.stats import mean_std, paired_test, parse_seeds, stability
from fedfuse.tables import markdown
from fedfuse.types import ClientData, Federation, Split

DESCRIPTION = "MSfusion vs HeteroFL/FedRolex over seeds: MNIST defaults, CIFAR-10 (mu sweep, ablations, ring), PTB"

PAPER_CIFAR = {  # Table 1 (CIFAR-10, ResNet-18, 10 participants); MSfusion rows are at their own mu
    ("heterofl", "non-iid", 0.25): "37.36", ("heterofl", "iid", 0.25): "40.50",
    ("fedrolex", "non-iid", 0.25): "66.41", ("fedrolex", "iid", 0.25): "76.98",
    ("msfusion", "non-iid", 0.1): "71.21", ("msfusion", "iid", 0.1): "78.74",
    ("msfusion", "non-iid", 0.5): "81.91", ("msfusion", "iid", 0.5): "87.37",
}
PAPER_ABLATION = {"msfusion": "75.71", "w/o con": "73.16", "w/o dyn": "73.31", "w/o con & dyn": "70.17"}  # mu=18.75%
PAPER_PTB = {"heterofl": "55.97 (mu=75%)", "fedrolex": "61.52 (mu=75%)", "msfusion": "8.02 (mu=25%)"}
METHODS = ("msfusion", "fedrolex", "heterofl")
PAPER_CIFAR.update({("fedet", "non-iid", None): "81.13", ("fedet", "iid", None): "83.42"})
PAPER_RING = {"dpsgd": "13.38 (CIFAR-100)", "dispfl": "52.57 (CIFAR-100)"}  # Table 3: local accuracy, ring
# Fed-ET: heterogeneous small client CNNs sharing the server ResNet-18's 128-wide final layer (width_mult 0.25)
FEDET = {"small_models": [{"model": "cnn-cifar", "hidden": [120, 128]},
                          {"model": "cnn-cifar", "channels": [12, 32], "hidden": [120, 128]}]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", default="",
                   help="comma list of mnist, cifar, ablation, ring, ptb (default: all; quick: mnist,cifar,ptb)")
    p.add_argument("--mus", default="", help="comma list of split ratios for the mnist and cifar sweeps")
    p.add_argument("--methods", default="", help="comma list of msfusion, fedrolex, heterofl, fedet (default: all)")
    p.add_argument("--rounds", type=int, default=0, help="override the CIFAR rounds")
    p.add_argument("--ptb-rounds", type=int, default=0, help="override the PTB rounds (full: 3, quick: 2)")
    p.add_argument("--ablations", default="",
                   help="comma list of ablation rows besides msfusion itself (default: all): " +
                   ", ".join(label for label, _ in ABLATIONS))
    p.add_argument("--cifar-splits", default="", help="comma list of non-iid, iid (default: full both, quick non-iid)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on shared CPUs)")
    p.add_argument("--mnist-classes", type=int, default=MNIST_CLASSES,
                   help="classes per participant of the mnist part (the paper's H = 5; the shards default is 2)")
    p.add_argument("--mnist-rounds", type=int, default=20, help="rounds of the mnist part (the run default: 20)")
    p.add_argument("--mnist-eval-every", type=int, default=1,
                   help="evaluation interval of the mnist part (1: every round, for the 10-round stability means)")
    p.add_argument("--compare-assemblies", action="store_true",
                   help="msfusion: also score the other full-model assemblies (last, zero_stale) on the same "
                        "training runs (evaluation only; option compare_assemblies; mnist, cifar, ptb parts)")


def settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"rounds": 3, "train_limit": 3000, "test_limit": 1000, "eval_every": 3, "ptb_rounds": 2,
                "ptb_seqs": 40, "ptb_test": 200, "mus": [0.25], "iid": False, "mnist_mus": [0.125, 0.25]}
    return {"rounds": 8, "train_limit": 3000, "test_limit": 1000, "eval_every": 4, "ptb_rounds": 3,
            "ptb_seqs": 100, "ptb_test": 400, "mus": [0.125, 0.25, 0.5], "iid": True,
            "mnist_mus": [0.125, 0.25, 0.5]}


MNIST_CLASSES = 5  # the paper's non-IID split of a 10-class dataset: H = 5 classes per participant (CIFAR-10, §5)


def mnist_base(data_dir: str | None, quick: bool = False, classes: int = MNIST_CLASSES, rounds: int = 20,
               eval_every: int = 1) -> dict[str, Any]:
    """MNIST ``shards`` with ``classes`` per participant (the paper's H = 5), the MLP, 10 participants **all
    active every round for every method** (the paper's Table 1: "10 participants with 100% selected rate"),
    and every other run setting at its default; all 60,000 training and 10,000 test images (quick: a stratified
    6,000 / 2,000 subset)."""
    limits = {"train_limit": 6000, "test_limit": 2000} if quick else {}
    return {"dataset": "mnist", "data_dir": data_dir, "partition": "shards",
            "partition_options": {"classes_per_client": int(classes)}, "model": "mlp", "plots": False,
            "clients": 10, "clients_per_round": 10, "rounds": int(rounds),
            "checkpoint_every": 10_000, "eval_every": int(eval_every), "device": "cpu", "dataset_options": limits}



def cifar_base(s: dict[str, Any], data_dir: str | None, partition: str) -> dict[str, Any]:
    part = ({"partition": "shards", "partition_options": {"classes_per_client": 5}} if partition == "non-iid"
            else {"partition": "iid", "partition_options": {}})
    return {
        "dataset": "cifar10", "data_dir": data_dir, **part, "model": "resnet18",
        "model_options": {"width_mult": 0.25, "norm": "bn-static"}, "clients": 10, "clients_per_round": 10,
        "rounds": s["rounds"], "local_epochs": 1, "batch_size": 32, "lr": 0.1,
        "eval_every": s["eval_every"], "checkpoint_every": 1000, "plots": False, "device": "cpu",
        "dataset_options": {"train_limit": s["train_limit"], "test_limit": s["test_limit"]},
    }


LR = {"lr_schedule": "cyclic", "lr_min_ratio": 0.5}  # with the run's lr 0.1: CyclicLR 0.05 → 0.1


def algo_options(algo: str, mu: float, eval_every: int, rounds: int = 500, **extra: Any) -> dict[str, Any]:
    """The options of ``algo`` in the CIFAR presets: the algorithm's defaults plus the shared learning-rate
    schedule.  MSfusion keeps Eq. 6 on the paper's 500-round time scale (its default); compressing the schedule
    into a short run (``compressed_eq6``) moved the windows every round and cost accuracy (docs/msfusion.md)."""
    opts: dict[str, Any] = {"mu": mu, **LR, **extra}
    if algo == "heterofl":
        opts["stats_every"] = eval_every
    return opts


def truncated(fed: Federation, seqs: int, test: int) -> Federation:
    """The first ``seqs`` training windows of every participant (val/test: a quarter of that), and the first
    ``test`` windows of the global test stream: PTB scaled to the CPU budget."""

    def cut(sp: Split, n: int) -> Split:
        return Split(sp.x[:n], sp.y[:n])

    clients = [ClientData(c.cid, cut(c.train, seqs), cut(c.val, max(seqs // 4, 1)), cut(c.test, max(seqs // 4, 1)),
                          c.group) for c in fed.clients]
    return Federation(clients, cut(fed.test, test), fed.num_classes, fed.input_shape, fed.task, fed.dataset,
                      fed.partition, fed.class_names, {**fed.info, "truncated": f"{seqs} train windows/client"})


def cell_row(label: str, runs: list[tuple[dict, list[dict]]], seeds: list[int], wall: float, metric: str,
             **cols: Any) -> dict[str, Any]:
    """Mean ± std over seeds of the final ``metric`` plus the cost columns (means over seeds)."""
    vals = [r[0]["final"].get(metric) for r in runs]
    scale = 100.0 if metric.endswith("accuracy") else 1.0
    name = ("local acc %" if metric == "personal_accuracy" else "global acc %") if metric.endswith("accuracy") \
        else "perplexity"
    n = runs[0][0]["clients"]
    rounds = max(runs[0][0]["rounds_completed"], 1)
    hist = runs[0][1]
    trained = [h for h in hist if h.get("peer_bytes_per_participant") is not None]
    fin = [r[0]["final"] for r in runs]
    if trained:  # msfusion: protocol bytes = peer exchange
        byts = sum((f.get("bytes_peer") or 0) for f in fin) / len(fin) / n / max(rounds - 1, 1)
    else:
        byts = sum((f.get("bytes_down") or 0) + (f.get("bytes_up") or 0) for f in fin) / len(fin) / n / rounds
    return {
        "method": label, **cols,
        f"{name} (mean ± std)": mean_std(vals).fmt(scale, 2),
        "per seed": " / ".join("—" if v is None else f"{scale * v:.1f}" for v in vals),
        "FLOPs/participant/round": sum((f.get("client_flops") or 0) / rounds + (f.get("server_flops") or 0)
                                       for f in fin) / len(fin) / n,  # Fed-ET: server work shared by participants
        "bytes/participant/round": byts,
        "seeds": ",".join(map(str, seeds)), "wall s": round(wall, 1), "_vals": vals, "_metric": metric,
    }


def stability_columns(runs: list[tuple[dict, list[dict]]], window: int = 10) -> dict[str, Any]:
    """Per seed: the last-``window`` mean and the best ``window``-round mean of the global accuracy, whether the
    run shows no sustained decline (last within 2 points of best), and, for runs with ``compare_assemblies``, the
    final accuracy of the other full-model assemblies."""
    stab = [stability(h, window) for _, h in runs]
    ok = all(a is not None and b is not None and 100 * (b - a) <= 2.0 for a, b in stab)
    cols: dict[str, Any] = {
        f"last-{window} mean per seed": " / ".join("—" if a is None else f"{100 * a:.1f}" for a, _ in stab),
        f"best {window}-round mean per seed": " / ".join("—" if b is None else f"{100 * b:.1f}" for _, b in stab),
        "no sustained decline": "yes" if ok else "no",
    }
    for mode in ("last", "zero_stale"):
        vals = [s["final"].get(f"global_accuracy_{mode}") for s, _ in runs]
        if any(v is not None for v in vals):
            cols[f"assembly={mode} per seed"] = " / ".join("—" if v is None else f"{100 * v:.1f}" for v in vals)
    return cols


PAIRS = (("msfusion", "fedrolex"), ("msfusion", "heterofl"), ("fedrolex", "heterofl"))  # Table 1, CIFAR
PTB_PAIRS = (("msfusion", "fedrolex"), ("msfusion", "heterofl"), ("heterofl", "fedrolex"))  # Table 1, PTB


def ordering(rows: list[dict[str, Any]], keys: tuple[str, ...],
             pairs: tuple[tuple[str, str], ...] = PAIRS) -> list[dict[str, Any]]:
    """Each (better, worse) pair of the paper's ordering on the same seeds, per group of ``keys`` (CIFAR: MSfusion >
    FedRolex > HeteroFL; PTB perplexity: MSfusion < HeteroFL < FedRolex; lower perplexity is better)."""
    out = []
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), {})[r["method"]] = r
    for key, by in groups.items():
        for a, b in pairs:
            if a not in by or b not in by:
                continue
            sign = -1.0 if by[a]["_metric"] == "perplexity" else 1.0
            t = paired_test(by[a]["_vals"], by[b]["_vals"])
            scale = 100.0 if sign > 0 else 1.0
            better = sign * t.diff > 0
            out.append({**dict(zip(keys, key)), "comparison": f"{a} vs {b}",
                        "difference": round(scale * t.diff, 2) if t.n else None,
                        "p (paired t)": None if t.p_value != t.p_value else round(t.p_value, 4),
                        "paper ordering holds": ("yes" if better else "no") + ("" if t.significant() else " (n.s.)")})
    return out


TITLES = {
    "mnist": "### MNIST shards (`--mnist-classes` per participant, default the paper's H = 5), MLP, every other "
             "setting at its default",
    "cifar": "### CIFAR-10, 10 participants, global full-model accuracy",
    "ablation": "### Ablation, CIFAR-10 non-IID, mu = 0.25",
    "ring": "### Topology, CIFAR-10 non-IID, mu = 0.25 (bytes = peer exchange only)",
    "ptb": "### Penn Treebank, transformer LM, mu = 0.25 (perplexity, lower is better)",
}
ORDER_KEYS = {"mnist": ("mu",), "cifar": ("data", "mu"), "ptb": ("mu",)}
ABLATIONS = (("w/o con", {"contrastive": False}), ("w/o dyn", {"dynamic": False}),
             ("w/o con & dyn", {"contrastive": False, "dynamic": False}), ("dot sim.", {"similarity": "dot"}),
             ("compressed Eq. 6", {"compressed": True}))


def ablation_rows(names: str) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The ablation rows named in a comma list (empty: all); an unknown name is an error that lists them."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = dict(ABLATIONS)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"--ablations: unknown {unknown}; choose from {', '.join(known)}")
    return tuple((n, known[n]) for n in wanted) if wanted else ABLATIONS


def compressed_eq6(rounds: int) -> dict[str, Any]:
    """Eq. 6 squeezed into ``rounds``: 50 updates of c (the paper's 500 / 10) spread over the run."""
    return {"schedule_rounds": 0, "update_every": max(1, rounds // 50)}


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(max(int(getattr(args, "threads", 1)), 1))
    s = settings(args.quick)
    if args.rounds:
        s["rounds"] = args.rounds
    if getattr(args, "ptb_rounds", 0):
        s["ptb_rounds"] = args.ptb_rounds
    splits = [x.strip() for x in getattr(args, "cifar_splits", "").split(",") if x.strip()]
    if splits:
        unknown = sorted(set(splits) - {"non-iid", "iid"})
        if unknown or "non-iid" not in splits:
            raise SystemExit(f"--cifar-splits: choose non-iid or non-iid,iid (got {','.join(splits)})")
        s["iid"] = "iid" in splits
    if args.mus:
        s["mus"] = s["mnist_mus"] = [float(m) for m in args.mus.split(",") if m.strip()]
    seeds = parse_seeds(args.seeds)
    default_parts = "mnist,cifar,ptb" if args.quick else "mnist,cifar,ablation,ring,ptb"
    parts = [p.strip() for p in (args.parts or default_parts).split(",") if p.strip()]
    out = Path(args.out or ("runs/reproduce-msfusion" + ("-quick" if args.quick else "")))
    out.mkdir(parents=True, exist_ok=True)
    data_dir = args.data_dir or os.environ.get("FEDFUSE_DATA")
    t_start = time.time()
    results: dict[str, list[dict]] = {k: [] for k in TITLES}

    def show(rs: list[dict[str, Any]]) -> str:
        return markdown([{k: v for k, v in r.items() if not k.startswith("_")} for r in rs])

    def write() -> str:
        blocks = []
        for k, v in results.items():
            if not v:
                continue
            blocks.append(f"{TITLES[k]}\n\n{show(v)}")
            if k in ORDER_KEYS:
                pairs = PTB_PAIRS if k == "ptb" else PAIRS
                blocks.append(f"Paper ordering (same seeds):\n\n{markdown(ordering(v, ORDER_KEYS[k], pairs))}")
        text = f"Seeds {','.join(map(str, seeds))}\n\n" + "\n\n".join(blocks)
        text += f"\n\nTotal wall time: {time.time() - t_start:.0f} s\n"
        (out / "tables.md").write_text(text)
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        return text

    def go(section: str, name: str, base: dict, label: str, over: dict[str, Any], metric: str = "global_accuracy",
           **cols: Any) -> None:
        t = time.time()
        runs = [run_one(base, out / section / name / f"seed{sd}", progress=False, **{**over, "seed": sd})
                for sd in seeds]
        row = cell_row(label, runs, seeds, time.time() - t, metric, **cols)
        if metric.endswith("accuracy"):
            row.update(stability_columns(runs))
        results[section].append(row)
        print(show([results[section][-1]]).splitlines()[-1], flush=True)
        write()

    wanted = [m.strip() for m in getattr(args, "methods", "").split(",") if m.strip()] or list(METHODS)

    def compare(algo: str) -> dict[str, Any]:
        return {"compare_assemblies": True} if algo == "msfusion" and getattr(args, "compare_assemblies", False) \
            else {}

    def point(section: str, base: dict, partition: str | None, mu: float, eval_every: int, rounds: int) -> None:
        for algo in (m for m in METHODS if m in wanted):
            cols: dict[str, Any] = {"data": partition} if partition else {}
            cols["mu"] = mu
            if section == "mnist":
                opts: dict[str, Any] = {"mu": mu}  # the algorithm's defaults otherwise
            else:
                opts = algo_options(algo, mu, eval_every, rounds)
                cols["paper"] = PAPER_CIFAR.get((algo, partition, mu), "—")
            opts.update(compare(algo))
            go(section, f"{partition or 'mnist'}-mu{mu}-{algo}", base, algo,
               {"algorithm": algo, "algorithm_options": opts}, **cols)

    if "mnist" in parts:
        mbase = mnist_base(data_dir, args.quick, getattr(args, "mnist_classes", MNIST_CLASSES),
                           getattr(args, "mnist_rounds", 20), getattr(args, "mnist_eval_every", 1))
        for mu in s["mnist_mus"]:
            point("mnist", mbase, None, mu, mbase["eval_every"], mbase["rounds"])
    if "cifar" in parts:
        for mu in s["mus"]:
            point("cifar", cifar_base(s, data_dir, "non-iid"), "non-iid", mu, s["eval_every"], s["rounds"])
        if s["iid"]:
            point("cifar", cifar_base(s, data_dir, "iid"), "iid", 0.25, s["eval_every"], s["rounds"])
        if "fedet" in wanted or not getattr(args, "methods", ""):  # Fed-ET: no split ratio, one row per split
            for partition in ("non-iid", "iid") if s["iid"] else ("non-iid",):
                go("cifar", f"{partition}-fedet", cifar_base(s, data_dir, partition), "fedet",
                   {"algorithm": "fedet", "algorithm_options": FEDET}, data=partition, mu="N/A",
                   paper=PAPER_CIFAR.get(("fedet", partition, None), "—"))
    if "ablation" in parts:
        base = cifar_base(s, data_dir, "non-iid")
        rows = ablation_rows(getattr(args, "ablations", ""))
        for label, extra in (("msfusion", {}), *rows):
            name = label.replace(" ", "").replace("/", "").replace("&", "-").replace(".", "")
            paper = PAPER_ABLATION.get(label)
            if extra.get("compressed"):
                extra = compressed_eq6(s["rounds"])
            go("ablation", name, base, label,
               {"algorithm": "msfusion", "algorithm_options": algo_options("msfusion", 0.25, 0, s["rounds"], **extra)},
               mu=0.25, paper=f"{paper} (mu=18.75%)" if paper else "—")
    if "ring" in parts:
        base = cifar_base(s, data_dir, "non-iid")
        for topo in ("full", "ring"):
            go("ring", topo, base, f"msfusion ({topo})",
               {"algorithm": "msfusion", "algorithm_options": algo_options("msfusion", 0.25, 0, s["rounds"],
                                                                           topology=topo)}, mu=0.25)
        for algo in ("dpsgd", "dispfl"):  # Table 3's serverless baselines: each participant's own model
            go("ring", algo, base, algo, {"algorithm": algo, "algorithm_options": {"topology": "ring"}},
               metric="personal_accuracy", mu="N/A", paper=PAPER_RING[algo])
    if "ptb" in parts:
        base = {
            "dataset": "ptb", "data_dir": data_dir, "partition": "contiguous", "partition_options": {},
            "model": "transformer", "clients": 10, "clients_per_round": 10, "rounds": s["ptb_rounds"],
            "local_epochs": 1, "batch_size": 20, "lr": 1.0, "eval_every": s["ptb_rounds"],
            "checkpoint_every": 1000, "plots": False, "device": "cpu",
            "model_options": {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "dropout": 0.2},
            "dataset_options": {"seq_len": 32},
        }
        for algo in (m for m in METHODS if m in wanted):
            t = time.time()
            runs = []
            for sd in seeds:
                cfg = validate(apply(RunConfig(), {**base, "algorithm": algo, "seed": sd,
                                                   "out": str(out / "ptb" / algo / f"seed{sd}"),
                                                   "algorithm_options": {"mu": 0.25, **LR, **compare(algo)}}))
                exp = experiment(cfg, fed=truncated(federation_for(cfg), s["ptb_seqs"], s["ptb_test"]),
                                 progress=False)
                runs.append((exp.run(), exp.history))
            results["ptb"].append(cell_row(algo, runs, seeds, time.time() - t, "perplexity", mu=0.25,
                                           paper=PAPER_PTB[algo]))
            print(show([results["ptb"][-1]]).splitlines()[-1], flush=True)
            write()
    print(write())
    return 0
