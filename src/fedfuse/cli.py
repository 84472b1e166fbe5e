"""The ``fedfuse`` command line (a thin layer over :mod:`fedfuse.api`): run, compare, show, report, partition,
reproduce, list, flower-app."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from fedfuse import package_version
from fedfuse.config import (
    FLAGS,
    ConfigError,
    RunConfig,
    apply,
    config_file,
    parse_value,
    validate,
)
from fedfuse.errors import UserError, run_guarded
from fedfuse.run_table import results_table as results_table  # what `fedfuse run` prints
from fedfuse.rundir import prepare_run_dir, resume_config
from fedfuse.runfiles import CHECKPOINT


def _flag_helps() -> dict[str, str]:
    """Every flag's help: the declared help of its config key when it has one (so flags and ``fedfuse show
    config`` agree), else the flag table's; with the default appended."""
    from fedfuse.options import describe

    infos = {o.name: o for o in describe(RunConfig)}
    defaults = RunConfig()
    out = {}
    for key, _, fallback in FLAGS.values():
        info = infos.get(key)
        text = (info.help if info and info.help else fallback).replace("%", "%%")
        default = getattr(defaults, key)
        out[key] = f"{text} (default: {default})" if default not in (None, "") else text
    return out


def _add_run_flags(p: argparse.ArgumentParser, with_algorithm: bool = True) -> None:
    g = p.add_argument_group("configuration (any key can also be given with --set or --config)")
    helps = _flag_helps()
    for flag, (key, typ, _) in FLAGS.items():
        if flag == "--algorithm" and not with_algorithm:
            continue
        g.add_argument(flag, dest=key, type=typ, default=None, metavar=key.upper(), help=helps[key])
    g.add_argument("--alpha", type=float, default=None,
                   help="Dirichlet concentration: shortcut for --set partition_options.alpha=ALPHA")
    g.add_argument("--config", default=None, help="YAML file with configuration keys (e.g. a run's config.yaml)")
    g.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key, e.g. --set mu=0.1 --set model_options.widths=[64,64]")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in the output directory")


def _add_sweep_flags(p: argparse.ArgumentParser, compare: bool) -> None:
    g = p.add_argument_group("seeds, grids and statistics")
    g.add_argument("--seeds", default=None,
                   help="run every configuration once per seed: a count (3 → seeds 0,1,2) or a list (0,4,7); "
                        "the table then shows mean ± std over seeds" + ("" if compare else " (default: one run)"))
    g.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="run every combination of these values, e.g. --grid lr=0.01,0.05 --grid mu=0.1,0.25")
    g.add_argument("--jobs", type=int, default=1,
                   help="run up to N runs in parallel processes (metrics identical to a serial run)")
    g.add_argument("--store", default=None,
                   help="directory of cached runs, one per full-config hash: runs found there are not rerun "
                        "(default: OUT/runs with --out, else $FEDFUSE_STORE or runs/store)")
    g.add_argument("--rerun", action="store_true", help="ignore cached runs and run everything again")
    g.add_argument("--baseline", default=None,
                   help="label every other is compared with by a paired test over seeds (default: the first)")
    g.add_argument("--metric", default="auto",
                   help="metric the table compares (auto: global_accuracy when every run has a global model, "
                        "else personal_accuracy; losses and perplexity count as lower-is-better)")
    g.add_argument("--last", type=int, default=5, help="final accuracy = mean of the last K evaluations (default 5)")
    g.add_argument("--target", type=float, default=None,
                   help="accuracy (0-1) for the rounds/MB/GFLOPs-to-target columns (default: the lowest mean "
                        "final accuracy among the labels, floored to a whole percent)")
    g.add_argument("--test", choices=("t", "wilcoxon"), default="t",
                   help="paired test over seeds: t (paired t-test) or wilcoxon (signed-rank)")


