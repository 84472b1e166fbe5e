"""FedMA and Simple-FedMA (L46 report §4.1, Fig. 2, 4, 5; §4.2) with the report's settings.

Part ``mlp`` (MNIST, real IDX files): 10,000 stratified training images, Dirichlet(0.5) split (IBM/FedMA's
``hetero-dir``), SimpleMLP 784-20-100-120-84-10, clients ∈ {2, 3, 5, 8, 10}, 4 and 20 communications.
Training as in the report's runs of ``IBM/FedMA``'s ``main.py``: batch 64, SGD lr 0.01 momentum 0.9, 10 local
epochs, retraining 7 epochs at ``retrain_lr`` 0.01 with the code's schedule (FedMA ``retrain_schedule=code``:
head-only stage at lr/10, wd 1e-4, 3× epochs; later rounds retrain the rebuilt full model for 7 epochs).

**Communication accounting (the report's).**  Every method starts from the same clients' local models (10
epochs from distinct initialisations) and their first fusion — FedMA's layer-wise matching (the code's
``BBP_MAP``), the one-shot average — which is *not* counted.  One FedMA round then counts ``K = 4``
communications (one per hidden layer of SimpleMLP), one FedAvg round one.  So "4 communications" = FedMA after
round 1 (fedfuse round index 1) vs FedAvg after 4 rounds, and "20" = FedMA round 5 vs FedAvg round 20.
FedAvg is shown in both forms: the report's (``oneshot-avg --set continuation=fedavg``: FedAvg rounds started
from the one-shot average of the local models, 7 epochs per round with the code's ``local_retrain_fedavg``
schedule) and fedfuse's ``fedavg`` (one shared initialisation; its uncounted round 0 trains 10 epochs from it,
every round uses ``local_epochs`` = 10).  One-shot matching / averaging and the ensemble fuse the local models
once (communication 0).  ``--optimizers adam`` trains with Adam (lr 0.001) everywhere, retraining included
(``retrain_schedule=run``).

Part ``oneshot``: why the one-shot BBP-MAP posterior loses to a plain mean — the code's σ = σ0 = 1 posterior
``g/p = (Σ w)/(1 + n)`` shrinks every matched unit towards the prior mean 0 by ``n/(n+1)`` (an unmatched unit
by 1/2); the same matching with ``estimator=mean`` or a small σ (little shrinkage) is compared.

Part ``transformer`` (Simple-FedMA, §4.2): two 1-block 1-head transformers (emsize 8, hidden 16 "small" /
32 "large"), one trained on PTB and one on WikiText-2 (the report's corpora; ``--lm-corpus tiny-shakespeare``
for the other word corpus), same number of training tokens, joint vocabulary; loss on the union of both test
sets for each model, their plain average and Simple-FedMA (:func:`fedfuse.algorithms.simple_fedma.merge`),
from the same and from distinct initialisations, one row per seed plus mean ± std.

Each (optimiser, clients, communications) is one table with one row per method, mean ± std over ``--seeds``
(default 3; quick 1) and a paired t-test of FedMA vs the report-form FedAvg.  ``--quick`` runs a reduced grid;
the full grid is the report's scale (a few CPU-hours on one core; the same preset runs unchanged on a GPU with
``--device cuda``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from fedfuse.reproduce.common import data_root, seeds
from fedfuse.reproduce.preset import Family, Table
from fedfuse.result_table import ResultTable
from fedfuse.stats import mean_std, paired_test
from fedfuse.tables import markdown

LR = {"sgd": 0.01, "adam": 0.001}
HIDDEN_LAYERS = 4  # SimpleMLP 784-20-100-120-84-10: the report counts one FedMA round as 4 communications
MLP_METHODS = ("fedma", "fedavg-report", "fedavg", "oneshot")


def add_arguments(parser) -> None:
    parser.add_argument("--part", choices=["all", "mlp", "oneshot", "transformer"], default="all")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on shared CPUs)")
    parser.add_argument("--clients", default=None,
                        help="comma list of client counts (default 2,3,5,8,10; quick 2,10)")
    parser.add_argument("--comms", default=None,
                        help="comma list of communication budgets, multiples of 4 (default 4,20; quick 4)")
    parser.add_argument("--optimizers", default=None, help="comma list of sgd/adam (default sgd,adam; quick sgd)")
    parser.add_argument("--methods", default=None,
                        help="comma list among fedma,fedavg-report,fedavg,oneshot (default all)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--lm-corpus", default="wikitext2", choices=["wikitext2", "tiny-shakespeare"],
                        help="the second client's corpus (report: wikitext2)")
    parser.add_argument("--lm-vocab", type=int, default=0,
                        help="keep each corpus's N most frequent words (0 = 5000; quick 2000)")
    parser.add_argument("--lm-windows", type=int, default=0,
                        help="training windows of 35 tokens per client (0 = 2000; quick 400)")
    parser.add_argument("--lm-epochs", type=int, default=0, help="training epochs (0 = the report's 4; quick 1)")


def _ints(text: str | None, default: list[int]) -> list[int]:
    return default if not text else [int(x) for x in str(text).split(",") if x.strip()]


def _strs(text: str | None, default: list[str]) -> list[str]:
    return default if not text else [x.strip() for x in str(text).split(",") if x.strip()]


def mnist_base(args, n: int, opt: str) -> dict[str, Any]:
    """The report's MNIST/SimpleMLP run configuration for ``n`` clients (IBM/FedMA main.py settings)."""
    return dict(
        dataset="mnist", data_dir=data_root(args), dataset_options={"train_limit": 10000}, partition="dirichlet",
        partition_options={"alpha": 0.5}, model="simple-mlp", batch_size=64, local_epochs=10, val_fraction=0.0,
        clients=n, clients_per_round=n, optimizer=opt, lr=LR[opt], momentum=0.9 if opt == "sgd" else 0.0,
        plots=False, checkpoint_every=1000, device=getattr(args, "device", "cpu"), threads=getattr(args, "threads", 1),
    )


