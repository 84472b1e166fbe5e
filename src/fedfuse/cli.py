"""The ``fedfuse`` command line: run, compare, partition, list."""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

from fedfuse.config import (
    ConfigError,
    RunConfig,
    apply,
    load_yaml,
    parse_value,
    prepare_run_dir,
    resume_config,
    validate,
)
from fedfuse.errors import run_guarded

# flag → config key (flags default to None so only what the user typed overrides the config file)
FLAGS: dict[str, tuple[str, type]] = {
    "--algorithm": ("algorithm", str),
    "--dataset": ("dataset", str),
    "--partition": ("partition", str),
    "--model": ("model", str),
    "--clients": ("clients", int),
    "--clients-per-round": ("clients_per_round", int),
    "--rounds": ("rounds", int),
    "--local-epochs": ("local_epochs", int),
    "--batch-size": ("batch_size", int),
    "--lr": ("lr", float),
    "--momentum": ("momentum", float),
    "--weight-decay": ("weight_decay", float),
    "--optimizer": ("optimizer", str),
    "--seed": ("seed", int),
    "--data-dir": ("data_dir", str),
    "--out": ("out", str),
    "--device": ("device", str),
    "--eval-every": ("eval_every", int),
    "--threads": ("threads", int),
}


def _add_run_flags(p: argparse.ArgumentParser, with_algorithm: bool = True) -> None:
    for flag, (key, typ) in FLAGS.items():
        if flag == "--algorithm" and not with_algorithm:
            continue
        p.add_argument(flag, dest=key, type=typ, default=None, metavar=key.upper())
    p.add_argument("--alpha", type=float, default=None, help="Dirichlet concentration (partition option)")
    p.add_argument("--config", default=None, help="YAML file with configuration keys")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key, e.g. --set mu=0.1 --set model_options.widths=[64,64]")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in the output directory")


