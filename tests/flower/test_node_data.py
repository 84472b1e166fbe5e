"""Node-local data on Flower: each node holds its own clients only (``fedfuse export-partitions --nodes``,
tables, image folders), reports them, and refuses jobs for other clients; the server samples among the
clients that are present and never receives a raw sample."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")

from fedfuse.algorithms import get_algorithm
from fedfuse.config import make_config
from fedfuse.engine.loop import Experiment, among_present, build_federation, strip_timing
from fedfuse.flower.app import client_app
from fedfuse.flower.executor import FlowerExecutor, LocalGrid
from fedfuse.flower.node_data import NodeDataError, load_node_data, write_node_bundles


def _cfg(**kw):
    base = dict(algorithm="fedavg", dataset="digits", clients=4, clients_per_round=4, rounds=2, local_epochs=1,
                seed=3, threads=1, plots=False, eval_every=2, model_options={"widths": [16]})
    base.update(kw)
    return make_config(base)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    cfg = _cfg()
    out = tmp_path_factory.mktemp("nodes")
    return write_node_bundles(build_federation(cfg), out, 2)


def _run(cfg, grid, executor=None):
    exp = Experiment(cfg, get_algorithm(cfg.algorithm), executor=executor or FlowerExecutor(grid, cfg, cfg.seed))
    return exp.run(), exp


def _history(exp):
    return [strip_timing(r) for r in exp.history]


def test_bundles_hold_each_clients_own_splits_bit_for_bit(bundles):
    cfg = _cfg()
    fed = build_federation(cfg)
    for k, path in enumerate(bundles):
        data = load_node_data({"data": str(path)}, seed=cfg.seed, val_fraction=cfg.val_fraction)
        assert data.client_ids == [c for c in range(4) if c % 2 == k]
        for cid, c in data.clients.items():
            for split in ("train", "val", "test"):
                for t in ("x", "y"):
                    assert torch.equal(getattr(getattr(c, split), t), getattr(getattr(fed.clients[cid], split), t))
        assert sorted(p.name for p in path.iterdir()) == sorted(
            ["fedfuse_node.json"] + [f"client-{c}.pt" for c in data.client_ids])


def test_deployment_over_node_bundles_equals_in_process(bundles):
    """Two nodes, each holding only its own clients: the run's metrics equal the sequential in-process run."""
    cfg = _cfg()
    ref = Experiment(cfg, get_algorithm(cfg.algorithm))
    ref.run()
    grid = LocalGrid(client_app, 2, node_config=[{"data": str(p)} for p in bundles])
    _, flw = _run(cfg, grid)
    assert _history(flw) == _history(ref)
    assert flw.history[-1]["dropped"] == []


def test_no_raw_sample_in_any_message_the_server_receives(bundles):
    cfg = _cfg(algorithm="fedmr", rounds=2)
    grid = LocalGrid(client_app, 2, node_config=[{"data": str(p)} for p in bundles])
    grid.keep_replies = True
    _run(cfg, grid)
    assert grid.received
    blob = b"".join(grid.received)
    fed = build_federation(cfg)
    for c in fed.clients:
        for split in (c.train, c.val, c.test):
            for row in split.x:  # every sample's input bytes (float32), as a model reply could carry them
                assert row.numpy().tobytes() not in blob
            if len(split.y) >= 8:
                assert split.y.numpy().tobytes() not in blob  # nor a client's label vector


class _WrongMap(FlowerExecutor):
    """Believes node 1 holds client 1 (it does not): the job reaches a node that must refuse it."""

    def discover(self, ids):
        super().discover(ids)
        self.served[ids[0]] = [0, 1, 2]


def test_a_job_for_a_foreign_client_is_refused_and_counted_as_a_dropout(bundles, caplog):
    cfg = _cfg()
    grid = LocalGrid(client_app, 2, node_config=[{"data": str(p)} for p in bundles])
    with caplog.at_level(logging.ERROR, logger="fedfuse"):
        _, exp = _run(cfg, grid, _WrongMap(grid, cfg, cfg.seed))
    for rec in exp.history:
        assert rec["dropped"] == [1] and rec["replied"] == 3
    assert exp.totals.dropped == 2
    assert "does not hold client 1" in caplog.text and "job refused" in caplog.text


def test_clients_nobody_holds_are_absent_dropouts_not_replaced(bundles):
    """Only node 0 (clients 0 and 2) is connected: the server samples exactly as in process, and every sampled
    client nobody holds (1, 3) is a dropout of its round — never replaced by a present client."""
    cfg = _cfg(clients_per_round=2, rounds=3)
    ref = Experiment(cfg, get_algorithm(cfg.algorithm))
    ref.run()
    grid = LocalGrid(client_app, 1, node_config=[{"data": str(bundles[0])}])
    _, exp = _run(cfg, grid)
    assert [r["clients"] for r in exp.history] == [r["clients"] for r in ref.history]
    for rec in exp.history:
        assert rec["dropped"] == [c for c in rec["clients"] if c % 2 == 1]
        assert rec["replied"] == len([c for c in rec["clients"] if c % 2 == 0])
    assert exp.totals.dropped == sum(len(r["dropped"]) for r in exp.history) > 0


