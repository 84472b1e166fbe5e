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

Every table has one column per method with mean ± std over ``--seeds`` (default 3) and a paired t-test of
FedMA vs the report-form FedAvg.  ``--quick`` runs a reduced grid; the full grid is the report's scale (a few
CPU-hours on one core; the same preset runs unchanged on a GPU with ``--device cuda``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from fedfuse.reproduce.common import run_one
from fedfuse.stats import mean_std, paired_test, parse_seeds
from fedfuse.tables import markdown

DESCRIPTION = "FedMA vs FedAvg (both forms)/ensemble/one-shot on MNIST SimpleMLP; Simple-FedMA on PTB + WikiText-2"

LR = {"sgd": 0.01, "adam": 0.001}
HIDDEN_LAYERS = 4  # SimpleMLP 784-20-100-120-84-10: the report counts one FedMA round as 4 communications


def add_arguments(parser) -> None:
    parser.add_argument("--part", choices=["all", "mlp", "oneshot", "transformer"], default="all")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--clients", default=None,
                        help="comma list of client counts (default 2,3,5,8,10; quick 2,5,10)")
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
        dataset="mnist", data_dir=args.data_dir, dataset_options={"train_limit": 10000}, partition="dirichlet",
        partition_options={"alpha": 0.5}, model="simple-mlp", batch_size=64, local_epochs=10, val_fraction=0.0,
        clients=n, clients_per_round=n, optimizer=opt, lr=LR[opt], momentum=0.9 if opt == "sgd" else 0.0,
        plots=False, checkpoint_every=1000, device=getattr(args, "device", "cpu"),
    )


def report_options(opt: str) -> dict[str, dict[str, Any]]:
    """Algorithm options of the report's FedMA and FedAvg for optimiser ``opt``."""
    sched = {"retrain_schedule": "code", "retrain_epochs": 7, "retrain_lr": LR["sgd"]} if opt == "sgd" else {
        "retrain_schedule": "run", "retrain_epochs": 7}
    return {"fedma": dict(sched), "fedavg-report": {**sched, "continuation": "fedavg"}}


def _run(base: dict[str, Any], out: Path, **kw: Any) -> list[dict[str, Any]]:
    """One configuration's history (``fedfuse reproduce --reuse`` keeps finished runs: common.run_one)."""
    _, hist = run_one(base, out, progress=False, **kw)
    return hist


def _acc(hist: list[dict[str, Any]], idx: int, key: str = "global_accuracy") -> float | None:
    return hist[idx].get(key) if idx < len(hist) else None


def _fmt(vals: list[float | None]) -> str:
    return mean_std(vals).fmt(100.0)


