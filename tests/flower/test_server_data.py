"""A deployed server without data: it learns the clients' sizes from the nodes, checks their claims, opens no
dataset file, and its run (federated evaluation) equals the in-process run that evaluates the same way.

The ServerApp's own entry point (``fedfuse.flower.app._main``) runs here over :class:`LocalGrid` (every message
through Flower's protobuf both ways, the ClientApp in this process); the real deployment without server data is
the executed guide, ``test_federation_guide.py``."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")

from flwr.app import Context, RecordDict

from fedfuse.algorithms import ALGORITHMS, get_algorithm
from fedfuse.config import make_config, validate
from fedfuse.engine.loop import Experiment, build_federation, strip_timing
from fedfuse.errors import UserError
from fedfuse.flower.app import _main, client_app
from fedfuse.flower.executor import FlowerExecutor, LocalGrid
from fedfuse.flower.node_data import write_node_bundles
from fedfuse.flower.server_data import ClaimCheck, learn_federation, node_answer
from support import LORA, conformance_cfg

BASE = dict(algorithm="fedavg", dataset="digits", clients=4, clients_per_round=3, rounds=3, local_epochs=1, seed=3,
            threads="1", plots=False, global_eval="federated", model_options={"widths": [16]})


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    cfg = make_config(BASE)
    return write_node_bundles(build_federation(cfg), tmp_path_factory.mktemp("nodes"), 2, config=cfg)


def _metrics(out: Path) -> list[dict]:
    return [strip_timing(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _in_process(conf: dict, out: Path) -> list[dict]:
    Experiment(make_config(conf, out=str(out)), get_algorithm(conf["algorithm"])).run()
    return _metrics(out)


def _serve(conf: dict, tmp_path: Path, grid: LocalGrid, **run_config) -> Path:
    """The fedfuse ServerApp's main on ``grid`` for ``conf``, whose data_dir is an empty directory; returns its
    run directory."""
    (tmp_path / "empty").mkdir(exist_ok=True)
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({**conf, "data_dir": str(tmp_path / "empty")}))
    out = tmp_path / "deployed"
    context = Context(run_id=1, node_id=0, state=RecordDict(), node_config={},
                      run_config={"fedfuse-config": str(path), "out": str(out), "round-timeout": 0.0, "min-nodes": 2,
                                  **run_config})
    _main(grid, context)
    return out


@pytest.mark.parametrize("algorithm", ["fedavg", "fedmr"])
def test_a_server_without_data_equals_the_in_process_run_and_loads_no_dataset(algorithm, bundles, tmp_path,
                                                                             monkeypatch):
    """Two nodes holding only their bundles; the server's data_dir is empty and loading any dataset raises: the
    run completes with federated evaluation and equals the in-process run evaluating the same way, round for
    round (training, global and personal metrics)."""
    conf = {**BASE, "algorithm": algorithm}
    ref = _in_process(conf, tmp_path / "ref")
    import fedfuse.data.datasets as datasets

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the server loaded a dataset")

    monkeypatch.setattr(datasets, "load_dataset", refuse)
    grid = LocalGrid(client_app, 2, node_config=[{"data": str(p)} for p in bundles])
    got = _metrics(_serve(conf, tmp_path, grid))
    assert got == ref
    assert [r["round"] for r in got] == [1, 2, 3] and got[-1]["global_eval_clients"] == 4
    assert got[-1]["global_accuracy"] > 0.3


def test_the_server_opens_no_data_file(bundles, tmp_path):
    """An audit hook records every file this process opens while the ServerApp's main learns the federation and
    builds the run (the nodes' part — which opens the bundles — is answered before): nothing under the server's
    data_dir, the dataset's packaged files or the nodes' bundles."""
    import sys

    conf = dict(BASE)
    grid = LocalGrid(client_app, 2, node_config=[{"data": str(p)} for p in bundles])
    for n in grid.node_ids:  # the nodes build their side first (they read their bundles), outside the audit
        from fedfuse.flower.app import node_run

        node_run(json.dumps(make_config(conf).to_dict(), sort_keys=True, default=str), grid.contexts[n].node_config)
    opened: list[str] = []
    recording = [False]

    def hook(event: str, args: tuple) -> None:
        if recording[0] and event == "open" and args and isinstance(args[0], str | bytes):
            opened.append(str(args[0]))

    sys.addaudithook(hook)  # cannot be removed: it records only while ``recording``
    recording[0] = True
    try:
        executor = FlowerExecutor(grid, make_config(conf), 3, min_nodes=2)
        fed = learn_federation(executor, make_config(conf))
        Experiment(make_config(conf), get_algorithm("fedavg"), executor=executor, fed=fed).run()
    finally:
        recording[0] = False
    import sklearn

    data_dirs = [Path(sklearn.__file__).parent / "datasets" / "data", *(p.resolve() for p in bundles)]

    def data_files(paths: list[str]) -> list[str]:
        return [p for p in paths if any(Path(p).resolve().is_relative_to(d) for d in data_dirs)]

    assert not data_files(opened)
    opened.clear()
    recording[0] = True  # the control: a server that loads the dataset is seen
    try:
        build_federation(make_config(conf))
    finally:
        recording[0] = False
    assert data_files(opened)
    assert not fed.holds_data and np.array_equal(fed.client_sizes(), build_federation(make_config(conf)).client_sizes())


def test_claims_are_checked_against_the_run_and_each_other():
    fed = build_federation(make_config(BASE))
    sizes = fed.client_sizes()
    answer = {k: json.loads(v) for k, v in node_answer(fed, [0, 2]).items()}
    assert answer["sizes"] == {"0": int(sizes[0]), "2": int(sizes[2])}
    assert answer["data"]["input_shape"] == list(fed.input_shape) and answer["data"]["num_classes"] == 10
    check = ClaimCheck(4)
    assert check(1, [0, 2], answer) is None and check.missing() == [1, 3]
    assert "clients [7]" in check(2, [1, 7], answer)  # outside the run
    assert "no size for clients [1]" in check(2, [1], answer)
    bigger = {**answer, "sizes": {"1": int(sizes[1]), "0": int(sizes[0]) + 1}}
    assert "client 0: " in check(2, [0, 1], bigger)  # another export's data: refused, nothing recorded
    assert check.missing() == [1, 3]
    other = {"sizes": {"1": 5, "3": 5}, "data": {**answer["data"], "num_classes": 7}}
    assert "node 1's is" in check(3, [1, 3], other)
    assert "carries no client sizes" in check(3, [1, 3], {})
    assert check(3, "*", {k: json.loads(v) for k, v in node_answer(fed, None).items()}) is None
    assert check.missing() == [] and [check.sizes[c] for c in range(4)] == sizes.tolist()
    server = ClaimCheck(4, sizes + 1)  # global_eval=server: the server's own dataset fixes every size
    assert "differ from the federation's" in server(1, [0, 2], answer)


def test_a_node_with_other_sizes_is_refused_and_its_clients_are_absent(bundles, tmp_path, caplog):
    """A node whose bundle holds another federation's clients (same ids, other sizes: another seed's export, its
    run check bypassed) is refused by the server: its clients are dropouts, never trained with foreign data."""
    conf = dict(BASE)
    cfg = make_config(conf)
    grid = LocalGrid(client_app, 2, node_config=[{"data": str(p)} for p in bundles])
    executor = FlowerExecutor(grid, cfg, cfg.seed, min_nodes=2)
    sizes = build_federation(cfg).client_sizes()
    sizes[1] += 1  # the federation the server knows says client 1 (node 2's) has another size
    executor.vet = ClaimCheck(4, sizes)
    with caplog.at_level(logging.ERROR, logger="fedfuse"):
        assert executor.present() is None
    assert executor.served == {1: [0, 2]} and "node 2 refused: its clients' sizes differ" in caplog.text


def test_the_server_waits_for_every_clients_size_then_says_who_is_missing(bundles):
    cfg = make_config(BASE)
    grid = LocalGrid(client_app, 1, node_config=[{"data": str(bundles[0])}])
    with pytest.raises(UserError, match=r"no connected node holds clients \[1, 3\]"):
        learn_federation(FlowerExecutor(grid, cfg, cfg.seed), cfg, wait=0.0)


@pytest.mark.parametrize("algorithm", ["ensemble", "fedet"])
def test_a_server_without_data_refuses_algorithms_whose_server_needs_data(algorithm, bundles, tmp_path):
    """Refused at once with the reason (not after waiting for nodes that refuse the run: Fed-ET's nodes do)."""
    from fedfuse.config import ConfigError

    grid = LocalGrid(client_app, 2, node_config=[{"data": str(p)} for p in bundles])
    with pytest.raises(ConfigError, match=rf"{algorithm}.*cannot run on a server without data"):
        _serve({**BASE, "algorithm": algorithm}, tmp_path, grid)


REFUSED = {"ensemble", "fedet"}  # their server needs data (Algorithm.server_data)


@pytest.fixture(scope="module")
def conformance_bundles(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The conformance runs' digits federation (the same for every digits algorithm), one bundle per node."""
    cfg = validate(conformance_cfg("fedavg", "sequential"))
    return write_node_bundles(build_federation(cfg), tmp_path_factory.mktemp("conformance"), 2, config=cfg)


@pytest.mark.parametrize("algorithm", sorted(a for a in ALGORITHMS if a not in LORA and a != "simple-fedma"))
def test_every_algorithm_on_a_server_without_data_equals_in_process(algorithm, conformance_bundles):
    """Every algorithm on digits (the conformance suite's tiny runs), federated evaluation: on a server that knows
    only the nodes' answers it equals the in-process run round for round, or is refused with the reason."""
    cfg = validate(dataclasses.replace(conformance_cfg(algorithm, "sequential"), global_eval="federated"))
    grid = LocalGrid(client_app, 2, node_config=[{"data": str(p)} for p in conformance_bundles])
    executor = FlowerExecutor(grid, cfg, cfg.seed, min_nodes=2)
    if algorithm in REFUSED:  # the ServerApp refuses them before round 1 (the test above)
        assert isinstance(get_algorithm(algorithm).server_data, str)
        return
    ref = Experiment(cfg, get_algorithm(algorithm))
    ref.run()
    exp = Experiment(cfg, get_algorithm(algorithm), executor=executor, fed=learn_federation(executor, cfg, wait=0))
    exp.run()
    assert [strip_timing(h) for h in exp.history] == [strip_timing(h) for h in ref.history]


def test_with_a_server_test_set_the_nodes_sizes_are_checked_against_it(bundles, tmp_path, caplog):
    """global_eval=server: the operator gave the server its dataset (digits is packaged), which it evaluates on;
    the run equals the in-process one, and a node whose sizes differ from the server's dataset is refused."""
    conf = {**BASE, "global_eval": "server", "rounds": 2}
    ref = _in_process(conf, tmp_path / "ref")
    grid = LocalGrid(client_app, 2, node_config=[{"data": str(p)} for p in bundles])
    got = _metrics(_serve(conf, tmp_path, grid))
    assert got == ref and "global_eval_clients" not in got[-1] and got[-1]["global_accuracy"] is not None
    other = make_config({**BASE, "seed": 4})  # another partition: the same client ids, other sizes
    foreign = write_node_bundles(build_federation(other), tmp_path / "foreign", 2, config=make_config(BASE))
    sizes = build_federation(make_config(BASE)).client_sizes()
    assert build_federation(other).client_sizes()[1] != sizes[1]
    grid = LocalGrid(client_app, 2, node_config=[{"data": str(bundles[0])}, {"data": str(foreign[1])}])
    (tmp_path / "second").mkdir()
    with caplog.at_level(logging.ERROR, logger="fedfuse"):
        got = _metrics(_serve(conf, tmp_path / "second", grid))
    assert "node 2 refused: its clients' sizes differ from the federation's" in caplog.text
    assert all(c in r["dropped"] for r in got for c in r["clients"] if c % 2 == 1)  # its clients are dropouts


def test_a_server_without_data_resumes_from_its_checkpoint(bundles, tmp_path):
    """``resume=true``: the resumed ServerApp learns the sizes from the nodes again and continues the run; the
    resumed 3-round run equals the uninterrupted in-process one."""
    ref = _in_process(BASE, tmp_path / "ref")
    grid = LocalGrid(client_app, 2, node_config=[{"data": str(p)} for p in bundles])
    out = _serve({**BASE, "rounds": 2}, tmp_path, grid)
    assert len(_metrics(out)) == 2
    out = _serve(BASE, tmp_path, LocalGrid(client_app, 2, node_config=[{"data": str(p)} for p in bundles]),
                 resume=True)
    assert _metrics(out) == ref