def _add_log_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log", default="", metavar="NAMES",
                   help="also send metrics to: tensorboard (OUT/tensorboard), mlflow (active tracking URI), csv "
                        "(OUT/metrics.csv); comma-separated")


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as an ordered mapping (YAML values; a later item for a key wins)."""
    sets: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        sets.pop(k.strip(), None)
        sets[k.strip()] = parse_value(v)
    return sets


def build_config(args: argparse.Namespace, skip: tuple[str, ...] = (), sets: dict[str, Any] | None = None
                 ) -> RunConfig:
    """defaults → --config file → flags → --set (``sets`` instead when given), then validation."""
    cfg = RunConfig()
    if args.config:
        cfg = apply(cfg, config_file(args.config))
    flags = {key: getattr(args, key) for _, (key, _, _) in FLAGS.items()
             if key not in skip and getattr(args, key, None) is not None}
    cfg = apply(cfg, flags)
    if getattr(args, "alpha", None) is not None:
        cfg = apply(cfg, {"partition_options.alpha": args.alpha})
    for k, v in (parse_sets(args.sets) if sets is None else sets).items():
        cfg = apply(cfg, {k: v})  # one at a time so a namespace chosen earlier (e.g. algorithm) is respected
    return validate(cfg)


def _default_out(cfg: RunConfig, prefix: str) -> str:
    from fedfuse.data.flower_datasets import dataset_label

    return str(Path("runs") / f"{prefix}-{dataset_label(cfg.dataset)}-{time.strftime('%Y%m%d-%H%M%S')}")


def _logs(args: argparse.Namespace) -> list[str]:
    return [x.strip() for x in (getattr(args, "log", "") or "").split(",") if x.strip()]


def cmd_run(args: argparse.Namespace) -> int:
    from fedfuse.runner import execute

    if args.seeds or args.grid:
        if args.resume:
            raise ConfigError("--resume continues one run; a sweep (--seeds/--grid) resumes by running it again")
        return _sweep(args, algorithms=None)
    if args.resume:
        cfg = resume_config(args, build_config)
    else:
        cfg = build_config(args)
        if not cfg.out:
            cfg.out = _default_out(cfg, cfg.algorithm)
            _say_where_a_rerun_goes(args, cfg.out)
        prepare_run_dir(cfg.out, overwrite=args.overwrite)
    try:
        res = execute(cfg, progress=not args.no_progress, log=_logs(args), resume=bool(args.resume))
    except KeyboardInterrupt:
        if (Path(cfg.out) / CHECKPOINT).exists():
            print(f"fedfuse: interrupted; continue with: fedfuse run --resume {cfg.out}", file=sys.stderr)
            raise SystemExit(130) from None
        raise
    print(results_table(res.summary, res.history))
    print(f"outputs in {res.out}")
    return 0


def _say_where_a_rerun_goes(args: argparse.Namespace, out: str) -> None:
    """``--config`` of an earlier run (its ``config.yaml`` or a copy): say that its ``out`` was not reused."""
    from fedfuse.configfile import load_yaml, stale_out

    earlier = stale_out(load_yaml(args.config), args.config) if args.config else None
    if earlier:
        print(f"fedfuse: {args.config} names out {earlier}, an earlier run's directory; this run writes to {out} "
              "(--out chooses another)", file=sys.stderr)


def _sweep(args: argparse.Namespace, algorithms: list[str] | None) -> int:
    """run --seeds/--grid and compare: plan, execute (cached, maybe parallel), print and write the table."""
    import os

    from fedfuse.report import write_compare
    from fedfuse.stats import parse_seeds
    from fedfuse.sweep import Sweep, parse_grid

    sets = parse_sets(args.sets)
    top = {k: v for k, v in sets.items() if k in RunConfig.__dataclass_fields__}
    options = {k: v for k, v in sets.items() if k not in top}  # each algorithm that has them (Sweep.plan)
    base = build_config(args, skip=("algorithm",) if algorithms else (), sets=top)
    try:
        seeds = parse_seeds(args.seeds) if args.seeds else [base.seed]
    except UserError as e:
        raise ConfigError(str(e)) from None
    if args.jobs < 1:
        raise ConfigError(f"--jobs: must be >= 1, got {args.jobs}")
    grid = parse_grid(args.grid)
    root = Path(base.out or _default_out(base, "compare" if algorithms else f"sweep-{base.algorithm}"))
    store = args.store or (root / "runs" if base.out else os.environ.get("FEDFUSE_STORE", "runs/store"))
    base.out = None
    sw = Sweep.plan(algorithms, base, seeds=seeds, grid=grid, **options)
    try:
        sw.execute(out=root, store=store, jobs=args.jobs, rerun=args.rerun, progress=not args.no_progress,
                   log=_logs(args), verbose=True)
    except KeyboardInterrupt:
        print("fedfuse: interrupted; run the same command again: finished runs are reused from the store and an "
              "interrupted one resumes from its checkpoint", file=sys.stderr)
        raise SystemExit(130) from None
    table = sw.table(baseline=args.baseline, metric=args.metric, last=args.last, target=args.target,
                     test=args.test)
    write_compare(table, root, plots=base.plots)
    md = table.to_markdown()
    print(md)
    print(f"outputs in {root}" + (f" (report: {root / 'report.md'})" if base.plots else ""))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    names = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if not names:
        raise ConfigError("--algorithms: give a comma-separated list, e.g. fedavg,fedprox,local")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--algorithms: {', '.join(twice)} listed more than once; each algorithm runs once "
                          "(compare options of one algorithm with --grid)")
    return _sweep(args, algorithms=names)


def cmd_show(args: argparse.Namespace) -> int:
    from fedfuse.catalog import catalog, find

    try:
        comps = find(args.name, args.kind, catalog())
    except KeyError as e:
        raise ConfigError(e.args[0]) from None
    print("\n\n".join(c.format() for c in comps))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from fedfuse.report import write_report

    if not Path(args.dir).is_dir():
        raise ConfigError(f"report: {args.dir} is not a directory")
    try:
        md = write_report(args.dir, metric=args.metric, last=args.last, target=args.target,
                          baseline=args.baseline, test=args.test)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    print(f"wrote {md} and {md.with_suffix('.html')}")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    from fedfuse.data.report import partition_table, plot_partition
    from fedfuse.engine.assemble import build_federation

    cfg = build_config(args)
    fed = build_federation(cfg)
    print(partition_table(fed))
    from fedfuse.data.flower_datasets import dataset_label

    png = Path(args.png or f"partition-{dataset_label(cfg.dataset)}-{cfg.partition.replace(':', '-')}.png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_partition(fed, png)
    print(f"wrote the plot to {png.resolve()}")
    return 0


def cmd_export_partitions(args: argparse.Namespace) -> int:
    from fedfuse.data.export import export_partitions

    cfg = build_config(args)
    if not cfg.out:
        raise ConfigError("export-partitions: give the output directory with --out DIR")
    if args.nodes:  # one bundle per SuperNode, each holding only its clients
        from fedfuse.engine.assemble import build_federation
        from fedfuse.flower.node_data import write_node_bundles

        fed = build_federation(cfg)
        try:
            paths = write_node_bundles(fed, cfg.out, args.nodes, overwrite=args.overwrite,
                                       meta={"seed": cfg.seed, "partition": cfg.partition,
                                             "val_fraction": cfg.val_fraction}, config=cfg)
        except FileExistsError as e:
            raise ConfigError(str(e)) from None
        for k, p in enumerate(paths):
            held = [c.cid for c in fed.clients if c.cid % args.nodes == k]
            print(f"wrote {p} (clients {held}): start its SuperNode with --node-config \"data='{p.resolve()}'\"")
        return 0
    try:
        out = export_partitions(cfg, cfg.out, overwrite=args.overwrite)
    except FileExistsError as e:
        raise ConfigError(str(e)) from None
    print(f"wrote {out} (Hugging Face DatasetDict: train with partition_id, test) and {out / 'README.md'}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from fedfuse.catalog import catalog, listing

    for title, items in listing(catalog()).items():
        if args.what and args.what != title:
            continue
        print(f"{title}:")
        width = max(len(k) for k in items)
        for k, c in items.items():
            print(f"  {k:<{width}}  {c.description}")
            if title != "algorithms":  # their options in one short line (fedfuse show NAME: types, defaults, help)
                names = [o.name for o in c.options]
                print(f"  {'':<{width}}    options: {', '.join(names) if names else '(none)'}")
        print()
    print("fedfuse show NAME prints a name's options with types, defaults and one help line each.")
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from fedfuse.reproduce import available
    from fedfuse.reproduce.preset import run

    family = available()[args.name]
    default_out = f"runs/reproduce-{args.name}" + ("-quick" if args.quick else "")
    rc = run(family, args, reuse=bool(args.reuse), default_out=default_out, name=args.name)
    if rc == 0 and args.out and not args.no_report:
        from fedfuse.report import write_report

        try:
            md = write_report(args.out, title=f"reproduce {args.name}")
            print(f"wrote {md} and {md.with_suffix('.html')}")
        except Exception as e:  # the reproduction's own tables are written; the report is an extra view
            print(f"fedfuse: warning: no report for {args.out}: {type(e).__name__}: {e}", file=sys.stderr)
    return rc


def cmd_bench(args: argparse.Namespace) -> int:
    """``fedfuse bench``: run the missing runs of the matrix, render it to OUT/matrix.md (+ figures), and with
    ``--record TABLE`` write a record per run into results/records/TABLE/."""
    from fedfuse import benchmark, records
    from fedfuse.bench_report import blocks as bench_blocks
    from fedfuse.bench_report import render_benchmark, write_figures, write_html
    from fedfuse.reproduce.preset import run

    name = "quick" if args.quick else args.scale
    default_out = f"runs/bench-{name}"
    rc = run(benchmark.FAMILY, args, reuse=not args.fresh, default_out=default_out)
    out = Path(args.out or default_out)
    table = args.record or f"bench-{benchmark.SCALES[name].dataset}"
    recs = _bench_records(out, table, {} if args.lr is None else {"lr": f"{args.lr:g}"})
    sections = []
    for track in ("single", "width"):
        spec = {**benchmark.spec(name, track), "id": table + ("-width" if track == "width" else ""),
                "figures": "figures"}
        if any(r["cell"]["track"] == track for r in recs):
            write_figures(spec, recs, out / "figures")
            sections.append((f"{track} track", spec))
    (out / "matrix.md").write_text("\n\n".join(f"## {h}\n\n{render_benchmark(sp, recs)}" for h, sp in sections)
                                   + "\n")
    write_html([(h, bench_blocks(sp, recs)) for h, sp in sections], out / "matrix.html", "fedfuse bench")
    print(f"wrote {out / 'matrix.md'} and {out / 'matrix.html'}")
    if args.record:
        root = Path(args.root) if args.root else records.repo_root()
        paths = [records.write_record(root, r) for r in recs]
        print(f"recorded {len(paths)} runs into {root / 'results' / 'records' / table}; render the docs with "
              "`fedfuse results render`")
    return rc


def _bench_records(out: Path, table: str, extra: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """A record (:func:`fedfuse.records.make_record`) of every run of a bench output (``OUT/results.json``);
    cell = ``{dataset, regime, track, method}`` from the bench table id ``DATASET-REGIME[-width]``, and ``extra``
    (``--lr``: ``{"lr": "0.2"}``, so runs of one cell at several rates are rows of one table)."""
    from fedfuse.records import make_record

    recs = []
    for tid, tab in json.loads((out / "results.json").read_text()).items():
        dataset, _, rest = tid.partition("-")
        track = "width" if rest.endswith("-width") else "single"
        regime = rest.removesuffix("-width")
        for method, runs in tab["runs"].items():
            cell = {"dataset": dataset, "regime": regime, "track": track, "method": method, **(extra or {})}
            recs += [make_record(r["dir"], table, cell) for r in runs]
    return recs


def _cell_arg(text: str) -> dict[str, str]:
    """``method=msfusion,mu=0.125`` → {"method": "msfusion", "mu": "0.125"}."""
    out = {}
    for part in (x for x in text.split(",") if x.strip()):
        k, sep, v = part.partition("=")
        if not sep:
            raise SystemExit(f"fedfuse results: --cell wants key=value pairs, got {part!r}")
        out[k.strip()] = v.strip()
    return out


def _typed(v: str) -> Any:
    try:
        return json.loads(v)
    except ValueError:
        return v


def cmd_results(args: argparse.Namespace) -> int:
    from fedfuse import records

    root = Path(args.root) if args.root else records.repo_root()
    if args.action == "render":
        return _results_render(args, root)
    if args.action == "record":
        return _results_record(args, root)
    if args.action == "list":
        return _results_list(root)
    return _results_verify(args, root)


def _results_render(args: argparse.Namespace, root: Path) -> int:
    """``results render [--check]``: regenerate (or compare) every results table from its records."""
    from fedfuse import records

    changed = records.render(root, check=args.check)
    for p in changed:
        print(f"{'differs' if args.check else 'rendered'}: {p}")
    if args.check and changed:
        print("fedfuse results render --check: tables differ from their records; run `fedfuse results "
              "render`", file=sys.stderr)
        return 1
    docs, tables, rows = records.rendered_blocks(root)
    what = (f"{tables} table{'s' if tables != 1 else ''} ({rows} rows) in {docs} document{'s' if docs != 1 else ''},"
            f" from {len(records.all_records(root))} records")
    if args.check:
        print(f"checked {what}: all match")
    else:
        print(f"{what}: {len(changed)} document{'s' if len(changed) != 1 else ''} rewritten")
    return 0


def _results_record(args: argparse.Namespace, root: Path) -> int:
    """``results record``: one record per finished run directory."""
    from fedfuse import records

    cell = {k: _typed(v) for k, v in _cell_arg(args.cell).items()}
    fed = json.loads(args.federation) if args.federation else None
    for d in args.run_dirs:
        rec = records.make_record(d, args.table, cell, args.commit, fed)
        print(records.write_record(root, rec))
    return 0


def _results_list(root: Path) -> int:
    """``results list``: every table with its record and stale counts."""
    from fedfuse import records

    for table, count, stale in records.table_counts(root):
        print(f"{table}: {count} records, {stale} stale")
    return 0


def _results_verify(args: argparse.Namespace, root: Path) -> int:
    """``results verify``: re-run one record (or check what can be checked of one that cannot be re-run) and print
    recorded against now; the exit status names the outcome (:data:`fedfuse.verify.EXIT`), 2 a refusal (no
    matching record, a LoRA record without its base's digest: one ``fedfuse: error:`` line)."""
    try:
        return _verify_one(args, root)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        msg = e.code.removeprefix("fedfuse results verify: ").removeprefix("fedfuse results: ")
        print(f"fedfuse: error: {msg}", file=sys.stderr)
        return 2


def _verify_one(args: argparse.Namespace, root: Path) -> int:
    import random

    from fedfuse import records, verify

    found = records.matching(root, args.table, _cell_arg(args.cell or ""), args.seed)
    if args.random is None:
        path, rec = found[0]
    else:
        eligible = [(p, r) for p, r in found if verify.not_rerunnable(r) is None]
        skipped = len(found) - len(eligible)
        print(f"picking at random among {len(eligible)} re-runnable record{'s' if len(eligible) != 1 else ''} "
              f"of {len(found)} matching" + (f"; {skipped} not eligible: central DP, whose noise and client "
                                             "sampling are OS randomness by design" if skipped else ""))
        if not eligible:
            print("nothing to re-run: pick one of them explicitly (--table/--cell/--seed without --random) to "
                  "check its config hash and ε")
            return verify.EXIT["not re-runnable"]
        path, rec = random.Random(args.random).choice(eligible)
    stale = records.stale_reason(rec)
    print(f"verifying {path} (table {rec['table']}, cell {rec['cell']}, seed {rec['seed']}, recorded on commit "
          f"{rec['commit'][:12]}{'; ' + stale if stale else ''})", flush=True)
    res = verify.assess(rec, args.data_dir or os.environ.get("FEDFUSE_DATA"), args.tol)
    if verify.not_rerunnable(rec) is not None:  # its exact checks: (check, recorded, now, equal)
        for name, a, b, ok in res.rows:
            said = "unchecked" if ok is None else "equal" if ok else "DIFFERS"
            print(f"  {name:28s} recorded {a!s:>22}  now {b!s:>22}  {said}")
    else:
        shown = res.rows if args.all_metrics else [r for r in res.rows if verify.is_table_metric(r[0], rec)]
        width = max([28, *(len(r[0]) for r in shown)])
        for name, a, b, d in shown:
            diff = "—" if d is None else f"{d:+.3g}"
            print(f"  {name:{width}s} recorded {a!s:>22}  now {b!s:>22}  difference {diff}")
    print(res.message)
    return res.exit_status


def _add_results(sub) -> None:
    rs = sub.add_parser("results", help="result records: render the docs' tables from them, verify a cell",
                        description="Every results table in README/docs between '<!-- results: ID -->' and "
                                    "'<!-- /results -->' is generated from the records in results/records/ID/ "
                                    "(one JSON per run and seed) by the spec results/tables/ID.json.")
    rs.add_argument("--root", default=None, help="repository root (default: the one holding results/)")
    acts = rs.add_subparsers(dest="action", required=True, metavar="ACTION")
    r = acts.add_parser("render", help="regenerate every results table from its records")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table differs")
    rec = acts.add_parser("record", help="add the records of finished run directories to a table")
    rec.add_argument("--table", required=True, help="table id (results/tables/ID.json)")
    rec.add_argument("--cell", required=True, help="the row's keys, e.g. method=msfusion,mu=0.125")
    rec.add_argument("--commit", default=None, help="the fedfuse commit the runs ran on (default: HEAD)")
    rec.add_argument("--federation", default=None,
                     help='JSON of a federation the config does not rebuild, e.g. {"kind": "truncated", '
                          '"seqs": 100, "test": 400}')
    rec.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="finished run directories (one per seed)")
    li = acts.add_parser("list", help="tables with their record and stale counts")
    li.set_defaults()
    v = acts.add_parser("verify", help="re-run one record at its recorded config and report the difference",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Re-run one record at its recorded config with today's code and compare every "
                                    "table metric with what it recorded.",
                        epilog="exit status:\n"
                               "  0  reproduced bit for bit (or within a --tol above 0)\n"
                               "  1  NOT reproduced: a difference on the float kernels the record was made with; "
                               "or a\n     record that cannot be re-run whose config hash or ε no longer "
                               "checks out\n"
                               "  2  refused or usage error (no matching record, a LoRA record without its base's "
                               "digest)\n"
                               "  3  not re-runnable bit for bit: central DP draws its noise and client sampling "
                               "from\n     OS randomness by design; its config hash and ε were checked and are "
                               "equal\n"
                               "  4  differs, on a record made with other float kernels (torch version, CPU "
                               "capability,\n     machine) or unknown ones: exact re-runs need the same kernels\n")
    v.add_argument("--table", default=None, help="only records of this table")
    v.add_argument("--cell", default=None, help="only records whose cell has these values, e.g. method=msfusion")
    v.add_argument("--seed", type=int, default=None, help="only this seed")
    v.add_argument("--random", type=int, default=None, metavar="PICK",
                   help="pick a random matching record that can be re-run bit for bit (PICK seeds the choice; "
                        "central-DP records are skipped and counted)")
    v.add_argument("--data-dir", default=None, help="where the datasets are (default: $FEDFUSE_DATA)")
    v.add_argument("--tol", type=float, default=0.0,
                   help="largest accepted difference of a table metric (default 0: bit for bit)")
    v.add_argument("--all-metrics", action="store_true", help="print every recorded metric, not only the table's")
    rs.set_defaults(func=cmd_results)


