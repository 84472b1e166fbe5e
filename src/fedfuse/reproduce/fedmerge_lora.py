"""FedMerge for foundation models (seed 001, foundation-model FL; seed 000's LLM part): merging LoRA adapters,
against Local, FedIT, FedLoRA and FedEM with a personalised router over LoRA modules, plus the
parameter-scale study (d adapters for FedMerge vs LoRA rank for the single-adapter methods; 001 Table 1
bottom and Fig. 5).

Local task (no download, CPU): the base is the character LM of ``fedfuse pretrain`` (WikiText-2 + PTB); the
clients are LEAF Shakespeare speaking roles (``--task roles``, the persona split) or one generation task each
(``--task tasks``).  Metrics: personalised perplexity (each client's own model on its own test windows) and
ROUGE-1 of greedy continuations.  With a GPU and data, ``--base hf:DIR --task instructions --instructions
PATH`` runs the papers' Flan / RoleBench setting on a LLaMA-class model (docs/lora.md gives the command).

Scaled settings: the paper runs 50 rounds with merge step 0.01; as in ``reproduce fedmerge`` the step is
scaled so the total logit travel matches (``merge_step = 0.5 / rounds`` · 10 = ``5 / rounds``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from fedfuse.tables import markdown

DESCRIPTION = "FedMerge on LoRA adapters vs Local/FedIT/FedLoRA/FedEM-LoRA; parameter-scale sweep (d vs rank)"

D_SWEEP = (2, 4, 8, 12)
RANK_SWEEP = (4, 8, 16, 32)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default="", help="fedfuse:PATH.pt or hf:DIR (default: the cached `fedfuse pretrain` "
                                              "base, trained first if missing)")
    p.add_argument("--task", default="roles", choices=("roles", "tasks", "instructions"))
    p.add_argument("--instructions", default="", help="--task instructions: a Flan task folder / RoleBench file")
    p.add_argument("--methods", default="", help="comma list of row labels to run (default: all; sweep rows "
                                                 "are labelled e.g. 'fedmerge-lora d=8', 'fedit r=16')")
    p.add_argument("--sweep", action="store_true", help="also run the parameter-scale sweep (d and rank)")
    p.add_argument("--sweep-methods", default="fedmerge-lora,fedit",
                   help="methods in the sweep: fedmerge-lora and fedem-lora vary d, fedit/fedlora vary the rank")
    p.add_argument("--rounds", type=int, default=0, help="override the number of rounds")
    p.add_argument("--clients", type=int, default=0, help="override the number of clients (roles / tasks)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of the main table (papers: 8)")
    p.add_argument("--targets", default="q_proj,v_proj", help="LoRA target modules (comma list)")
    p.add_argument("--lr", type=float, default=0.0, help="override the local learning rate")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on shared CPUs)")


def settings(quick: bool, task: str) -> dict[str, Any]:
    if task == "instructions":  # the papers' setting: 50 rounds, 20 local steps of batch 4 (set on the GPU)
        return {"rounds": 50, "local_epochs": 1, "batch_size": 4, "lr": 5e-5, "clients": 0, "max_chars": 0,
                "rouge_samples": 200, "gen_tokens": 64, "eval_every": 10}
    if quick:
        return {"rounds": 5, "local_epochs": 1, "batch_size": 16, "lr": 5e-3, "clients": 8, "max_chars": 4000,
                "rouge_samples": 8, "gen_tokens": 24, "eval_every": 5}
    return {"rounds": 20, "local_epochs": 1, "batch_size": 16, "lr": 5e-3, "clients": 8, "max_chars": 12000,
            "rouge_samples": 32, "gen_tokens": 32, "eval_every": 5}


def methods(rounds: int, rank: int) -> list[tuple[str, str, dict[str, Any]]]:
    step = 5.0 / rounds
    return [
        ("fedmerge-lora d=4", "fedmerge-lora", {"d": 4, "merge_step": step, "rank": rank}),
        ("fedmerge-lora d=4 paper", "fedmerge-lora", {"d": 4, "merge_step": step, "rank": rank,
                                                      "theta_update": "paper"}),
        ("fedmerge-lora d=4 paper init=merge", "fedmerge-lora", {"d": 4, "merge_step": step, "rank": rank,
                                                                 "theta_update": "paper", "init_scale": "merge"}),
        ("fedit", "fedit", {"rank": rank}),
        ("fedlora", "fedlora", {"rank": rank, "ft_epochs": 1}),
        ("local-lora", "local-lora", {"rank": rank}),
        ("fedem-lora m=4", "fedem-lora", {"m": 4, "rank": rank}),
    ]


def sweep(rounds: int, rank: int, which: list[str]) -> list[tuple[str, str, dict[str, Any]]]:
    step = 5.0 / rounds
    out: list[tuple[str, str, dict[str, Any]]] = []
    for algo in which:
        if algo == "fedmerge-lora":
            out += [(f"fedmerge-lora d={d}", algo, {"d": d, "merge_step": step, "rank": rank}) for d in D_SWEEP]
            out += [(f"fedmerge-lora d={d} paper", algo, {"d": d, "merge_step": step, "rank": rank,
                                                         "theta_update": "paper"}) for d in D_SWEEP]
        elif algo == "fedem-lora":
            out += [(f"fedem-lora m={d}", algo, {"m": d, "rank": rank}) for d in D_SWEEP]
        elif algo in ("fedit", "fedlora"):
            extra = {"ft_epochs": 1} if algo == "fedlora" else {}
            out += [(f"{algo} r={r}" if r != rank else algo, algo, {"rank": r, **extra}) for r in RANK_SWEEP]
        else:
            raise SystemExit(f"--sweep-methods: {algo!r} has no parameter-scale axis")
    return out


def ensure_base(args: argparse.Namespace, data_dir: str) -> str:
    if args.base:
        return args.base
    from fedfuse.adapters.text import PretrainConfig, default_base_path, pretrain

    cfg = PretrainConfig()
    path = default_base_path(cfg, data_dir)
    if not path.is_file():
        print(f"no pretrained base at {path}: running `fedfuse pretrain` first", flush=True)
        pretrain(cfg, path, data_dir)
    return f"fedfuse:{path}"


def federation(args: argparse.Namespace, base: str, s: dict[str, Any], data_dir: str, seed: int, device: Any):
    from fedfuse.adapters.lora import LoraSpec, adapter_model
    from fedfuse.data.lm_clients import shakespeare_roles, task_split

    tok = adapter_model(base, LoraSpec(rank=args.rank, targets=tuple(args.targets.split(","))), device).tokenizer
    n = args.clients or s["clients"]
    if args.task == "roles":
        return shakespeare_roles(tok, data_dir, clients=n, seq_len=64, max_chars=s["max_chars"], device=device)
    if args.task == "tasks":
        from fedfuse.data.lm_clients import TASKS

        sizes = {"train": 60, "val": 10, "test": 20} if args.quick else {"train": 150, "val": 20, "test": 40}
        return task_split(tok, data_dir, tasks=list(TASKS)[:n], seed=seed, device=device, **sizes)
    from fedfuse.data.instructions import instruction_federation

    if not args.instructions:
        raise SystemExit("--task instructions needs --instructions PATH (a Flan task folder or RoleBench data)")
    return instruction_federation(args.instructions, tok, seed=seed, device=device)


def run(args: argparse.Namespace) -> int:
    import torch

    from fedfuse.config import RunConfig, apply, resolve_device, validate
    from fedfuse.runner import experiment
    from fedfuse.stats import parse_seeds

    torch.set_num_threads(max(int(args.threads), 1))
    s = settings(args.quick, args.task)
    rounds = args.rounds or s["rounds"]
    seeds = parse_seeds(args.seeds)
    out = Path(args.out or f"runs/reproduce-fedmerge-lora-{args.task}")
    out.mkdir(parents=True, exist_ok=True)
    data_dir = args.data_dir or os.environ.get("FEDFUSE_DATA", "../shared/data")
    device = resolve_device(args.device)
    base = ensure_base(args, data_dir)
    grid = methods(rounds, args.rank)
    if args.sweep:
        labels = {g[0] for g in grid}
        grid += [g for g in sweep(rounds, args.rank, [m for m in args.sweep_methods.split(",") if m])
                 if g[0] not in labels]
    wanted = {m.strip() for m in args.methods.split(",") if m.strip()}
    grid = [g for g in grid if not wanted or g[0] in wanted]
    lora = {"base": base, "targets": args.targets.split(","), "rouge_samples": s["rouge_samples"], "prompt_len": 32,
            "gen_tokens": s["gen_tokens"]}
    records: list[dict[str, Any]] = []
    done = out / "runs.jsonl"
    if done.exists():  # resume: keep finished runs
        records = [json.loads(line) for line in done.read_text().splitlines() if line.strip()]
    have = {(r["label"], r["seed"]) for r in records}
    t_all = time.perf_counter()
    for seed in seeds:
        fed = federation(args, base, s, data_dir, seed, device)
        for label, algo, opts in grid:
            if (label, seed) in have:
                continue
            cfg = validate(apply(RunConfig(), {
                "algorithm": algo, "dataset": "shakespeare", "partition": "natural", "model": "transformer",
                "clients": fed.num_clients, "clients_per_round": fed.num_clients, "rounds": rounds,
                "local_epochs": s["local_epochs"], "batch_size": s["batch_size"], "lr": args.lr or s["lr"],
                "optimizer": "adam", "seed": seed, "plots": False, "checkpoint_every": 10_000,
                "eval_every": min(s["eval_every"], rounds), "threads": args.threads, "device": str(device),
                "out": str(out / "runs" / f"{label.replace(' ', '_').replace('=', '')}-seed{seed}"),
                "algorithm_options": {**lora, **opts}}))
            t0 = time.perf_counter()
            summary = experiment(cfg, fed=fed).run()
            rec = record(label, algo, opts, seed, summary, rounds, fed.num_clients, time.perf_counter() - t0)
            records.append(rec)
            with open(done, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{label:<22} seed {seed}: ppl {rec['ppl']:.3f}  rouge1 {rec['rouge1']:.4f}  "
                  f"({rec['wall']:.0f}s)", flush=True)
    text = report(records, args, rounds, base, time.perf_counter() - t_all)
    (out / "results.md").write_text(text)
    if args.sweep:
        plot_scale(records, out / "param_scale.png", args.rank)
    print(text)
    return 0


def record(label: str, algo: str, opts: dict, seed: int, summary: dict, rounds: int, m: int, wall: float) -> dict:
    f, tot = summary["final"], summary["totals"]
    return {"label": label, "algorithm": algo, "options": opts, "seed": seed,
            "ppl": f.get("personal_perplexity"), "ppl_clients": f.get("personal_perplexity_clients"),
            "rouge1": f.get("personal_rouge1"), "token_acc": f.get("personal_accuracy"),
            "server_params": f.get("server_parameters"), "adapter_params": f.get("adapter_parameters"),
            "client_params": f.get("optimised_parameters_per_client"),
            "kb_client_round": (tot["bytes_down"] + tot["bytes_up"]) / max(rounds * m, 1) / 1024,
            "mflops_client_round": tot["client_flops"] / max(rounds * m, 1) / 1e6,
            "merge_weights": f.get("merge_weights"), "wall": wall}


def report(records: list[dict], args: argparse.Namespace, rounds: int, base: str, wall: float) -> str:
    from fedfuse.stats import mean_std, paired_test

    labels = list(dict.fromkeys(r["label"] for r in records))
    by = {lab: sorted((r for r in records if r["label"] == lab), key=lambda r: r["seed"]) for lab in labels}
    ref_label = "fedmerge-lora d=4" if "fedmerge-lora d=4" in by else next(
        (lab for lab in labels if lab.startswith("fedmerge-lora")), None)
    ref = {r["seed"]: r for r in by[ref_label]} if ref_label else {}
    rows = []
    for lab in labels:
        rs = by[lab]
        r0 = rs[0]
        unit = r0["adapter_params"] * 8 / max(int(r0["options"].get("rank", 8)), 1)  # a rank-8 adapter
        row = {"method": lab, "seeds": len(rs),
               "personal ppl ↓": mean_std([r["ppl"] for r in rs]).fmt(digits=3),
               "ROUGE-1 % ↑": mean_std([r["rouge1"] for r in rs]).fmt(scale=100.0),
               "server params (× rank-8)": round((r0["server_params"] or 0) / unit, 2),
               "client params": int(r0["client_params"] or 0),
               "KB/client/round": round(r0["kb_client_round"], 1),
               "MFLOPs/client/round": round(r0["mflops_client_round"], 1)}
        if ref and lab != ref_label:
            seeds = [r["seed"] for r in rs if r["seed"] in ref]
            if not seeds:
                rows.append(row)
                continue
            t = paired_test([ref[s]["ppl"] for s in seeds], [r["ppl"] for r in rs if r["seed"] in ref])
            row[f"{ref_label} − this, ppl"] = f"{t.diff:+.3f} {t.mark()}"
        rows.append(row)
    return (f"# FedMerge on LoRA adapters ({'quick' if args.quick else 'full'}, task {args.task})\n\n"
            f"base {base}; rounds {rounds}; all clients every round; seeds "
            f"{sorted({r['seed'] for r in records})}; wall {wall:.0f} s\n\n{markdown(rows)}\n")


def plot_scale(records: list[dict], path: Path, rank: int) -> None:
    """Personalised perplexity vs server parameters (multiples of a rank-8 adapter), mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import re

    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    families: dict[str, dict[float, list[float]]] = {}
    for r in records:  # one line per method variant: the label without its d / m / r value
        if r["ppl"] is None:
            continue
        unit = r["adapter_params"] * 8 / max(int(r["options"].get("rank", rank)), 1)
        fam = re.sub(r" [dmr]=\d+", "", r["label"])
        families.setdefault(fam, {}).setdefault(round(r["server_params"] / unit, 2), []).append(r["ppl"])
    markers = iter("os^vDPX*<>")
    for fam, pts in families.items():  # single-setting methods (FedLoRA, Local, FedEM m=4) are single points
        xs = sorted(pts)
        ys = [float(np.mean(pts[x])) for x in xs]
        es = [float(np.std(pts[x], ddof=1)) if len(pts[x]) > 1 else 0.0 for x in xs]
        ax.errorbar(xs, ys, yerr=es, marker=next(markers, "o"), capsize=3, label=fam)
    ax.set_xlabel("server parameters (× a rank-8 adapter)")
    ax.set_ylabel("personalised perplexity (lower is better)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