def test_the_server_refuses_a_second_node_claiming_the_same_clients(bundles, caplog):
    """Two devices are given node 0's bundle (a copied bundle): the first claim stands, the second node is
    refused (an error names both) and gets no job; node 1's clients, which nobody holds, are dropouts."""
    cfg = _cfg()
    grid = LocalGrid(client_app, 2, node_config=[{"data": str(bundles[0])}, {"data": str(bundles[0])}])
    served = []
    real = grid.send_and_receive

    def spy(messages, *, timeout=None):
        messages = list(messages)
        served.extend(m.metadata.dst_node_id for m in messages)
        return real(messages, timeout=timeout)

    grid.send_and_receive = spy
    with caplog.at_level(logging.ERROR, logger="fedfuse"):
        _, exp = _run(cfg, grid)
    assert set(served) == {1}
    assert "node 2 claims clients [0, 2], which node [1] already holds: refused" in caplog.text
    for rec in exp.history:
        assert rec["dropped"] == [1, 3] and rec["replied"] == 2


@pytest.mark.parametrize("change", [{"seed": 4}, {"partition_options": {"alpha": 0.1}}, {"val_fraction": 0.2},
                                    {"partition": "iid", "partition_options": {}}])
def test_a_node_refuses_a_bundle_exported_with_other_run_settings(tmp_path, change, caplog):
    """A bundle records the settings that decide its clients' rows; a run with another seed, partition, its
    options or validation split is refused by the node with the differing settings named (every one of its
    clients is a dropout), instead of silently training other rows."""
    from fedfuse.flower.app import node_run

    cfg = _cfg()
    paths = write_node_bundles(build_federation(cfg), tmp_path / "b", 1, config=cfg)
    other = make_config({**cfg.to_dict(), **change})
    import json as _json

    with pytest.raises(NodeDataError, match="was exported with " + next(iter(change))):
        node_run(_json.dumps(other.to_dict(), sort_keys=True, default=str), {"data": str(paths[0])})
    node_run(_json.dumps(cfg.to_dict(), sort_keys=True, default=str), {"data": str(paths[0])})  # its own run: fine
    grid = LocalGrid(client_app, 1, node_config=[{"data": str(paths[0])}])
    with caplog.at_level(logging.WARNING, logger="fedfuse"):
        _, exp = _run(make_config({**other.to_dict(), "rounds": 1}), grid)
    assert exp.history[0]["replied"] == 0 and exp.history[0]["dropped"] == exp.history[0]["clients"]
    assert "was exported with" in caplog.text


def test_among_present_replaces_only_absent_clients():
    rng = np.random.default_rng(0)
    assert among_present([1, 4, 7], None, 10, rng) == [1, 4, 7]
    assert among_present([1, 4, 7], set(range(10)), 10, rng) == [1, 4, 7]
    got = among_present([1, 4, 7], {1, 2, 3, 7}, 10, np.random.default_rng(0))
    assert len(got) == 3 and {1, 7} <= set(got) and set(got) <= {1, 2, 3, 7}
    assert among_present([1, 4, 7], {4}, 10, rng) == [4]  # fewer present than sampled
    again = among_present([1, 4, 7], {1, 2, 3, 7}, 10, np.random.default_rng(0))
    assert again == got  # seeded


class _Recording(LocalGrid):
    """Keeps every train message it delivers, serialised (what a SuperNode receives)."""

    sent: list[bytes]

    def _wire(self, msg):
        from flwr.common.serde import message_to_proto

        if msg.metadata.message_type == "train":
            self.sent.append(message_to_proto(msg).SerializeToString())
        return super()._wire(msg)


NODE = """
import sys
opened = []
sys.addaudithook(lambda ev, args: opened.append(str(args[0])) if ev == "open" and args and args[0] else None)
from flwr.app import Context, RecordDict
from flwr.common.serde import message_from_proto
from flwr.proto.message_pb2 import Message
from fedfuse.flower.app import client_app
proto = Message()
proto.ParseFromString(open(sys.argv[1], "rb").read())
ctx = Context(run_id=1, node_id=1, node_config={"data": sys.argv[2]}, state=RecordDict(), run_config={})
reply = client_app(message_from_proto(proto), ctx)
assert not reply.has_error(), reply.error
with open(sys.argv[3], "w") as fh:
    fh.write("\\n".join(opened))
"""


