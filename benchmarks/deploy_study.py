"""A multi-node study as a user runs one: a TLS SuperLink and five SuperNodes on loopback, each holding only its own
exported partition, FedAvg and FedMR on MNIST, one node killed mid-run and brought back.

    python benchmarks/deploy_study.py --data-dir ../shared/data --out /tmp/deploy-study \
        [--nodes 5] [--clients 10] [--rounds 20] [--algorithms fedavg,fedmr] [--kill-after 6] [--down 4] \
        [--round-timeout 60] [--node-poll 0.1]

For every algorithm: ``fedfuse export-partitions --nodes`` bundles (client c on node c mod N), a Flower app
(``fedfuse flower-app``'s ``write_app``), ``flwr run``; once round ``--kill-after`` is written, SuperNode 2 and its
worker are SIGKILLed (a device that dies), and ``--down`` rounds later it is started again with the same key and
data.  Each run writes the same ``metrics.jsonl`` / ``summary.json`` as an in-process run (``OUT/ALGO/deployed``);
the in-process run of the same config is written next to it (``OUT/ALGO/in-process``) and the script prints, round
by round, both runs' sampled/replied/dropped clients and global accuracy, and whether the rounds before the kill
are equal (they are: the nodes hold exactly the in-process clients' data, and sampling among present clients is
the in-process sampling while every node is up).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def config(algorithm: str, args: Any) -> dict[str, Any]:
    return dict(algorithm=algorithm, dataset="mnist", data_dir=args.data_dir, partition="dirichlet",
                partition_options={"alpha": 0.5}, dataset_options={"train_limit": 600 * args.clients},
                model="mlp", model_options={"widths": [200]}, clients=args.clients, clients_per_round=args.clients,
                rounds=args.rounds, local_epochs=1, batch_size=50, lr=0.05, eval_every=5, threads=1, seed=0,
                plots=False, device="cpu")


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def study(algorithm: str, args: Any, out: Path) -> bool:
    from fedfuse.config import dump_yaml, make_config
    from fedfuse.engine.loop import build_federation, strip_timing
    from fedfuse.flower.deploy import write_app
    from fedfuse.flower.federation import LocalFederation
    from fedfuse.flower.node_data import write_node_bundles
    from fedfuse.runner import experiment

    d = out / algorithm
    d.mkdir(parents=True, exist_ok=True)
    cfg = make_config(config(algorithm, args))
    dump_yaml(cfg, d / "config.yaml")
    bundles = write_node_bundles(build_federation(cfg), d / "bundles", args.nodes, overwrite=True)
    app = write_app(d / "app", d / "config.yaml", out=d / "deployed", round_timeout=args.round_timeout,
                    min_nodes=args.nodes)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p),
           "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    victim = min(2, args.nodes - 1)
    events = []
    t0 = time.time()
    with LocalFederation(d / "fed", nodes=args.nodes, warm=True, env=env, node_poll=args.node_poll,
                         node_config=[f"data='{b}'" for b in bundles]) as fed:
        run_id = fed.run(app)
        metrics = d / "deployed" / "metrics.jsonl"
        killed = restarted = False
        while fed.streaming(run_id):
            done = len(records(metrics))
            if not killed and done >= args.kill_after:
                fed.kill(victim)
                killed = True
                events.append(f"after round {done}: SuperNode {victim} (clients "
                              f"{[c for c in range(args.clients) if c % args.nodes == victim]}) killed")
                print(events[-1], flush=True)
            if killed and not restarted and done >= args.kill_after + args.down:
                node_id = fed.restart(victim)
                restarted = True
                events.append(f"after round {done}: SuperNode {victim} back (node id {node_id})")
                print(events[-1], flush=True)
            time.sleep(0.2)
        status = fed.wait(run_id, timeout=600)
    deployed = records(d / "deployed" / "metrics.jsonl")
    print(f"{algorithm}: deployed run {status} in {time.time() - t0:.0f} s; in-process run of the same config ...",
          flush=True)
    exp = experiment(make_config(str(d / "config.yaml"), out=str(d / "in-process"), executor="sequential"))
    exp.run()
    local = records(d / "in-process" / "metrics.jsonl")
    print(f"\n{algorithm} ({args.nodes} SuperNodes, {args.clients} clients; {'; '.join(events)})")
    print("| round | deployed: replied / dropped | deployed global acc | in-process global acc | equal |")
    print("|---|---|---|---|---|")
    same_before = True
    for a, b in zip(deployed, local, strict=False):
        eq = strip_timing(a) == strip_timing(b)
        if a["round"] <= args.kill_after:
            same_before &= eq
        acc_a, acc_b = a.get("global_accuracy"), b.get("global_accuracy")
        print(f"| {a['round']} | {a['replied']} / {a['dropped']} | {'' if acc_a is None else f'{acc_a:.4f}'} | "
              f"{'' if acc_b is None else f'{acc_b:.4f}'} | {'yes' if eq else 'no'} |")
    print(f"rounds 1..{args.kill_after} (all nodes up) equal to the in-process run: {same_before}; "
          f"deployed rounds: {len(deployed)} of {args.rounds}")
    return status == "finished:completed" and len(deployed) == args.rounds and same_before


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--algorithms", default="fedavg,fedmr")
    p.add_argument("--kill-after", type=int, default=6, help="kill a SuperNode once this round is written")
    p.add_argument("--down", type=int, default=4, help="rounds the node stays down")
    p.add_argument("--round-timeout", type=float, default=60.0)
    p.add_argument("--node-poll", type=float, default=0.1, help="SuperNode idle poll (fedfuse.flower.supernode)")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    ok = [study(a, args, out) for a in args.algorithms.split(",") if a]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
