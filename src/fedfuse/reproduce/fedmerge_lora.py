"""FedMerge for foundation models (Chen et al., *FedMerge: Federated Model Merging for
Personalization*, foundation-model FL): merging LoRA adapters,
against Local, FedIT, FedLoRA and FedEM with a personalised router over LoRA modules, plus the
parameter-scale study (d adapters for FedMerge vs LoRA rank for the single-adapter methods; that paper's Table 1
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
from pathlib import Path
from typing import Any

from fedfuse.config import RunConfig
from fedfuse.reproduce.common import data_root
from fedfuse.reproduce.preset import Family, Table, pick
from fedfuse.result_table import ResultTable
from fedfuse.types import Federation

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


def _row(algo: str, **opts: Any) -> dict[str, Any]:
    return {"algorithm": algo, "algorithm_options": opts}


def methods(rounds: int, rank: int) -> dict[str, dict[str, Any]]:
    step = 5.0 / rounds
    fm = {"merge_step": step, "rank": rank}
    return {
        "fedmerge-lora d=4": _row("fedmerge-lora", d=4, **fm),
        "fedmerge-lora d=4 paper": _row("fedmerge-lora", d=4, theta_update="paper", **fm),
        "fedmerge-lora d=4 paper init=merge": _row("fedmerge-lora", d=4, theta_update="paper", init_scale="merge",
                                                   **fm),
        "fedit": _row("fedit", rank=rank),
        "fedlora": _row("fedlora", rank=rank, ft_epochs=1),
        "local-lora": _row("local-lora", rank=rank),
        "fedem-lora m=4": _row("fedem-lora", m=4, rank=rank),
    }


def sweep(rounds: int, rank: int, which: list[str]) -> dict[str, dict[str, Any]]:
    """The parameter-scale rows: d adapters for FedMerge / FedEM, the LoRA rank for FedIT / FedLoRA."""
    step = 5.0 / rounds
    out: dict[str, dict[str, Any]] = {}
    for algo in which:
        if algo == "fedmerge-lora":
            out |= {f"fedmerge-lora d={d}": _row(algo, d=d, merge_step=step, rank=rank) for d in D_SWEEP}
            out |= {f"fedmerge-lora d={d} paper": _row(algo, d=d, merge_step=step, rank=rank, theta_update="paper")
                    for d in D_SWEEP}
        elif algo == "fedem-lora":
            out |= {f"fedem-lora m={d}": _row(algo, m=d, rank=rank) for d in D_SWEEP}
        elif algo in ("fedit", "fedlora"):
            extra = {"ft_epochs": 1} if algo == "fedlora" else {}
            out |= {(f"{algo} r={r}" if r != rank else algo): _row(algo, rank=r, **extra) for r in RANK_SWEEP}
        else:
            raise SystemExit(f"--sweep-methods: {algo!r} has no parameter-scale axis")
    return out


def base_spec(args: argparse.Namespace, data_dir: str) -> str:
    """``--base``, else the cached ``fedfuse pretrain`` base (trained by :func:`ensure_base` when missing)."""
    if args.base:
        return args.base
    from fedfuse.adapters.text import PretrainConfig, default_base_path

    return f"fedfuse:{default_base_path(PretrainConfig(), data_dir)}"


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


def record_federation(task: str, quick: bool = True, clients: int = 0, rank: int = 8,
                      targets: str = "q_proj,v_proj", base_sha: str = "") -> dict[str, Any]:
    """The ``--federation`` of ``fedfuse results record`` for this preset's runs (the config alone names a
    Shakespeare run; the clients are built from the base's tokenizer): what :func:`rebuild` needs."""
    return {"kind": "lora", "task": task, "quick": quick, "clients": clients, "rank": rank, "targets": targets,
            "base_state_sha256": base_sha}