def test_a_nodes_process_opens_only_its_own_files(bundles, tmp_path):
    """A node process (an audit hook records every ``open``) answering a real train message for its client reads
    files under its own bundle and none under the other node's."""
    cfg = _cfg(rounds=1)
    grid = _Recording(client_app, 2, node_config=[{"data": str(p)} for p in bundles])
    grid.sent = []
    _run(cfg, grid)
    from flwr.common.serde import message_from_proto
    from flwr.proto.message_pb2 import Message

    for raw in grid.sent:
        proto = Message()
        proto.ParseFromString(raw)
        if int(message_from_proto(proto).content["fedfuse.job"]["cid"]) == 0:
            (tmp_path / "msg.bin").write_bytes(raw)
            break
    (tmp_path / "node.py").write_text(NODE)
    log = tmp_path / "opened.txt"
    subprocess.run([sys.executable, str(tmp_path / "node.py"), str(tmp_path / "msg.bin"), str(bundles[0]),
                    str(log)], check=True, timeout=300)
    opened = [Path(p).resolve() for p in log.read_text().splitlines() if p and not p.isdigit()]
    mine, other = bundles[0].resolve(), bundles[1].resolve()
    assert any(p.is_relative_to(mine) for p in opened)
    assert not any(p.is_relative_to(other) for p in opened)
    assert not any(p.is_relative_to(other.parent) and not p.is_relative_to(mine) for p in opened)


def test_node_data_from_a_table_an_image_folder_and_a_flower_partition(tmp_path):
    hf = pytest.importorskip("datasets", reason="needs the flower extra: pip install -e '.[flower]'")
    from PIL import Image

    rng = np.random.default_rng(0)
    # CSV: 4 features, a label column and a partition_id column naming two clients
    rows = ["f0,f1,f2,f3,label,partition_id"]
    for i in range(40):
        rows.append(",".join(f"{v:.3f}" for v in rng.normal(size=4)) + f",{i % 3},{5 + i % 2}")
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    data = load_node_data({"data": str(tmp_path / "t.csv")}, seed=0, val_fraction=0.1)
    assert data.client_ids == [5, 6] and data.input_shape == (4,)
    for c in data.clients.values():
        assert len(c.train) + len(c.val) + len(c.test) == 20 and len(c.test) == 4 and len(c.val) == 2
    # a Flower Datasets partition saved to disk (no partition_id): the node names its client
    part = hf.Dataset.from_dict({"image": [rng.integers(0, 255, (8, 8), dtype=np.uint8) for _ in range(30)],
                                 "label": [i % 10 for i in range(30)]},
                                features=hf.Features({"image": hf.Image(), "label": hf.ClassLabel(num_classes=10)}))
    part.save_to_disk(str(tmp_path / "p"))
    with pytest.raises(NodeDataError, match="client-id"):
        load_node_data({"data": str(tmp_path / "p")}, seed=0, val_fraction=0.1)
    data = load_node_data({"data": str(tmp_path / "p"), "client-id": 3}, seed=0, val_fraction=0.1)
    assert data.client_ids == [3] and data.input_shape == (1, 8, 8) and data.num_classes == 10
    x = torch.cat([data.clients[3].train.x, data.clients[3].val.x])
    assert abs(float(x.mean())) < 0.3  # standardised with the node's own statistics
    # a folder of images, one sub-folder per class
    for k in ("cat", "dog"):
        (tmp_path / "img" / k).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(rng.integers(0, 255, (6, 6, 3), dtype=np.uint8)).save(tmp_path / "img" / k / f"{i}.png")
    data = load_node_data({"data": str(tmp_path / "img"), "partition-id": 1}, seed=0, val_fraction=0.0)
    assert data.client_ids == [1] and data.input_shape == (3, 6, 6) and data.class_names == ["cat", "dog"]
    assert len(data.clients[1].train) == 8 and len(data.clients[1].test) == 2


def test_export_partitions_records_the_run_settings_and_older_bundles_are_checked_too(tmp_path):
    """``fedfuse export-partitions --nodes`` writes every run-defining setting into each bundle; a bundle written
    before (only ``seed``, ``partition``, ``val_fraction`` in its metadata) is checked on what it has."""
    import json

    from fedfuse.cli import main
    from fedfuse.flower.node_data import RUN_SETTINGS, check_compatible, run_settings

    out = tmp_path / "parts"
    assert main(["export-partitions", "--dataset", "digits", "--clients", "4", "--clients-per-round", "4",
                 "--seed", "3", "--nodes", "2",
                 "--out", str(out)]) == 0
    meta = json.loads((out / "node-1" / "fedfuse_node.json").read_text())
    cfg = make_config(dataset="digits", clients=4, clients_per_round=4, seed=3)
    assert sorted(meta["run"]) == sorted(RUN_SETTINGS) and meta["run"] == run_settings(cfg)
    old = write_node_bundles(build_federation(cfg), tmp_path / "old", 1,
                             meta={"seed": 3, "partition": "dirichlet", "val_fraction": 0.1})
    data = load_node_data({"data": str(old[0])}, seed=3, val_fraction=0.1)
    check_compatible(data, cfg)
    with pytest.raises(NodeDataError, match=r"seed=3 \(the run: 5\)"):
        check_compatible(data, make_config(dataset="digits", clients=4, clients_per_round=4, seed=5))