def _add_reproduce(sub) -> None:
    from fedfuse.reproduce import available
    from fedfuse.reproduce.common import add_seed_argument

    rp = sub.add_parser("reproduce", **LAZY["reproduce"])
    names = rp.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, family in available().items():
        p = names.add_parser(name, help=family.description, description=family.description)
        p.add_argument("--quick", action="store_true",
                       help="a smoke test of the whole table: <= 3 minutes of CPU (docs give each one's time)")
        p.add_argument("--data-dir", default=None, help="where the datasets are (default: $FEDFUSE_DATA)")
        p.add_argument("--out", default=None, help="output directory")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        p.add_argument("--reuse", action="store_true",
                       help="keep runs already finished in --out with the same config, resume interrupted ones "
                            "(after a code change, run without it)")
        p.add_argument("--no-report", action="store_true",
                       help="do not write report.md/report.html over the runs below --out afterwards (written "
                            "when --out is given)")
        add_seed_argument(p, family.seeds, family.quick_seeds)
        if family.add_arguments is not None:
            family.add_arguments(p)
        _fill_help(p, f"see docs/{family.docs or name.split('-')[0]}.md")
        p.set_defaults(func=cmd_reproduce)


def _add_bench(sub: Any) -> None:
    from fedfuse.benchmark import FAMILY
    from fedfuse.reproduce.common import add_seed_argument

    p = sub.add_parser("bench", **LAZY["bench"])
    p.add_argument("--quick", action="store_true",
                   help="3 methods x 2 regimes x 2 seeds on the bundled digits, a few CPU-minutes (smoke test)")
    p.add_argument("--data-dir", default=None, help="where the datasets are (default: $FEDFUSE_DATA)")
    p.add_argument("--out", default=None, help="output directory (default: runs/bench-SCALE)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--fresh", action="store_true",
                   help="re-run every run (default: keep finished runs of the same config below --out, resume "
                        "interrupted ones)")
    p.add_argument("--record", default=None, metavar="TABLE",
                   help="write a record per run into results/records/TABLE/ (docs/benchmark.md renders "
                        "bench-mnist, bench-cifar10, bench-femnist)")
    p.add_argument("--root", default=None, help="repository root for --record (default: the one holding results/)")
    add_seed_argument(p, FAMILY.seeds, FAMILY.quick_seeds)
    FAMILY.add_arguments(p)
    p.set_defaults(func=cmd_bench, plots=False)


