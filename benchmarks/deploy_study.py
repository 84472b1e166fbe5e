"""A deployment whose server holds no dataset runs a FedAvg and a FedMR study with federated evaluation, and each
equals the in-process run that evaluates the same way (#40's Done-when), as docs/deploy.md deploys it on one machine.

    python benchmarks/deploy_study.py --data-dir ../shared/data --out /tmp/deploy-study \
        [--nodes 5] [--clients 10] [--per-client 600] [--rounds 10] [--algorithms fedavg,fedmr] \
        [--round-timeout 600] [--node-poll 0.1]

This script plays the machine that holds MNIST: it exports one bundle per device (``export-partitions --nodes``:
client c on device c mod N).  The deployment is the documented one on loopback: a TLS SuperLink with a database
on its own port, the Fleet API gateway in front of it, ``--nodes`` authenticated SuperNodes with warm workers, each
given only its bundle, and an app signed by the operator's key that the devices verify.  Every process of the
deployment (the ServerApp included) gets an empty ``FEDFUSE_DATA``, the app's config an empty ``data_dir``, and
the ServerApp records every file it opens.  The in-process run of the same config (reading MNIST from
``--data-dir``, ``global_eval: federated`` as well) is written next to each deployed run.

Writes ``OUT/ALGO/{deployed,in-process}`` (metrics.jsonl, summary.json) and ``OUT/result.json``: per algorithm the
run's status, wall time, rounds, whether every round record is equal (timings aside), the final global accuracy of
both runs, and the MNIST/bundle files the ServerApp opened (none expected).  Exit status 0 iff every study is equal
and its server opened no data file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any


def config(algorithm: str, args: Any, data_dir: str) -> dict[str, Any]:
    """The study's config: MNIST, Dirichlet(0.5), ``--per-client`` training images a client, MLP 784-200-10."""
    return dict(algorithm=algorithm, dataset="mnist", data_dir=data_dir, partition="dirichlet",
                partition_options={"alpha": 0.5}, dataset_options={"train_limit": args.per_client * args.clients},
                model="mlp", model_options={"widths": [200]}, clients=args.clients, clients_per_round=args.clients,
                rounds=args.rounds, local_epochs=1, batch_size=50, lr=0.05, eval_every=args.eval_every, threads=1,
                seed=0, plots=False, device="cpu", global_eval="federated")


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def study(algorithm: str, args: Any, out: Path) -> dict[str, Any]:
    """Deploy one study and run it in process; the comparison as a JSON-able dict."""
    from fedfuse.config import dump_yaml, make_config
    from fedfuse.engine.loop import build_federation, strip_timing
    from fedfuse.flower.deploy import write_app
    from fedfuse.flower.federation import LocalFederation
    from fedfuse.flower.node_data import write_node_bundles
    from fedfuse.runner import experiment

    d = out / algorithm
    empty = d / "server-data"  # the server's data directory: empty before and after
    empty.mkdir(parents=True, exist_ok=True)
    local_cfg = make_config(config(algorithm, args, str(Path(args.data_dir).resolve())))
    bundles = write_node_bundles(build_federation(local_cfg), d / "bundles", args.nodes, config=local_cfg,
                                 overwrite=True)
    dump_yaml(make_config(config(algorithm, args, str(empty))), d / "server.yaml")
    app = write_app(d / "app", d / "server.yaml", out=d / "deployed", round_timeout=args.round_timeout,
                    min_nodes=args.nodes)
    audit = d / "serverapp.opened"
    audit.unlink(missing_ok=True)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p),
           "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "FEDFUSE_DATA": str(empty),
           "FEDFUSE_AUDIT_OPEN": str(audit)}
    t0 = time.time()
    with LocalFederation(d / "fed", nodes=args.nodes, warm=True, env=env, node_poll=args.node_poll, auth=True,
                         gateway=True, signed=True, database=True, audit_open=True,
                         node_config=[f"data='{b}'" for b in bundles]) as fed:
        status = fed.wait(fed.run(app), timeout=args.rounds * max(args.round_timeout, 60.0) + 600)
    deployed_s = time.time() - t0
    t0 = time.time()
    experiment(make_config(config(algorithm, args, local_cfg.data_dir), out=str(d / "in-process"),
                           executor="sequential")).run()
    local_s = time.time() - t0
    deployed, local = records(d / "deployed" / "metrics.jsonl"), records(d / "in-process" / "metrics.jsonl")
    unequal = [a["round"] for a, b in zip(deployed, local, strict=False) if strip_timing(a) != strip_timing(b)]
    held = [Path(args.data_dir).resolve() / "mnist", empty.resolve(), *(b.resolve() for b in bundles)]
    opened = {Path(p).resolve() for p in (audit.read_text().splitlines() if audit.exists() else []) if p}
    data_opened = sorted(str(p) for p in opened if any(p.is_relative_to(h) for h in held))

    def final(rs: list[dict[str, Any]], key: str) -> Any:
        return next((r[key] for r in reversed(rs) if r.get(key) is not None), None)

    res = {"status": status, "rounds": len(deployed), "equal": len(deployed) == args.rounds == len(local)
           and not unequal, "unequal_rounds": unequal, "deployed_seconds": round(deployed_s, 1),
           "in_process_seconds": round(local_s, 1),
           "final_global_accuracy": {"deployed": final(deployed, "global_accuracy"),
                                     "in_process": final(local, "global_accuracy")},
           "global_eval_clients": final(deployed, "global_eval_clients"),
           "serverapp_audited": bool(opened), "server_data_files_opened": data_opened,
           "server_data_dir_empty": not any(empty.iterdir())}
    print(f"{algorithm}: {json.dumps(res)}", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="where MNIST is (the exporting machine's, not the server's)")
    p.add_argument("--out", required=True)
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--per-client", type=int, default=600, help="MNIST training images per client")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=1, help="rounds between federated evaluations")
    p.add_argument("--algorithms", default="fedavg,fedmr")
    p.add_argument("--round-timeout", type=float, default=600.0)
    p.add_argument("--node-poll", type=float, default=0.1, help="SuperNode idle poll (fedfuse.flower.supernode)")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    studies = {a: study(a, args, out) for a in args.algorithms.split(",") if a}
    result = {"command": " ".join(["python", *sys.argv]), "args": vars(args), "host": platform.node(),
              "load_average": os.getloadavg(), "wall_seconds": round(time.time() - t0, 1), "studies": studies}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    ok = all(s["equal"] and s["status"] == "finished:completed" and s["serverapp_audited"]
             and not s["server_data_files_opened"] and s["server_data_dir_empty"] for s in studies.values())
    print(f"result: {out / 'result.json'}; every study equal, no data on the server: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