def report_options(opt: str) -> dict[str, dict[str, Any]]:
    """Algorithm options of the report's FedMA and FedAvg for optimiser ``opt``."""
    sched = {"retrain_schedule": "code", "retrain_epochs": 7, "retrain_lr": LR["sgd"]} if opt == "sgd" else {
        "retrain_schedule": "run", "retrain_epochs": 7}
    return {"fedma": dict(sched), "fedavg-report": {**sched, "continuation": "fedavg"}}


def mlp_rows(opt: str, comms: int, methods: set[str]) -> dict[str, dict[str, Any]]:
    """The rows of one communication budget: FedMA after ``comms / 4`` rounds, FedAvg (both forms) after
    ``comms`` rounds, the one-shot fusions after round 0 (every run also has the uncounted round 0)."""
    opts = report_options(opt)
    rows = {
        "fedma": {"algorithm": "fedma", "rounds": comms // HIDDEN_LAYERS + 1, "algorithm_options": opts["fedma"]},
        "fedavg-report": {"algorithm": "oneshot-avg", "rounds": comms + 1, "algorithm_options": opts["fedavg-report"]},
        "fedavg": {"algorithm": "fedavg", "rounds": comms + 1, "algorithm_options": {}},
    }
    rows = {k: v for k, v in rows.items() if k in methods}
    if "oneshot" in methods:
        rows |= {algo: {"algorithm": algo, "rounds": 1, "algorithm_options": {}}
                 for algo in ("ensemble", "oneshot-match", "oneshot-avg")}
    return rows


def mlp_tables(args) -> list[Table]:
    quick = bool(args.quick)
    comms_grid = _ints(args.comms, [4] if quick else [4, 20])
    if any(c % HIDDEN_LAYERS for c in comms_grid):
        raise SystemExit(f"--comms must be multiples of {HIDDEN_LAYERS} (one FedMA round of SimpleMLP)")
    methods = set(_strs(args.methods, list(MLP_METHODS)))
    out = []
    for opt in _strs(args.optimizers, ["sgd"] if quick else ["sgd", "adam"]):
        for n in _ints(args.clients, [2, 10] if quick else [2, 3, 5, 8, 10]):
            for comms in comms_grid:
                rows = mlp_rows(opt, comms, methods)
                title = (f"FedMA on MNIST SimpleMLP, {opt}, {n} clients, {comms} communications (FedMA / FedAvg "
                         f"rounds counted {comms // HIDDEN_LAYERS} / {comms}); global test accuracy")
                pairs = (("fedma", "fedavg-report"),) if {"fedma", "fedavg-report"} <= set(rows) else ()
                out.append(Table(f"mlp-{opt}-{n}clients-{comms}comms", title, mnist_base(args, n, opt), rows,
                                 pairs=pairs, columns=("ensemble_accuracy", "global_widths")))
    return out


#: One-shot matching of the same local models: the code's posterior (σ, σ0, γ) vs plain mean vs small σ.
ONESHOT = {
    "element-wise average (no matching)": ("oneshot-avg", {}),
    "BBP-MAP posterior, code σ=1 σ0=1 γ=7": ("oneshot-match", {}),
    "BBP-MAP, plain mean of matched units": ("oneshot-match", {"estimator": "mean"}),
    "BBP-MAP posterior, σ=0.01": ("oneshot-match", {"sigma": 0.01}),
    "BBP-MAP posterior, σ0=100": ("oneshot-match", {"sigma0": 100.0}),
    "Hungarian (no growth), mean": ("oneshot-match", {"matching": "hungarian"}),
}


def oneshot_tables(args) -> list[Table]:
    rows = {k: {"algorithm": a, "rounds": 1, "algorithm_options": o} for k, (a, o) in ONESHOT.items()}
    clients = _ints(args.clients, [2, 10]) if args.part == "oneshot" else [2, 10]
    return [Table(f"oneshot-{n}clients", f"One-shot fusion of the same local models, MNIST SimpleMLP, {n} clients",
                  mnist_base(args, n, "sgd"), rows, columns=("global_widths",)) for n in clients]


def tables(args) -> list[Table]:
    out = []
    if args.part in ("all", "mlp"):
        out += mlp_tables(args)
    if args.part in ("all", "oneshot"):
        out += oneshot_tables(args)
    return out


# ------------------------------------------------------------------------------------------------- part 2


def _lm_data(data_dir: str | None, corpus: str, max_vocab: int, max_train: int, max_test: int, seq_len: int = 35):
    """PTB and a second word corpus as windows over a joint vocabulary, equal training token counts.

    To keep the softmax affordable on CPU, each corpus keeps its ``max_vocab`` most frequent words; rarer words
    map to one shared ``<unk>``.
    """
    from fedfuse.data.datasets import load_dataset

    ptb = load_dataset("ptb", data_dir, seq_len=seq_len)
    other = load_dataset(corpus, data_dir, seq_len=seq_len, **({"level": "word"} if corpus == "tiny-shakespeare"
                                                                else {}))
    vocab = ["<unk>"]
    index = {"<unk>": 0}
    maps = []
    for ds in (ptb, other):
        ids = []
        for rank, w in enumerate(ds.vocab):
            if rank < max_vocab and w not in index:
                index[w] = len(vocab)
                vocab.append(w)
            ids.append(index[w] if rank < max_vocab else 0)
        maps.append(torch.as_tensor(ids))
    n_train = min(len(ptb.train_x), len(other.train_x), max_train)
    n_test = min(len(ptb.test_x), len(other.test_x), max_test)
    train = [(mp[ds.train_x[:n_train]], mp[ds.train_y[:n_train]]) for ds, mp in zip((ptb, other), maps)]
    test_x = torch.cat([mp[ds.test_x[:n_test]] for ds, mp in zip((ptb, other), maps)])
    test_y = torch.cat([mp[ds.test_y[:n_test]] for ds, mp in zip((ptb, other), maps)])
    return train, (test_x, test_y), len(vocab), n_train * seq_len


def _lm_model(seed: int, vocab: int, d_ff: int):
    from fedfuse.models import build_model

    torch.manual_seed(seed)
    return build_model("transformer", (35,), vocab, task="lm", d_model=8, n_heads=1, n_layers=1, d_ff=d_ff,
                       dropout=0.2, persistent_pe=True, max_len=35)


def _merge_pair(train, test_split, cfg, vocab: int, d_ff: int, init: str, seed: int, corpus: str) -> dict[str, Any]:
    """Train one model per corpus (same or distinct initialisation), merge them; the row of losses."""
    from fedfuse.algorithms.simple_fedma import merge
    from fedfuse.engine.client import evaluate_model, train_local
    from fedfuse.fusion.average import weighted_average
    from fedfuse.fusion.permute import perm_spec
    from fedfuse.rng import torch_generator
    from fedfuse.types import Split

    t0 = time.perf_counter()
    models = []
    for j, (x, y) in enumerate(train):
        m = _lm_model(seed * 1000 + (j if init == "distinct" else 0), vocab, d_ff)
        train_local(m, Split(x, y), cfg, torch_generator(seed, "simple-fedma", j))
        models.append(m)
    states = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
    probe = _lm_model(0, vocab, d_ff)

    def loss_of(st) -> float:
        probe.load_state_dict(st)
        return float(evaluate_model(probe, test_split, 32).loss)

    avg = loss_of(weighted_average(states, [1.0, 1.0]))
    merged, moved = merge(states, perm_spec(models[0]), "l1")
    sf = loss_of(merged)
    return {"hidden": d_ff, "init": init, "seed": seed, "loss PTB model": round(loss_of(states[0]), 3),
            f"loss {corpus} model": round(loss_of(states[1]), 3), "loss plain average": round(avg, 3),
            "loss Simple-FedMA": round(sf, 3), "Δ (avg − Simple-FedMA)": round(avg - sf, 3),
            "units moved (residual/qk/v/mlp)": "/".join(str(sum(v for k, v in moved.items() if k.split(".")[-1] == g))
                                                        for g in ("residual", "qk", "v", "mlp")),
            "seconds": round(time.perf_counter() - t0, 1), "_avg": avg, "_sf": sf}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    avg_l, sf_l = [r["_avg"] for r in rows], [r["_sf"] for r in rows]
    t = paired_test(sf_l, avg_l)
    return {"hidden": rows[0]["hidden"], "init": rows[0]["init"], "seeds": len(rows),
            "loss plain average": mean_std(avg_l).fmt(digits=3), "loss Simple-FedMA": mean_std(sf_l).fmt(digits=3),
            "Δ (avg − Simple-FedMA)": mean_std([a - b for a, b in zip(avg_l, sf_l)]).fmt(digits=3),
            "Simple-FedMA lower in": f"{sum(b < a for a, b in zip(avg_l, sf_l))}/{len(rows)} seeds",
            "paired t": f"p = {t.p_value:.2g} {t.mark()}"}


def simple_fedma(args) -> str:
    """Part ``transformer``: Simple-FedMA vs the plain average of two transformers (not a federated run, so not
    a table of runs); its Markdown."""
    from fedfuse.engine.client import TrainConfig
    from fedfuse.types import Split

    quick = bool(args.quick)
    epochs = args.lm_epochs or (1 if quick else 4)
    windows = args.lm_windows or (400 if quick else 2000)
    train, test, vocab, tokens = _lm_data(data_root(args), args.lm_corpus, args.lm_vocab or (2000 if quick else 5000),
                                          windows, windows // 5)
    test_split = Split(*test)
    cfg = TrainConfig(local_epochs=epochs, batch_size=20, lr=5.0, grad_clip=0.5)
    rows, summary = [], []
    for d_ff in [16] if quick else [16, 32]:
        for init in ("same", "distinct"):
            per = [_merge_pair(train, test_split, cfg, vocab, d_ff, init, s, args.lm_corpus) for s in seeds(args)]
            summary.append(_summary(per))
            rows += per
    shown = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    return (f"## Simple-FedMA (loss on the union of both test sets)\n\nvocabulary {vocab}, {tokens} training "
            f"tokens per model, {len(test_split)} test windows, {epochs} epochs\n\n{markdown(summary)}\n\n"
            f"{markdown(shown)}")


def extra(args, out: Path, done: dict[str, ResultTable]) -> str:
    if args.threads:
        torch.set_num_threads(int(args.threads))
    return simple_fedma(args) if args.part in ("all", "transformer") else ""


FAMILY = Family("FedMA vs FedAvg (both forms)/ensemble/one-shot on MNIST SimpleMLP; Simple-FedMA on PTB + WikiText-2",
                tables, add_arguments, extra)