_GENERIC_HELP = {"seed": "seed of a single-seed run", "part": "which part of the reproduction to run",
                 "batch_size": "mini-batch size", "seq_len": "sequence length", "device": "cpu, cuda or cuda:N",
                 "threads": "torch intra-op threads"}


def _fill_help(p: argparse.ArgumentParser, fallback: str) -> None:
    """A flag that a plug-in parser (reproduction, pretrain) registered without help still gets one line."""
    for a in p._actions:
        if not a.help:
            a.help = _GENERIC_HELP.get(a.dest, fallback)
            if a.default not in (None, False, ""):
                a.help += " (default: %(default)s)"


EPILOG = """examples:
  fedfuse run                                    FedAvg on the bundled digits (no download)
  fedfuse run --algorithm fedprox --set mu=0.1 --rounds 50
  fedfuse compare --algorithms fedavg,fedprox --seeds 3 --set fedprox.mu=0.1
  fedfuse run --algorithm fedprox --grid lr=0.01,0.05 --grid mu=0.1,0.25 --seeds 3 --jobs 2
  fedfuse show fedprox                           options of an algorithm, model, dataset or partition
  fedfuse report runs/compare-digits-...         Markdown + HTML page with table, curves, diagnostics
"""


#: commands whose arguments are registered by modules that import torch (the reproductions' presets, the LoRA
#: pretraining): their help and description, so the parser of any other command can list them without those imports
LAZY: dict[str, dict[str, str]] = {
    "reproduce": {"help": "re-run a paper comparison on real data (see docs/)",
                  "description": "Re-run a paper's comparison on real data; each writes Markdown tables and plots "
                                 "to its output directory."},
    "bench": {"help": "the benchmark matrix: methods x heterogeneity regimes x seeds (docs/benchmark.md)",
              "description": "Plan the matrix of docs/benchmark.md (methods x regimes x seeds), run what is "
                             "missing (cached by config hash, resumable, --jobs), write OUT/matrix.md with "
                             "figures; --record TABLE records every run for `fedfuse results render`."},
    "pretrain": {"help": "pretrain the base character LM for LoRA runs on WikiText-2 + PTB (cached)"},
}