def build_config(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> RunConfig:
    """defaults → --config file → flags → --set, then validation."""
    cfg = RunConfig()
    if args.config:
        cfg = apply(cfg, load_yaml(args.config))
    flags = {key: getattr(args, key) for _, (key, _) in FLAGS.items()
             if key not in skip and getattr(args, key, None) is not None}
    cfg = apply(cfg, flags)
    if getattr(args, "alpha", None) is not None:
        cfg = apply(cfg, {"partition_options.alpha": args.alpha})
    sets: dict[str, Any] = {}
    for item in args.sets:
        if "=" not in item:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        sets[k.strip()] = parse_value(v)
    for k, v in sets.items():  # one at a time so a namespace chosen earlier (e.g. algorithm) is respected
        cfg = apply(cfg, {k: v})
    return validate(cfg)


def _default_out(cfg: RunConfig, prefix: str) -> str:
    return str(Path("runs") / f"{prefix}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}")


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{100 * v:.2f}" if pct else (f"{v:.4g}")
    return str(v)


def results_table(summary: dict[str, Any]) -> str:
    rows = [
        ("global accuracy (%)", "global_accuracy", True),
        ("personalised accuracy, mean over clients (%)", "personal_accuracy", True),
        ("personalised accuracy, sample-weighted (%)", "personal_accuracy_weighted", True),
        ("test loss", "loss", False),
        ("validation loss", "val_loss", False),
        ("perplexity", "perplexity", False),
        ("round", "round", False),
        ("MB down (total)", "bytes_down", False),
        ("MB up (total)", "bytes_up", False),
        ("client GFLOPs (total)", "client_flops", False),
        ("server parameters", "server_parameters", False),
        ("clients without test data (not in the means)", "clients_without_test", False),
        ("updates quarantined (total)", "total_quarantined", False),
        ("replies lost to dropout (total)", "total_dropped", False),
        ("replies after the deadline (total)", "total_late", False),
    ]
    lines = [f"{'metric':<48} {'final':>12} {'best (val)':>12}", "-" * 74]
    for label, key, pct in rows:
        f, b = summary["final"].get(key), summary["best"].get(key)
        if (f is None and b is None) or (key.startswith(("total_", "clients_without")) and not f):
            continue
        if key.startswith("bytes"):
            f, b = (None if x is None else x / 1e6 for x in (f, b))
        if key == "client_flops":
            f, b = (None if x is None else x / 1e9 for x in (f, b))
        lines.append(f"{label:<48} {_fmt(f, pct):>12} {_fmt(b, pct):>12}")
    lines.append(f"wall time: {summary['wall_seconds']:.1f} s over {summary['rounds_completed']} rounds")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    from fedfuse.engine.loop import Experiment

    if args.resume:
        cfg = resume_config(args, build_config)
        exp = Experiment(cfg, progress=not args.no_progress)
        summary = exp.run(resume=True)
    else:
        cfg = build_config(args)
        if not cfg.out:
            cfg.out = _default_out(cfg, cfg.algorithm)
        prepare_run_dir(cfg.out, overwrite=args.overwrite)
        exp = Experiment(cfg, progress=not args.no_progress)
        summary = exp.run()
    print(results_table(summary))
    print(f"outputs in {exp.out}")
    return 0


COMPARE_COLUMNS = (
    ("algorithm", "algorithm"),
    ("final global acc (%)", "final.global_accuracy"),
    ("final personal acc (%)", "final.personal_accuracy"),
    ("best personal acc (%)", "best.personal_accuracy"),
    ("best round", "best.round"),
    ("MB communicated", "mb"),
    ("client GFLOPs", "gflops"),
    ("server params", "final.server_parameters"),
    ("seconds", "wall_seconds"),
)


def compare_rows(summaries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name, s in summaries.items():
        f, b = s["final"], s["best"]
        mb = ((f.get("bytes_down") or 0) + (f.get("bytes_up") or 0) + (f.get("bytes_peer") or 0)) / 1e6
        pct = lambda v: None if v is None else round(100 * v, 2)  # noqa: E731
        rows.append({
            "algorithm": name,
            "final global acc (%)": pct(f.get("global_accuracy")),
            "final personal acc (%)": pct(f.get("personal_accuracy")),
            "best personal acc (%)": pct(b.get("personal_accuracy")),
            "best round": b.get("round"),
            "MB communicated": round(mb, 2),
            "client GFLOPs": round((f.get("client_flops") or 0) / 1e9, 2),
            "server params": f.get("server_parameters"),
            "seconds": round(s["wall_seconds"], 1),
        })
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        out.append("| " + " | ".join("—" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(out)


def cmd_compare(args: argparse.Namespace) -> int:
    from fedfuse.algorithms import ALGORITHMS
    from fedfuse.config import resolve_device
    from fedfuse.engine.loop import Experiment, build_federation
    from fedfuse.plots import plot_compare

    names = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if not names:
        raise ConfigError("--algorithms: give a comma-separated list, e.g. fedavg,fedprox,local")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--algorithms: {', '.join(twice)} listed more than once; each algorithm runs once "
                          "(compare one algorithm with different options in separate runs or with --set ALGO.key=v)")
    # --set ALGO.option=value applies to one algorithm only; other --set items to all
    per_algo: dict[str, dict[str, Any]] = {n: {} for n in names}
    common = []
    for item in args.sets:
        head = item.split("=", 1)[0]
        algo = next((a for a in ALGORITHMS if head.startswith(a + ".")), None)
        if algo is None:
            common.append(item)
        elif algo not in per_algo:
            raise ConfigError(f"--set {item}: {algo} is not among --algorithms {args.algorithms}")
        else:
            k, v = item.split("=", 1)
            per_algo[algo][f"algorithm_options.{k[len(algo) + 1:]}"] = parse_value(v)
    args.sets = common
    base = build_config(args, skip=("algorithm",))
    root = Path(base.out or _default_out(base, "compare"))
    cfgs = {}
    for name in names:  # validate every algorithm (and its options) before running anything
        c = RunConfig(**{**base.to_dict(), "algorithm_options": {}})
        c = validate(apply(apply(c, {"algorithm": name}), per_algo[name]))
        c.out = str(root / name)
        cfgs[name] = c
    prepare_run_dir(root, overwrite=args.overwrite)
    for c in cfgs.values():
        prepare_run_dir(c.out, overwrite=args.overwrite)
    fed = build_federation(base, resolve_device(base.device))  # one partition, shared by every algorithm
    summaries, histories = {}, {}
    for name, c in cfgs.items():
        exp = Experiment(c, fed=fed, progress=not args.no_progress)
        summaries[name] = exp.run()
        histories[name] = exp.history
    rows = compare_rows(summaries)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "compare.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    md = markdown_table(rows)
    (root / "compare.md").write_text(md + "\n")
    (root / "compare.json").write_text(json.dumps(summaries, indent=2))
    plot_compare(histories, root / "compare.png", title=f"{base.dataset} · {base.partition} · seed {base.seed}")
    print(md)
    print(f"outputs in {root}")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    from fedfuse.data.report import partition_table, plot_partition
    from fedfuse.engine.loop import build_federation

    cfg = build_config(args)
    fed = build_federation(cfg)
    print(partition_table(fed))
    png = Path(args.png or f"partition-{cfg.dataset}-{cfg.partition}.png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_partition(fed, png)
    print(f"wrote {png}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from fedfuse.algorithms import ALGORITHMS
    from fedfuse.data.datasets import DATASETS
    from fedfuse.data.partition import PARTITIONS
    from fedfuse.models import MODELS

    sections = {
        "algorithms": {k: v.description for k, v in sorted(ALGORITHMS.items())},
        "datasets": {k: v.description for k, v in sorted(DATASETS.items())},
        "partitions": dict(sorted(PARTITIONS.items())),
        "models": {k: v.description for k, v in sorted(MODELS.items())},
    }
    for title, items in sections.items():
        if args.what and args.what != title:
            continue
        print(f"{title}:")
        width = max(len(k) for k in items)
        for k, d in items.items():
            print(f"  {k:<{width}}  {d}")
        print()
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from fedfuse.reproduce import available

    return int(available()[args.name].run(args))


def _add_reproduce(sub) -> None:
    from fedfuse.reproduce import available
    from fedfuse.reproduce.common import add_seed_argument

    rp = sub.add_parser("reproduce", help="re-run a paper comparison on real data (see docs/)")
    names = rp.add_subparsers(dest="name", required=True)
    for name, module in available().items():
        p = names.add_parser(name, help=getattr(module, "DESCRIPTION", ""))
        p.add_argument("--quick", action="store_true", help="a <= 5 minute version")
        p.add_argument("--data-dir", default=None, help="where the datasets are (default: $FEDFUSE_DATA)")
        p.add_argument("--out", default=None, help="output directory")
        p.add_argument("--no-progress", action="store_true")
        add_seed_argument(p)
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)
        p.set_defaults(func=cmd_reproduce)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedfuse", description="Federated learning beyond plain averaging.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run one experiment (no arguments: a small FedAvg run on bundled digits)")
    _add_run_flags(r)
    r.add_argument("--resume", default=None, metavar="DIR", help="continue the run in DIR from its checkpoint")
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("compare", help="run several algorithms on the same partition and seed")
    c.add_argument("--algorithms", required=True, help="comma-separated, e.g. fedavg,fedprox,local,fedavg-ft")
    _add_run_flags(c, with_algorithm=False)
    c.set_defaults(func=cmd_compare)
    q = sub.add_parser("partition", help="print per-client sizes and label histograms; write a PNG")
    _add_run_flags(q)
    q.add_argument("--png", default=None, help="where to write the plot")
    q.set_defaults(func=cmd_partition)
    _add_reproduce(sub)
    li = sub.add_parser("list", help="list algorithms, datasets, partitions and models")
    li.add_argument("what", nargs="?", choices=["algorithms", "datasets", "partitions", "models"])
    li.set_defaults(func=cmd_list)
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    return run_guarded(lambda: int(args.func(args)))


if __name__ == "__main__":
    sys.exit(main())