def base_state_sha256(path: str | Path) -> str:
    """sha256 of a ``fedfuse pretrain`` base's model: its settings, vocabulary and every weight tensor (name,
    dtype, shape, bytes) — not of the file, which also holds the pretraining's wall time."""
    import hashlib
    import json

    import torch

    from fedfuse.engine.checkpoint import safe_load

    ck = safe_load(path, what="fedfuse results verify: LoRA base", kind="fedfuse pretrained LM")
    h = hashlib.sha256(json.dumps({"model": ck["model"], "vocab": list(ck["vocab"])}, sort_keys=True).encode())
    for name in sorted(ck["state"]):
        t = ck["state"][name].contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def rebuild(spec: dict[str, Any], cfg: RunConfig) -> tuple[RunConfig, Federation]:
    """The config and federation of a recorded run of this preset (``spec``: :func:`record_federation`).

    The base is the recorded ``fedfuse:`` file; where it is missing, this machine's ``fedfuse pretrain`` base
    of the same file name (the name keys the pretraining settings and corpora), pretrained when missing.  A
    base whose weights differ from the recorded ones (:func:`base_state_sha256`) stops the re-run."""
    from dataclasses import replace

    from fedfuse.config import check_extras, resolve_device

    check_extras(cfg)  # before pretraining a missing base
    if spec.get("task") not in ("roles", "tasks"):
        raise SystemExit(f"fedfuse results verify: cannot rebuild the LoRA federation {spec}")
    data_dir = cfg.data_dir or data_root(argparse.Namespace(data_dir=None))
    opts = dict(cfg.algorithm_options)
    base = str(opts.get("base", ""))
    if not base.startswith("fedfuse:"):
        raise SystemExit(f"fedfuse results verify: base {base!r} is not a fedfuse pretrain file")
    path = Path(base[len("fedfuse:"):])
    if not path.is_file():
        from fedfuse.adapters.text import PretrainConfig, default_base_path, pretrain

        here = default_base_path(PretrainConfig(), data_dir)
        if here.name != path.name:
            raise SystemExit(f"fedfuse results verify: the recorded base {path} is missing and this machine's "
                             f"`fedfuse pretrain` base is {here.name}, other settings or corpora")
        if not here.is_file():
            print(f"no pretrained base at {here}: running `fedfuse pretrain` first", flush=True)
            pretrain(PretrainConfig(), here, data_dir)
        path = here
        cfg = replace(cfg, algorithm_options={**opts, "base": f"fedfuse:{path}"})
    want, have = spec.get("base_state_sha256"), base_state_sha256(path)
    if want and have != want:
        raise SystemExit(f"fedfuse results verify: the base {path} is not the recorded one (weights sha256 "
                         f"{have[:12]}…, recorded {str(want)[:12]}…)")
    args = argparse.Namespace(task=spec["task"], quick=bool(spec.get("quick", True)),
                              clients=int(spec.get("clients", 0)), rank=int(spec.get("rank", 8)),
                              targets=str(spec.get("targets", "q_proj,v_proj")), instructions="")
    s = settings(args.quick, args.task)
    return cfg, federation(args, f"fedfuse:{path}", s, data_dir, int(cfg.seed), resolve_device(cfg.device))


def tables(args: argparse.Namespace) -> list[Table]:
    """One table: the main methods (and with ``--sweep`` the parameter-scale rows) on one federation per seed."""
    from fedfuse.config import resolve_device

    s = settings(args.quick, args.task)
    rounds = args.rounds or s["rounds"]
    where = data_root(args)
    rows = methods(rounds, args.rank)
    if args.sweep:
        rows = {**rows, **sweep(rounds, args.rank, [m for m in args.sweep_methods.split(",") if m])}
    rows = pick(rows, args.methods)
    lora = {"base": base_spec(args, where), "targets": args.targets.split(","), "rouge_samples": s["rouge_samples"],
            "prompt_len": 32, "gen_tokens": s["gen_tokens"]}
    rows = {k: {**v, "algorithm_options": {**lora, **v["algorithm_options"]}} for k, v in rows.items()}
    cache: dict[int, Federation] = {}

    def fed(cfg: RunConfig) -> Federation:
        if cfg.seed not in cache:
            cache.clear()
            cache[cfg.seed] = federation(args, ensure_base(args, where), s, where, cfg.seed,
                                         resolve_device(args.device))
        return cache[cfg.seed]

    n = args.clients or s["clients"]
    base = {"dataset": "shakespeare", "partition": "natural", "model": "transformer", "clients": n,
            "clients_per_round": n, "rounds": rounds, "local_epochs": s["local_epochs"],
            "batch_size": s["batch_size"], "lr": args.lr or s["lr"], "optimizer": "adam", "plots": False,
            "checkpoint_every": 10_000, "eval_every": min(s["eval_every"], rounds), "threads": args.threads,
            "device": str(resolve_device(args.device)), "data_dir": where}
    title = (f"FedMerge on LoRA adapters ({'quick' if args.quick else 'full'}, task {args.task}): personalised "
             f"perplexity; base {lora['base']}, {rounds} rounds, all clients every round")
    return [Table(f"lora-{args.task}", title, base, rows, metric="personal_perplexity", federation=fed,
                  columns=("personal_rouge1", "server_parameters", "adapter_parameters",
                           "optimised_parameters_per_client"))]


def extra(args: argparse.Namespace, out: Path, done: dict[str, ResultTable]) -> str:
    """With ``--sweep``: ``param_scale.png``, perplexity against server parameters."""
    if not args.sweep:
        return ""
    plot_scale(done[f"lora-{args.task}"], out / "param_scale.png", args.rank)
    return "Parameter scale: `param_scale.png` (personalised perplexity vs server parameters)."


def plot_scale(rt: ResultTable, path: Path, rank: int) -> None:
    """Personalised perplexity vs server parameters (multiples of a rank-8 adapter), mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import re

    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    families: dict[str, dict[float, list[float]]] = {}
    for label, runs in rt.results.items():  # one line per method variant: the label without its d / m / r value
        for r in runs:
            f = r.last  # the table's metric is the last evaluation (Table.last = 1)
            if f.get("personal_perplexity") is None:
                continue
            unit = f["adapter_parameters"] * 8 / max(int(r.config.algorithm_options.get("rank", rank)), 1)
            fam = re.sub(r" [dmr]=\d+", "", label)
            families.setdefault(fam, {}).setdefault(round(f["server_parameters"] / unit, 2), []).append(
                f["personal_perplexity"])
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


FAMILY = Family("FedMerge on LoRA adapters vs Local/FedIT/FedLoRA/FedEM-LoRA; parameter-scale sweep (d vs rank)",
                tables, add_arguments, extra, docs="lora", extras=("lora",))
