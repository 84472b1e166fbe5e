"""MSfusion (the MSfusion paper) vs HeteroFL and FedRolex over several seeds: MNIST (the defaults check), real CIFAR-10
images (μ sweep, IID, ablations, ring vs fully connected topology) and a transformer LM on Penn Treebank.

Settings follow App. A.2 where they fit the budget: 10 participants, all active every round, plain SGD with a
triangular CyclicLR over all rounds whose peak is the run's ``lr``.

* ``mnist`` — the defaults check: MNIST ``shards`` with the paper's non-IID split of a 10-class dataset (H = 5
  classes per participant; the partition's own default is 2), the MLP (200-200), every other run setting and
  algorithm option at its default (20 rounds, lr 0.1, 2 local epochs, batch 32), all 60,000 training images
  (quick: a stratified 6,000-image subset, 10 rounds); μ ∈ {0.125, 0.25, 0.5} (quick: 0.25).
* ``cifar`` — non-IID = 5 classes per participant.  Scaled down (the paper: ResNet-18 [64,128,256,512], 500 rounds,
  batch 10, lr 0.001-0.0012): ResNet-18 at ``width_mult`` 0.25 (channels [16,32,64,128], static BN), a stratified
  CIFAR-10 subset of 3,000 images, 8 rounds, 1 local epoch, batch 32, CyclicLR 0.05-0.1.  Quick-only: 4 rounds of
  2 local epochs, evaluated once at the end (3 rounds of 1 epoch left HeteroFL and FedRolex at 12-14 %; measured
  with ``fedfuse reproduce msfusion --quick --seeds 0,1,2`` in docs/msfusion.md, "Reproduction").
* ``ablation`` / ``ring`` — CIFAR-10 non-IID at μ = 0.25 (full preset only).
* ``ptb`` — transformer LM (d_model 32, 2 blocks) on the first 100 windows of 32 tokens per participant.

Every cell is the mean ± sample std over ``--seeds`` (default 3; quick 1) of the final global full-model
accuracy (perplexity for PTB); "ordering" rows compare the methods on the same seeds (paired t-test).  Every
method uses the same model, data, schedule and rounds.  The presets run at paper scale on a GPU with ``--rounds``
and larger limits.
"""

from __future__ import annotations

import argparse
from typing import Any

from fedfuse.config import RunConfig
from fedfuse.reproduce.common import data_root, federation_for
from fedfuse.reproduce.preset import Family, Table, pairs_within
from fedfuse.types import ClientData, Federation, Split

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
    p.add_argument("--methods", default="",
                   help="comma list of msfusion, fedrolex, heterofl, fedet (default: all; quick: without fedet)")
    p.add_argument("--rounds", type=int, default=0, help="override the CIFAR rounds")
    p.add_argument("--ptb-rounds", type=int, default=0, help="override the PTB rounds (full: 3, quick: 2)")
    p.add_argument("--ablations", default="",
                   help="comma list of ablation rows besides msfusion itself (default: all): " +
                   ", ".join(label for label, _ in ABLATIONS))
    p.add_argument("--cifar-splits", default="", help="comma list of non-iid, iid (default: full both, quick non-iid)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on shared CPUs)")
    p.add_argument("--mnist-classes", type=int, default=MNIST_CLASSES,
                   help="classes per participant of the mnist part (the paper's H = 5; the shards default is 2)")
    p.add_argument("--mnist-rounds", type=int, default=0,
                   help="rounds of the mnist part (0: the run default, 20; quick 10)")
    p.add_argument("--mnist-eval-every", type=int, default=1,
                   help="evaluation interval of the mnist part (1: every round, for the 10-round stability means)")
    p.add_argument("--compare-assemblies", action="store_true",
                   help="msfusion: also score the other full-model assemblies (last, zero_stale) on the same "
                        "training runs (evaluation only; option compare_assemblies; mnist, cifar, ptb parts)")


def settings(quick: bool) -> dict[str, Any]:
    if quick:
        # CIFAR: 4 rounds of 2 local epochs, evaluated once at the end (was 3 rounds of 1 epoch; docs/msfusion.md)
        return {"rounds": 4, "train_limit": 3000, "test_limit": 1000, "eval_every": 4, "ptb_rounds": 2,
                "ptb_seqs": 40, "ptb_test": 200, "mus": [0.25], "iid": False, "mnist_mus": [0.25],
                "local_epochs": 2, "batch_size": 32, "lr": 0.1, "ptb_epochs": 1}
    return {"rounds": 8, "train_limit": 3000, "test_limit": 1000, "eval_every": 4, "ptb_rounds": 3,
            "ptb_seqs": 100, "ptb_test": 400, "mus": [0.125, 0.25, 0.5], "iid": True,
            "mnist_mus": [0.125, 0.25, 0.5], "local_epochs": 1, "batch_size": 32, "lr": 0.1, "ptb_epochs": 1}


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
        "rounds": s["rounds"], "local_epochs": s["local_epochs"], "batch_size": s["batch_size"], "lr": s["lr"],
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


