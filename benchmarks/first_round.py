"""What a device's first deployed round costs, and so how long ``--round-timeout`` must be (docs/deploy.md,
*Round timeout*).

    python benchmarks/first_round.py --data-dir ../shared/data [--config study.yaml] [--nodes 5] [--rounds 2]

The study's config (default: docs/deploy.md's ``study.yaml``: FedAvg, MNIST, Dirichlet, 10 clients, all every round,
the default CNN) is exported as ``--nodes`` node bundles (``fedfuse export-partitions --nodes``), and device 0 is
run in a fresh Python process exactly as its warm worker runs it: fedfuse's ClientApp with ``data=`` its bundle,
every message through Flower's protobuf serialisation (:class:`~fedfuse.flower.executor.LocalGrid`); the clients
of the other devices are absent.  Printed (JSON): the process's start-up and imports, the discovery query (the
device loads its bundle and builds the model: paid once per run, before round 1), and each round's wall time
(the device runs its clients one after another: a round lasts the sum of its clients' jobs).  Flower's transport
adds about a second per message on top (docs/flower.md, *Warm clients*).  A round timeout must exceed the slowest
device's round, the first one included.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STUDY = {"algorithm": "fedavg", "dataset": "mnist", "partition": "dirichlet", "clients": 10, "clients_per_round": 10,
         "rounds": 20, "seed": 0}


def device(config: dict[str, Any], bundle: str, started: float) -> dict[str, Any]:
    """Device 0's side, in this (fresh) process: the ServerApp's loop in process, one node holding ``bundle``."""
    t0 = time.time()
    import torch  # noqa: F401  (timed: a device pays it once)

    from fedfuse.algorithms import get_algorithm
    from fedfuse.config import make_config
    from fedfuse.engine.loop import Experiment
    from fedfuse.flower.app import client_app
    from fedfuse.flower.executor import FlowerExecutor, LocalGrid

    t1 = time.time()
    cfg = make_config(config)
    grid = LocalGrid(client_app, 1, node_config=[{"data": bundle}])
    executor = FlowerExecutor(grid, cfg, cfg.seed)
    t2 = time.time()
    executor.discover(executor.nodes())  # the device loads its bundle and builds its side of the run
    t3 = time.time()
    exp = Experiment(cfg, get_algorithm(cfg.algorithm), executor=executor)
    exp.run()
    return {"startup_s": round(t0 - started, 2), "imports_s": round(t1 - t0, 2), "discovery_s": round(t3 - t2, 2),
            "clients": executor.served.get(1), "round_s": [round(r["seconds"], 2) for r in exp.history],
            "replied": [r["replied"] for r in exp.history]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--config", default=None, help="the study's fedfuse YAML config (default: docs/deploy.md's)")
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="rounds to time (the first, then warm ones)")
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)  # internal: run device 0 from this bundle
    p.add_argument("--started", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device:
        config = json.loads(Path(args.config).read_text())
        print(json.dumps(device(config, args.device, args.started)))
        return 0
    from fedfuse.config import load_yaml, make_config
    from fedfuse.engine.loop import build_federation
    from fedfuse.flower.node_data import write_node_bundles

    study = dict(load_yaml(args.config)) if args.config else dict(STUDY)
    study.update(data_dir=args.data_dir, rounds=args.rounds, threads=1, plots=False)
    cfg = make_config(study)
    with tempfile.TemporaryDirectory() as tmp:
        bundles = write_node_bundles(build_federation(cfg), Path(tmp) / "nodes", args.nodes, config=cfg)
        conf = Path(tmp) / "config.json"
        conf.write_text(json.dumps(cfg.to_dict(), default=str))
        started = time.time()
        out = subprocess.run([sys.executable, __file__, "--data-dir", args.data_dir, "--config", str(conf),
                              "--device", str(bundles[0]), "--started", str(started)],
                             capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["first_round_s"] = round(result["startup_s"] + result["imports_s"] + result["discovery_s"]
                                    + result["round_s"][0], 2)
    result["config"] = {k: study[k] for k in ("algorithm", "dataset", "clients", "clients_per_round", "seed")}
    result["nodes"] = args.nodes
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
