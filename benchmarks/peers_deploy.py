"""``benchmarks/peers.py --deploy``: a deployed FedAvg round on loopback, fedfuse vs a plain Flower app.

Each variant starts its own federation (:class:`fedfuse.flower.federation.LocalFederation`: a TLS SuperLink and
``--nodes`` authenticated SuperNodes on 127.0.0.1), submits its app with ``flwr run`` and waits for the run:

- ``fedfuse-warm`` / ``plain-warm``: SuperNodes in ``--isolation process`` mode, each served by a long-running
  :mod:`fedfuse.flower.worker` (the ClientApp stays loaded: torch, data and model are paid once per run);
- ``fedfuse-cold`` / ``plain-cold``: Flower's default isolation, a fresh ``flwr-clientapp`` process per message;
- ``--node-poll S`` adds ``*-warm-poll`` variants whose SuperNodes run through :mod:`fedfuse.flower.supernode`,
  which caps flwr 1.41's fixed 3 s idle poll at S seconds.

Workload: ``--nodes`` clients × 600 MNIST training images (client c: images 600c … 600c+599), every client every
round, 1 local epoch, batch 50, SGD lr 0.05, the MLP 784-200-200-10.  fedfuse: ``fedavg`` with each node holding
its own client's bundle (``fedfuse export-partitions --nodes``: node-local data); plain Flower:
``benchmarks/flower_plain_app.py`` (``FedAvg.start``, its ClientApp reads its partition from a tensor file).

Timing: s/round = median over rounds 2 … R−1 (fedfuse: ``seconds`` of ``metrics.jsonl``; plain: the gaps between
``evaluate_fn`` stamps).  Breakdown of a warm round (medians): **client work** = the ClientApp call on the node;
**node transfer** = the worker pulling the message and its context from the SuperNode and pushing the reply
(deserialisation and serialisation included); **server work** (fedfuse) = the round minus its grid call (the
ServerApp's own work: sampling, payload encoding, aggregation, metrics); **polling/queueing** = what is left:
the SuperNode's wait for its next poll of the SuperLink (3 s fixed in flwr 1.41), the SuperLink's relaying, the
SuperNode's 0.5 s reply checks and the ServerApp's reply polling (fedfuse 0.05 s; ``Grid.send_and_receive``,
which ``FedAvg`` uses, 3 s).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

PER_CLIENT, EPOCHS, BATCH, LR = 600, 1, 50, 0.05


def _fedfuse_config(data_dir: str, nodes: int, rounds: int) -> dict[str, Any]:
    return dict(algorithm="fedavg", dataset="mnist", data_dir=data_dir, partition="contiguous", val_fraction=0.0,
                dataset_options={"train_limit": nodes * PER_CLIENT}, model="mlp",
                model_options={"widths": [200, 200]}, clients=nodes, clients_per_round=nodes, rounds=rounds,
                local_epochs=EPOCHS, batch_size=BATCH, lr=LR, eval_every=10_000, plots=False, device="cpu",
                threads=1, seed=0)


def _steady(values: list[float]) -> list[float]:
    return values[1:-1] if len(values) > 2 else values


def run_variant(name: str, root: Path, *, data_dir: str, nodes: int, rounds: int, env: dict[str, str],
                node_poll: float | None) -> dict[str, Any]:
    from fedfuse.config import dump_yaml, make_config
    from fedfuse.engine.loop import build_federation
    from fedfuse.flower.deploy import write_app
    from fedfuse.flower.federation import LocalFederation
    from fedfuse.flower.node_data import write_node_bundles

    d = root / name
    d.mkdir(parents=True)
    stats = d / "worker.jsonl"
    env = dict(env, FEDFUSE_WORKER_STATS=str(stats))
    warm = "warm" in name
    if name.startswith("fedfuse"):
        cfg = make_config(_fedfuse_config(data_dir, nodes, rounds))
        dump_yaml(cfg, d / "config.yaml")
        bundles = write_node_bundles(build_federation(cfg), d / "bundles", nodes)
        node_config = [f"data='{b}'" for b in bundles]
        app = write_app(d / "app", d / "config.yaml", out=d / "out", min_nodes=nodes)
    else:
        node_config = [f"partition-id={i} num-partitions={nodes}" for i in range(nodes)]
        app = write_app(d / "app", None, serverapp="flower_plain_app:server_app", clientapp="flower_plain_app:app",
                        run_config={"model": "mlp", "rounds": rounds, "nodes": nodes, "stamps": str(d / "stamps")},
                        dependencies=("flwr",))
    t0 = time.time()
    with LocalFederation(d / "fed", nodes=nodes, auth=True, env=env, warm=warm, node_config=node_config,
                         any_app=not name.startswith("fedfuse"),  # the plain Flower app on warm workers too
                         node_poll=node_poll if "poll" in name else None) as fed:
        t1 = time.time()
        run_id = fed.run(app)
        status = fed.wait(run_id, timeout=3600)
        t2 = time.time()
    if name.startswith("fedfuse"):
        recs = [json.loads(line) for line in (d / "out" / "metrics.jsonl").read_text().splitlines()]
        per_round = [float(r["seconds"]) for r in recs]
        calls = [c for c in json.loads((d / "out" / "flower_calls.json").read_text()) if c["type"] == "train"]
        server = [r - (c["done"] - c["push"]) for r, c in zip(per_round, calls, strict=False)]
        acc = recs[-1].get("global_accuracy")
    else:
        lines = (d / "stamps").read_text().splitlines()
        stamps = sorted((int(a), float(b)) for a, b in (line.split() for line in lines))
        per_round = [b - a for (_, a), (_, b) in itertools.pairwise(stamps)]
        server, acc = [], None
    tasks = [json.loads(line) for line in stats.read_text().splitlines()] if stats.exists() else []
    train = [t for t in tasks if t["type"] == "train"]
    out = {"variant": name, "status": status, "startup": t1 - t0, "run": t2 - t1, "rounds": per_round,
           "s_round": statistics.median(_steady(per_round)), "accuracy": acc}
    if train:
        out["client"] = statistics.median(t["app"] for t in train[nodes:])  # the first message builds the node
        out["transfer"] = statistics.median(t["pull"] + t["push"] for t in train[nodes:])
        out["first_client"] = max(t["app"] for t in train[:nodes])
    if server:
        out["server"] = statistics.median(_steady(server))
    return out


def main(args: Any) -> None:
    import tempfile

    import flwr
    from machine import load  # benchmarks/ is on sys.path when peers.py runs

    root = Path(tempfile.mkdtemp(prefix="peers-deploy-"))
    bench = Path(__file__).resolve().parent
    src = bench.parent / "src"
    data = root / "mnist.pt"
    from fedfuse.data.datasets import load_dataset

    ds = load_dataset("mnist", args.data_dir)
    n = args.nodes * PER_CLIENT
    torch.save((ds.train_x[:n].contiguous(), ds.train_y[:n].contiguous()), data)
    env = {"PYTHONPATH": os.pathsep.join([str(src), str(bench), os.environ.get("PYTHONPATH", "")]),
           "PEERS_DATA": str(data), "PEERS_THREADS": str(args.threads), "FEDFUSE_THREADS": str(args.threads),
           "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(args.threads)}
    variants = [v for v in args.deploy_variants.split(",") if v]
    if args.node_poll is None:
        variants = [v for v in variants if "poll" not in v]
    print(f"start: {load()}")
    print(f"{os.cpu_count()} cores; torch {torch.__version__}, flwr {flwr.__version__}; {args.nodes} SuperNodes "
          f"(TLS, node authentication) on 127.0.0.1; {args.rounds} rounds; MLP, {args.nodes} × {PER_CLIENT} MNIST "
          f"images, all clients every round; logs under {root}")
    rows = []
    for v in variants:
        r = run_variant(v, root, data_dir=args.data_dir, nodes=args.nodes, rounds=args.rounds, env=env,
                        node_poll=args.node_poll)
        rows.append(r)
        print(f"  {v}: {r['status']}, rounds {[round(x, 2) for x in r['rounds']]} (load: {load()})", flush=True)

    def f(r: dict[str, Any], k: str) -> str:
        return f"{r[k]:.3f}" if r.get(k) is not None else "—"

    print("\n| variant | s/round | client work | node transfer | server work | polling/queueing | start-up s | "
          "first message s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rest = r["s_round"] - sum(r.get(k) or 0.0 for k in ("client", "transfer", "server")) if "client" in r else None
        print(f"| {r['variant']} | {r['s_round']:.3f} | {f(r, 'client')} | {f(r, 'transfer')} | {f(r, 'server')} | "
              f"{'—' if rest is None else f'{rest:.3f}'} | {r['startup']:.1f} | {f(r, 'first_client')} |")
    by = {r["variant"]: r["s_round"] for r in rows}
    for a, b in (("fedfuse-warm", "plain-warm"), ("fedfuse-warm-poll", "plain-warm-poll"),
                 ("fedfuse-cold", "fedfuse-warm"), ("fedfuse-cold", "fedfuse-warm-poll"), ("plain-cold", "plain-warm")):
        if a in by and b in by:
            print(f"- {a} / {b}: {by[a] / by[b]:.2f}×")
    accs = {r["variant"]: r["accuracy"] for r in rows if r["accuracy"] is not None}
    if accs:
        print(f"- fedfuse final global accuracy: {accs}")
    print(f"\nend: {load()}")
    sys.stdout.flush()