PAIRS = (("msfusion", "fedrolex"), ("msfusion", "heterofl"), ("fedrolex", "heterofl"))  # Table 1, CIFAR
PTB_PAIRS = (("msfusion", "fedrolex"), ("msfusion", "heterofl"), ("heterofl", "fedrolex"))  # Table 1, PTB


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


TITLES = {
    "mnist": "MNIST shards (`--mnist-classes` per participant, default the paper's H = 5), MLP, every other "
             "setting at its default",
    "cifar": "CIFAR-10, 10 participants, global full-model accuracy",
    "ablation": "Ablation, CIFAR-10 non-IID, mu = 0.25",
    "ring": "Topology, CIFAR-10 non-IID, mu = 0.25",
    "ptb": "Penn Treebank, transformer LM, mu = 0.25 (perplexity, lower is better)",
}


def _methods(args: argparse.Namespace) -> list[str]:
    """``--methods``, else Table 1's three and Fed-ET (``--quick``: without Fed-ET, which alone took a quarter of
    the quick CPU time at chance accuracy)."""
    return [m.strip() for m in args.methods.split(",") if m.strip()] or [*METHODS, *([] if args.quick else ["fedet"])]


def _extra(args: argparse.Namespace, algo: str) -> dict[str, Any]:
    return {"compare_assemblies": True} if algo == "msfusion" and args.compare_assemblies else {}


def _columns(args: argparse.Namespace) -> tuple[str, ...]:
    """The stability means per seed and, with ``--compare-assemblies``, MSfusion's other assemblies."""
    assemblies = ("global_accuracy_last", "global_accuracy_zero_stale") if args.compare_assemblies else ()
    return ("last10_mean", "best10_mean", *assemblies)


def _rows(args: argparse.Namespace, opts: Any) -> dict[str, dict[str, Any]]:
    """One row per wanted method of Table 1: ``opts(algo)`` are its options."""
    return {a: {"algorithm": a, "algorithm_options": {**opts(a), **_extra(args, a)}}
            for a in METHODS if a in _methods(args)}


def mnist_tables(args: argparse.Namespace, s: dict[str, Any]) -> list[Table]:
    """The defaults check: per μ, the three methods with only μ set."""
    rounds = args.mnist_rounds or (10 if args.quick else 20)
    base = {**mnist_base(data_root(args), args.quick, args.mnist_classes, rounds, args.mnist_eval_every),
            "threads": args.threads}
    return [Table(f"mnist-mu{mu}", f"{TITLES['mnist']}, mu = {mu}", base, rows, pairs=pairs_within(rows, PAIRS),
                  columns=_columns(args))
            for mu in s["mnist_mus"] if (rows := _rows(args, lambda a, mu=mu: {"mu": mu}))]


def cifar_tables(args: argparse.Namespace, s: dict[str, Any]) -> list[Table]:
    """Per split and μ the three methods with the shared schedule; Fed-ET (no split ratio) per split."""
    points = [("non-iid", mu) for mu in s["mus"]] + ([("iid", 0.25)] if s["iid"] else [])
    out = []
    for split, mu in points:
        base = {**cifar_base(s, data_root(args), split), "threads": args.threads}
        rows = _rows(args, lambda a, mu=mu: algo_options(a, mu, s["eval_every"], s["rounds"]))
        if rows:
            out.append(Table(f"cifar-{split}-mu{mu}", f"{TITLES['cifar']}, {split}, mu = {mu}", base, rows,
                             pairs=pairs_within(rows, PAIRS), columns=_columns(args),
                             paper={a: PAPER_CIFAR.get((a, split, mu), "—") for a in rows}))
    if "fedet" in _methods(args):
        for split in ("non-iid", "iid") if s["iid"] else ("non-iid",):
            out.append(Table(f"cifar-{split}-fedet", f"{TITLES['cifar']}, {split}, Fed-ET (no split ratio)",
                             {**cifar_base(s, data_root(args), split), "threads": args.threads},
                             {"fedet": {"algorithm": "fedet", "algorithm_options": FEDET}},
                             paper={"fedet": PAPER_CIFAR[("fedet", split, None)]}))
    return out


