"""A real deployment whose server holds no data: a TLS SuperLink with two authenticated SuperNodes on loopback, each
holding only its own bundle; the server's ``data_dir`` is an empty directory and its ServerApp process records
every file it opens.  FedAvg and FedMR with federated evaluation equal the in-process runs evaluating the same
way, round for round, and the server opens no data file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")

import fedfuse
from fedfuse.flower.deploy import write_app
from fedfuse.flower.federation import LocalFederation

BASE = dict(dataset="digits", clients=4, clients_per_round=3, rounds=3, local_epochs=1, seed=3, threads="1",
            plots=False, global_eval="federated", model_options={"widths": [16]})


def _env(audit: Path) -> dict[str, str]:
    """This checkout's src for the Flower processes; ``FEDFUSE_AUDIT_OPEN`` makes the ServerApp record its opens
    (the warm workers get their own file from LocalFederation)."""
    src = str(Path(fedfuse.__file__).resolve().parents[1])
    return {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p),
            "FEDFUSE_AUDIT_OPEN": str(audit)}


def _metrics(out: Path) -> list[dict]:
    from fedfuse.engine.loop import strip_timing

    return [strip_timing(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_deployed_server_without_data_runs_fedavg_and_fedmr_equal_to_in_process(tmp_path: Path) -> None:
    import sklearn

    from fedfuse.algorithms import get_algorithm
    from fedfuse.config import make_config
    from fedfuse.engine.loop import Experiment, build_federation
    from fedfuse.flower.node_data import write_node_bundles

    cfg = make_config({**BASE, "algorithm": "fedavg"})
    bundles = write_node_bundles(build_federation(cfg), tmp_path / "nodes", 2, config=cfg)
    empty = tmp_path / "server-data"
    empty.mkdir()
    audit = tmp_path / "server.opened"
    runs = {}
    with LocalFederation(tmp_path / "fed", nodes=2, auth=True, env=_env(audit), warm=True, audit_open=True,
                         gateway=True, signed=True, node_config=[f"data='{b}'" for b in bundles]) as federation:
        for algorithm in ("fedavg", "fedmr"):
            conf = tmp_path / f"{algorithm}.yaml"
            conf.write_text(yaml.safe_dump({**BASE, "algorithm": algorithm, "data_dir": str(empty)}))
            out = tmp_path / f"out-{algorithm}"
            app = write_app(tmp_path / f"app-{algorithm}", conf, out=out, min_nodes=2)
            run_id = federation.run(app)
            status = federation.wait(run_id, timeout=900)
            assert status == "finished:completed", (federation.logs / f"run-{run_id}.log").read_text()[-3000:]
            runs[algorithm] = out
        worker_opened = [federation.opened(i) for i in range(2)]
    for algorithm, out in runs.items():
        ref = tmp_path / f"ref-{algorithm}"
        Experiment(make_config({**BASE, "algorithm": algorithm}, out=str(ref)), get_algorithm(algorithm)).run()
        got = _metrics(out)
        assert [r["round"] for r in got] == list(range(1, BASE["rounds"] + 1)), algorithm
        assert got == _metrics(ref), algorithm
        assert got[-1]["global_eval_clients"] == 4 and got[-1]["global_accuracy"] > 0.3
    assert list(empty.iterdir()) == []
    opened = [Path(p) for p in audit.read_text().splitlines() if p and not p.isdigit()]
    assert any(p.name == "fedfuse-config.yaml" for p in opened)  # the hook ran in the ServerApp process
    data = [Path(sklearn.__file__).parent / "datasets" / "data", empty.resolve(), *(b.resolve() for b in bundles)]
    assert not [p for p in opened if any(p.resolve().is_relative_to(d) for d in data)]
    for i, b in enumerate(bundles):  # each device read its own bundle
        assert any(Path(p).resolve().is_relative_to(b.resolve()) for p in worker_opened[i])