def _lazy(sub: Any, name: str, command: str | None, add: Any) -> None:
    """Add command ``name`` with ``add(sub)`` when every command is built or it is ``command``; else as a
    placeholder with its :data:`LAZY` help (never parsed: argparse parses only the chosen command)."""
    if command is None or command == name:
        add(sub)
    else:
        sub.add_parser(name, **LAZY[name])


def _add_pretrain(sub: Any) -> None:
    from fedfuse.adapters.cli import add_pretrain_parser

    add_pretrain_parser(sub)
    _fill_help(sub.choices["pretrain"], "see docs/lora.md")


def command_word(argv: list[str]) -> str:
    """The command of a ``fedfuse`` command line: its first word that is not an option (``""`` when none); the
    top-level options (``--debug``, ``--help``) take no value."""
    return next((a for a in argv if not a.startswith("-")), "")


class FedfuseParser(argparse.ArgumentParser):
    """argparse with fedfuse's errors: one line, ``fedfuse: error: MESSAGE (see 'fedfuse CMD --help')``, exit 2,
    without the usage block; an unknown option or choice gets the closest known ones (:mod:`fedfuse.names`)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"fedfuse: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = _chosen(self, ns)
            chosen.error(unrecognized(extras, [s for a in chosen._actions for s in a.option_strings]))
        return ns

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            from fedfuse.names import unknown

            what = "command" if isinstance(action, argparse._SubParsersAction) else "choice"
            raise argparse.ArgumentError(action, unknown(what, str(value), [str(c) for c in action.choices]))


def _chosen(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser ``ns`` was parsed by: ``fedfuse results verify`` → the ``verify`` parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(ns, action.dest, None) in action.choices:
            return _chosen(action.choices[getattr(ns, action.dest)], ns)
    return parser


def unrecognized(extras: list[str], options: list[str]) -> str:
    """The message for arguments no parser took: each unknown option with the closest known ones (``--rouns``:
    did you mean --rounds?); the words after an unknown option are its value, so only options are named when
    there are any."""
    from fedfuse.names import did_you_mean

    flags = [x for x in extras if x.startswith("-") and x != "-"]
    if not flags:
        return f"unrecognized argument{'s' if len(extras) > 1 else ''} {' '.join(extras)}"
    hints = {flag: did_you_mean(flag.split("=", 1)[0], options, n=1) for flag in flags}
    if len(flags) == 1:
        return f"unrecognized argument {flags[0]}" + (f"; {hints[flags[0]]}" if hints[flags[0]] else "")
    return "unrecognized arguments: " + ", ".join(f"{f} ({h})" if h else f for f, h in hints.items())


def make_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``fedfuse`` parser, every command complete; with ``command`` (what :func:`main` passes: the command
    word of its arguments, ``""`` for none) the commands of :data:`LAZY` other than ``command`` get their help
    line only, so ``fedfuse --help``, ``fedfuse run ...``, ``list`` and ``show`` import no torch."""
    p = FedfuseParser(prog="fedfuse", description="Federated learning beyond plain averaging.",
                      epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"fedfuse {package_version()}",
                   help="print fedfuse's version (from the installed package's metadata) and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    r = sub.add_parser("run", help="run one experiment (no arguments: a small FedAvg run on bundled digits)",
                       description="Run one experiment, or one configuration over several seeds / a grid of "
                                   "options (--seeds, --grid), and print its results.")
    _add_run_flags(r)
    r.add_argument("--resume", default=None, metavar="DIR", help="continue the run in DIR from its checkpoint")
    _add_log_flag(r)
    _add_sweep_flags(r, compare=False)
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("compare", help="run several algorithms on the same partitions and seeds; table with stats",
                       description="Run several algorithms on the same partition and seed(s); print mean ± std "
                                   "over seeds and a paired test against a baseline. Runs are cached by config "
                                   "hash, so adding seeds or grid values runs only the new runs.")
    c.add_argument("--algorithms", required=True, help="comma-separated, e.g. fedavg,fedprox,local,fedavg-ft; "
                   "--set OPTION=VALUE applies to every one that has OPTION, --set ALGO.OPTION=VALUE to ALGO only")
    _add_run_flags(c, with_algorithm=False)
    _add_log_flag(c)
    _add_sweep_flags(c, compare=True)
    c.set_defaults(func=cmd_compare)
    q = sub.add_parser("partition", help="print per-client sizes and label histograms; write a PNG",
                       description="Print per-client sizes and label histograms of a partition; write a PNG.")
    _add_run_flags(q)
    q.add_argument("--png", default=None, help="where to write the plot (default: partition-DATASET-PARTITION.png)")
    q.set_defaults(func=cmd_partition)
    ex = sub.add_parser("export-partitions", help="write a dataset's partition as a Hugging Face DatasetDict "
                        "(partition_id column) for Flower pipelines",
                        description="Write the clients of --dataset/--partition/--clients/--seed to --out as a "
                                    "Hugging Face DatasetDict (train: x, label, partition_id, sample_id; test) "
                                    "with a README; Flower reads it with NaturalIdPartitioner('partition_id').")
    _add_run_flags(ex)
    ex.add_argument("--nodes", type=int, default=0, metavar="N",
                    help="write OUT/node-K/ bundles instead, one per SuperNode (client c on node c %% N), each with "
                         "its clients' train/validation/test tensors only")
    ex.set_defaults(func=cmd_export_partitions)
    _lazy(sub, "reproduce", command, _add_reproduce)
    _lazy(sub, "bench", command, _add_bench)
    _add_results(sub)
    _lazy(sub, "pretrain", command, _add_pretrain)
    from fedfuse.flower.deploy import add_flower_app_parser

    add_flower_app_parser(sub)
    li = sub.add_parser("list", help="list algorithms, datasets, partitions and models",
                        description="List algorithms, datasets, partitions and models with one line each.")
    li.add_argument("what", nargs="?", choices=["algorithms", "datasets", "partitions", "models"],
                    help="only this section")
    li.set_defaults(func=cmd_list)
    sh = sub.add_parser("show", help="options of an algorithm, model, dataset or partition: type, default, help",
                        description="Print the options a configuration accepts for NAME, with types, defaults "
                                    "and help, from the same declarations that validate configs. "
                                    "'fedfuse show config' lists the top-level keys.")
    sh.add_argument("name", help="an algorithm, model, dataset or partition name, or 'config'")
    sh.add_argument("--kind", choices=["algorithm", "model", "dataset", "partition", "config"], default=None,
                    help="only this kind, when a name is used by several")
    sh.set_defaults(func=cmd_show)
    rep = sub.add_parser("report", help="write report.md and report.html for a run or sweep directory",
                         description="Write DIR/report.md and DIR/report.html: config, statistics table, one "
                                     "figure per metric (mean ± std over seeds), partition plot and the "
                                     "algorithms' own diagnostics.  DIR is a run, a compare/sweep output, or any "
                                     "directory with runs below it.")
    rep.add_argument("dir", metavar="DIR", help="run, sweep or reproduction output directory")
    rep.add_argument("--baseline", default=None, help="label the others are tested against (default: the first)")
    rep.add_argument("--metric", default="auto", help="accuracy compared (default auto)")
    rep.add_argument("--last", type=int, default=5, help="final = mean of the last K evaluations (default 5)")
    rep.add_argument("--target", type=float, default=None, help="target accuracy (0-1) for the *-to-target columns")
    rep.add_argument("--test", choices=("t", "wilcoxon"), default="t", help="paired test over seeds")
    rep.set_defaults(func=cmd_report)
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    for command in sub.choices.values():  # also accepted after the command: fedfuse run --debug ...
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return p


DEBUG_HELP = "print the traceback of an internal error (a bug in fedfuse) on screen"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = make_parser(command_word(argv)).parse_args(argv)
    before = os.environ.get("FEDFUSE_DEBUG")
    if args.debug:  # an environment variable, so worker processes see it too
        os.environ["FEDFUSE_DEBUG"] = "1"
    try:
        return run_guarded(lambda: int(args.func(args)))
    finally:
        if args.debug:
            if before is None:
                os.environ.pop("FEDFUSE_DEBUG", None)
            else:
                os.environ["FEDFUSE_DEBUG"] = before


if __name__ == "__main__":
    sys.exit(main())