def ablation_table(args: argparse.Namespace, s: dict[str, Any]) -> Table:
    rows = {}
    for label, extra in (("msfusion", {}), *ablation_rows(args.ablations)):
        extra = compressed_eq6(s["rounds"]) if extra.get("compressed") else extra
        rows[label] = {"algorithm": "msfusion", "algorithm_options": algo_options("msfusion", 0.25, 0, s["rounds"],
                                                                                  **extra)}
    paper = {k: f"{v} (mu=18.75%)" for k, v in PAPER_ABLATION.items() if k in rows}
    return Table("ablation", TITLES["ablation"], {**cifar_base(s, data_root(args), "non-iid"), "threads": args.threads},
                 rows, paper=paper)


def ring_tables(args: argparse.Namespace, s: dict[str, Any]) -> list[Table]:
    """MSfusion fully connected vs ring; Table 3's serverless baselines (each participant's own model)."""
    base = {**cifar_base(s, data_root(args), "non-iid"), "threads": args.threads}
    topo = {f"msfusion ({t})": {"algorithm": "msfusion", "algorithm_options": algo_options(
        "msfusion", 0.25, 0, s["rounds"], topology=t)} for t in ("full", "ring")}
    serverless = {a: {"algorithm": a, "algorithm_options": {"topology": "ring"}} for a in ("dpsgd", "dispfl")}
    return [Table("ring", TITLES["ring"], base, topo),
            Table("ring-serverless", "Serverless baselines on the ring, CIFAR-10 non-IID (local accuracy)", base,
                  serverless, metric="personal_accuracy", paper=PAPER_RING)]


def ptb_table(args: argparse.Namespace, s: dict[str, Any]) -> Table | None:
    """The transformer LM on PTB, each participant's corpus cut to ``ptb_seqs`` windows (:func:`truncated`)."""
    base = {
        "dataset": "ptb", "data_dir": data_root(args), "partition": "contiguous", "partition_options": {},
        "model": "transformer", "clients": 10, "clients_per_round": 10, "rounds": s["ptb_rounds"],
        "local_epochs": s["ptb_epochs"], "batch_size": 20, "lr": 1.0, "eval_every": s["ptb_rounds"],
        "threads": args.threads,
        "checkpoint_every": 1000, "plots": False, "device": "cpu",
        "model_options": {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "dropout": 0.2},
        "dataset_options": {"seq_len": 32},
    }
    rows = _rows(args, lambda a: {"mu": 0.25, **LR})
    if not rows:
        return None

    def federation(cfg: RunConfig) -> Federation:
        return truncated(federation_for(cfg), s["ptb_seqs"], s["ptb_test"])

    return Table("ptb", TITLES["ptb"], base, rows, metric="perplexity", pairs=pairs_within(rows, PTB_PAIRS),
                 paper={a: PAPER_PTB[a] for a in rows}, federation=federation)


def preset_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The preset's sizes with the command-line overrides."""
    s = settings(args.quick)
    s["rounds"] = args.rounds or s["rounds"]
    s["ptb_rounds"] = args.ptb_rounds or s["ptb_rounds"]
    splits = [x.strip() for x in args.cifar_splits.split(",") if x.strip()]
    if splits:
        if set(splits) - {"non-iid", "iid"} or "non-iid" not in splits:
            raise SystemExit(f"--cifar-splits: choose non-iid or non-iid,iid (got {','.join(splits)})")
        s["iid"] = "iid" in splits
    if args.mus:
        s["mus"] = s["mnist_mus"] = [float(m) for m in args.mus.split(",") if m.strip()]
    return s


PARTS = {"mnist": mnist_tables, "cifar": cifar_tables, "ablation": lambda a, s: [ablation_table(a, s)],
         "ring": ring_tables, "ptb": lambda a, s: [t for t in [ptb_table(a, s)] if t]}


def tables(args: argparse.Namespace) -> list[Table]:
    s = preset_settings(args)
    default_parts = "mnist,cifar,ptb" if args.quick else "mnist,cifar,ablation,ring,ptb"
    parts = [p.strip() for p in (args.parts or default_parts).split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    return [t for p in PARTS if p in parts for t in PARTS[p](args, s)]


FAMILY = Family("MSfusion vs HeteroFL/FedRolex over seeds: MNIST defaults, CIFAR-10 (mu sweep, ablations, ring), PTB",
                tables, add_arguments)