def _mlp_grid(args, out: Path, seeds: list[int]) -> list[dict[str, Any]]:
    quick = bool(args.quick)
    clients_grid = _ints(args.clients, [2, 5, 10] if quick else [2, 3, 5, 8, 10])
    comms_grid = _ints(args.comms, [4] if quick else [4, 20])
    if any(c % HIDDEN_LAYERS for c in comms_grid):
        raise SystemExit(f"--comms must be multiples of {HIDDEN_LAYERS} (one FedMA round of SimpleMLP)")
    optimizers = _strs(args.optimizers, ["sgd"] if quick else ["sgd", "adam"])
    methods = set(_strs(args.methods, ["fedma", "fedavg-report", "fedavg", "oneshot"]))
    fr = max(comms_grid) // HIDDEN_LAYERS  # FedMA rounds after the uncounted round 0
    rows = []
    for opt in optimizers:
        opts = report_options(opt)
        for n in clients_grid:
            base = mnist_base(args, n, opt)
            t0 = time.perf_counter()
            res: dict[str, list[list[dict[str, Any]]]] = {}
            for s in seeds:
                tag = f"{opt}-{n}-seed{s}"
                runs = {}
                if "fedma" in methods:
                    runs["fedma"] = dict(algorithm="fedma", rounds=fr + 1, algorithm_options=opts["fedma"])
                if "fedavg-report" in methods:
                    runs["fedavg-report"] = dict(algorithm="oneshot-avg", rounds=max(comms_grid) + 1,
                                                 algorithm_options=opts["fedavg-report"])
                if "fedavg" in methods:
                    runs["fedavg"] = dict(algorithm="fedavg", rounds=max(comms_grid) + 1)
                if "oneshot" in methods:
                    for algo in ("ensemble", "oneshot-match", "oneshot-avg"):
                        runs[algo] = dict(algorithm=algo, rounds=1)
                for name, kw in runs.items():
                    res.setdefault(name, []).append(_run(base, out / tag / name, seed=s, **kw))
            for comms in comms_grid:
                r_ma, r_avg = comms // HIDDEN_LAYERS, comms
                fm = [_acc(h, r_ma) for h in res.get("fedma", [])]
                fa = [_acc(h, r_avg) for h in res.get("fedavg-report", [])]
                row: dict[str, Any] = {"optimizer": opt, "clients": n, "communications": comms, "seeds": len(seeds),
                                       "FedMA / FedAvg rounds counted": f"{r_ma} / {r_avg}"}
                if "fedma" in res:
                    row["FedMA round 0 (uncounted) %"] = _fmt([_acc(h, 0) for h in res["fedma"]])
                    row["FedMA %"] = _fmt(fm)
                if "fedavg-report" in res:
                    row["FedAvg report form %"] = _fmt(fa)
                if "fedavg" in res:
                    row["FedAvg shared init %"] = _fmt([_acc(h, r_avg) for h in res["fedavg"]])
                if "oneshot" in methods:
                    row["ensemble %"] = _fmt([_acc(h, 0, "ensemble_accuracy") for h in res["ensemble"]])
                    row["1-shot matching %"] = _fmt([_acc(h, 0) for h in res["oneshot-match"]])
                    row["1-shot averaging %"] = _fmt([_acc(h, 0) for h in res["oneshot-avg"]])
                if fm and fa:
                    t = paired_test(fm, fa)
                    row["FedMA − FedAvg(report) pts"] = f"{100 * t.diff:+.2f} {t.mark()}"
                    row["FedMA widths"] = "-".join(str(w) for w in res["fedma"][0][r_ma].get("global_widths", []))
                rows.append(row)
            print(markdown(rows[-len(comms_grid):]), f"\n({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def _oneshot_study(args, out: Path, seeds: list[int]) -> list[dict[str, Any]]:
    """One-shot matching of the same local models: posterior (code σ, σ0, γ) vs plain mean vs small σ."""
    variants = {
        "BBP-MAP posterior, code σ=1 σ0=1 γ=7": {},
        "BBP-MAP, plain mean of matched units": {"estimator": "mean"},
        "BBP-MAP posterior, σ=0.01": {"sigma": 0.01},
        "BBP-MAP posterior, σ0=100": {"sigma0": 100.0},
        "Hungarian (no growth), mean": {"matching": "hungarian"},
    }
    clients_grid = _ints(args.clients, [2, 10]) if args.part == "oneshot" else [2, 10]
    rows = []
    for n in clients_grid:
        base = mnist_base(args, n, "sgd")
        acc: dict[str, list[float | None]] = {}
        widths: dict[str, str] = {}
        for s in seeds:
            h = _run(base, out / f"oneshot-{n}-seed{s}" / "avg", seed=s, algorithm="oneshot-avg",
                     rounds=1)
            acc.setdefault("element-wise average (no matching)", []).append(_acc(h, 0))
            for name, o in variants.items():
                sub = "-".join(f"{k}={v}" for k, v in sorted(o.items())) or "code"
                h = _run(base, out / f"oneshot-{n}-seed{s}" / sub, seed=s, algorithm="oneshot-match",
                         rounds=1, algorithm_options=o)
                acc.setdefault(name, []).append(_acc(h, 0))
                widths[name] = "-".join(str(w) for w in h[0].get("global_widths", []))
        for name, vals in acc.items():
            rows.append({"clients": n, "fusion of the same local models": name, "accuracy %": _fmt(vals),
                         "seeds": len(vals), "widths (seed 0)": widths.get(name, "20-100-120-84")})
        print(markdown(rows[-len(acc):]), flush=True)
    return rows


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


def _transformer_part(args, seeds: list[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from fedfuse.algorithms.simple_fedma import merge
    from fedfuse.engine.client import TrainConfig, evaluate_model, train_local
    from fedfuse.fusion.average import weighted_average
    from fedfuse.fusion.permute import perm_spec
    from fedfuse.models import build_model
    from fedfuse.rng import torch_generator
    from fedfuse.types import Split

    quick = bool(args.quick)
    vocab_cap = args.lm_vocab or (2000 if quick else 5000)
    windows = args.lm_windows or (400 if quick else 2000)
    epochs = args.lm_epochs or (1 if quick else 4)
    corpus = args.lm_corpus
    train, test, vocab, tokens = _lm_data(args.data_dir, corpus, vocab_cap, windows, windows // 5)
    test_split = Split(*test)
    cfg = TrainConfig(local_epochs=epochs, batch_size=20, lr=5.0, grad_clip=0.5)
    rows, summary = [], []
    hiddens = [16] if quick else [16, 32]
    for d_ff in hiddens:
        for init in ("same", "distinct"):
            per_seed = []
            for seed in seeds:
                t0 = time.perf_counter()

                def build(s: int, d_ff: int = d_ff):
                    torch.manual_seed(s)
                    return build_model("transformer", (35,), vocab, task="lm", d_model=8, n_heads=1, n_layers=1,
                                       d_ff=d_ff, dropout=0.2, persistent_pe=True, max_len=35)

                models = []
                for j, (x, y) in enumerate(train):
                    m = build(seed * 1000 + (j if init == "distinct" else 0))
                    train_local(m, Split(x, y), cfg, torch_generator(seed, "simple-fedma", j))
                    models.append(m)
                states = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
                probe = build(0)

                def loss_of(st, probe=probe) -> float:
                    probe.load_state_dict(st)
                    return float(evaluate_model(probe, test_split, 32).loss)

                avg = loss_of(weighted_average(states, [1.0, 1.0]))
                merged, moved = merge(states, perm_spec(models[0]), "l1")
                sf = loss_of(merged)
                per_seed.append((avg, sf))
                rows.append({
                    "hidden": d_ff, "init": init, "seed": seed, "loss PTB model": round(loss_of(states[0]), 3),
                    f"loss {corpus} model": round(loss_of(states[1]), 3), "loss plain average": round(avg, 3),
                    "loss Simple-FedMA": round(sf, 3), "Δ (avg − Simple-FedMA)": round(avg - sf, 3),
                    "units moved (residual/qk/v/mlp)": "/".join(
                        str(sum(v for k, v in moved.items() if k.split(".")[-1] == g))
                        for g in ("residual", "qk", "v", "mlp")),
                    "seconds": round(time.perf_counter() - t0, 1),
                })
                print(markdown(rows[-1:]), flush=True)
            avg_l, sf_l = [a for a, _ in per_seed], [b for _, b in per_seed]
            t = paired_test(sf_l, avg_l)
            summary.append({
                "hidden": d_ff, "init": init, "seeds": len(per_seed),
                "loss plain average": mean_std(avg_l).fmt(digits=3), "loss Simple-FedMA": mean_std(sf_l).fmt(digits=3),
                "Δ (avg − Simple-FedMA)": mean_std([a - b for a, b in per_seed]).fmt(digits=3),
                "Simple-FedMA lower in": f"{sum(b < a for a, b in per_seed)}/{len(per_seed)} seeds",
                "paired t": f"p = {t.p_value:.2g} {t.mark()}",
            })
    print(f"(vocabulary {vocab}, {tokens} training tokens per model, {len(test_split)} test windows, "
          f"{epochs} epochs)")
    return rows, summary


def run(args) -> int:
    if getattr(args, "threads", 0):
        torch.set_num_threads(int(args.threads))
    seeds = parse_seeds(getattr(args, "seeds", "3"))
    out = Path(args.out or ("/tmp/fedfuse-reproduce-fedma" + ("-quick" if args.quick else "")))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"seeds": seeds}
    if args.part in ("all", "mlp"):
        result["mnist"] = _mlp_grid(args, out, seeds)
    if args.part in ("all", "oneshot"):
        result["oneshot"] = _oneshot_study(args, out, seeds)
    if args.part in ("all", "transformer"):
        result["simple_fedma"], result["simple_fedma_summary"] = _transformer_part(args, seeds)
    wall = time.perf_counter() - t0
    text = [f"seeds: {seeds}", ""]
    if "mnist" in result:
        text += ["## FedMA on MNIST (SimpleMLP, global test accuracy, mean ± std over seeds; "
                 "communications counted as in the report)", "", markdown(result["mnist"]), ""]
    if "oneshot" in result:
        text += ["## One-shot fusion of the same local models (MNIST SimpleMLP)", "", markdown(result["oneshot"]), ""]
    if "simple_fedma" in result:
        text += ["## Simple-FedMA (loss on the union of both test sets)", "", markdown(result["simple_fedma_summary"]),
                 "", markdown(result["simple_fedma"]), ""]
    text.append(f"wall time: {wall:.0f} s")
    report = "\n".join(text)
    print(report)
    (out / "results.md").write_text(report + "\n")
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    return 0
