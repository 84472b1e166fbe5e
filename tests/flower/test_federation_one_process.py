"""One process per device: ``python -m fedfuse.flower.supernode --worker-thread`` runs the SuperNode and its warm
ClientApp worker in one process, and a deployed run through such devices equals the in-process run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedfuse.flower.federation import LocalFederation, _tree

CONFIG = """\
algorithm: fedavg
dataset: digits
clients: 2
clients_per_round: 2
rounds: 2
eval_every: 2
threads: 1
plots: false
seed: 3
model_options:
  widths: [16]
"""


@pytest.mark.slow
def test_devices_of_one_process_each_run_the_study_as_in_process(tmp_path: Path) -> None:
    pytest.importorskip("flwr")
    import fedfuse
    from fedfuse.config import make_config
    from fedfuse.engine.loop import build_federation, strip_timing
    from fedfuse.flower.deploy import write_app
    from fedfuse.flower.node_data import write_node_bundles
    from fedfuse.runner import experiment

    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG)
    bundles = write_node_bundles(build_federation(make_config(str(cfg))), tmp_path / "nodes", 2)
    experiment(make_config(str(cfg), out=str(tmp_path / "ref"), executor="sequential")).run()
    out = tmp_path / "out"
    app = write_app(tmp_path / "app", cfg, out=out, round_timeout=300.0, min_nodes=2)
    src = str(Path(fedfuse.__file__).resolve().parents[1])
    env = {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}
    with LocalFederation(tmp_path / "fed", nodes=2, env=env, warm=True, worker_thread=True, gateway=True,
                         signed=True, node_config=[f"data='{b}'" for b in bundles]) as fed:
        assert all(_tree(p.popen.pid) == [p.popen.pid] for p in fed.nodes if p)  # no child: one process each
        assert fed.wait(fed.run(app), timeout=600) == "finished:completed"
        assert all(_tree(p.popen.pid) == [p.popen.pid] for p in fed.nodes if p)
        logs = [p.log.read_text(errors="replace") for p in fed.nodes if p]
    assert all("in the SuperNode's process" in text and "node data" in text for text in logs)
    got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert [strip_timing(r) for r in got] == [strip_timing(r) for r in ref]
