"""The engine's seams (``fedfuse/engine/contract.py``): every member the engine may call on an algorithm is
declared, with a working default, on ``fedfuse.algorithms.base.Algorithm``; every executor implements the
``Executor`` protocol; and nothing in ``src/`` probes an algorithm or an executor for a contract member by name."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import fedfuse
from fedfuse.algorithms import ALGORITHMS
from fedfuse.algorithms.base import Algorithm as Base
from fedfuse.config import RunConfig
from fedfuse.engine import contract
from fedfuse.engine.context import RoundInfo
from fedfuse.engine.executor import SequentialExecutor
from fedfuse.executors.auto import AutoExecutor
from fedfuse.executors.batched import BatchedExecutor
from fedfuse.executors.processes import ProcessExecutor
from fedfuse.types import Message

SRC = Path(fedfuse.__file__).parent


def members(proto: type) -> set[str]:
    """The names a protocol declares (methods, properties, annotated attributes)."""
    names = {k for k in vars(proto) if not k.startswith("_")} | set(getattr(proto, "__annotations__", {}))
    return names - {"_is_protocol"}


ALGORITHM_MEMBERS = members(contract.Algorithm)
EXECUTOR_MEMBERS = members(contract.Executor)


def test_the_protocols_name_the_whole_contract():
    for hook in ("setup", "echo_meta", "diagnostics", "finish", "reply_kind", "reply_shapes", "default_sampling",
                 "node_private", "accepts_late", "client_program", "fit", "evaluate", "aggregate_fit"):
        assert hook in ALGORITHM_MEMBERS
    assert {"fit", "map", "bind", "restore", "close", "describe"} <= EXECUTOR_MEMBERS


def test_the_base_class_declares_every_member_of_the_protocol():
    missing = sorted(m for m in ALGORITHM_MEMBERS - {"ctx"} if not hasattr(Base, m))
    assert not missing, f"fedfuse.algorithms.base.Algorithm lacks {missing}"


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_algorithm_is_a_base_algorithm(name):
    assert issubclass(ALGORITHMS[name], Base)


def test_base_defaults_change_nothing(tmp_path):
    from fedfuse.algorithms import get_algorithm
    from fedfuse.engine.loop import build_algorithm, build_context, build_federation

    cfg = RunConfig(dataset="digits", algorithm="fedavg", clients=3, rounds=1, model="mlp",
                    model_options={"widths": [8]})
    fed = build_federation(cfg)
    algo = build_algorithm(cfg, build_context(cfg, fed, "cpu"), get_algorithm(cfg.algorithm))
    blinded = fed.blinded()
    assert algo.setup(blinded) is blinded
    assert algo.diagnostics({}, fed, RoundInfo(0, 1)) == {}
    assert algo.finish({}, fed, tmp_path) is None and not list(tmp_path.iterdir())
    assert algo.reply_shapes(0, Message()) == {}
    assert algo.echo_meta == () and algo.node_private == () and algo.reply_kind is None
    assert Base.default_sampling == "uniform" and Base.accepts_late is False
    assert algo.num_stages(algo.init_state(), RoundInfo(0, 1)) == 1
    assert algo.select_clients(RoundInfo(0, 1), np.random.default_rng(0)) == [0, 1, 2]


@pytest.mark.parametrize("cls", [SequentialExecutor, BatchedExecutor, ProcessExecutor, AutoExecutor])
def test_every_executor_implements_the_protocol(cls):
    missing = sorted(m for m in EXECUTOR_MEMBERS if not hasattr(cls, m))
    assert not missing, f"{cls.__name__} lacks {missing}"


def test_flower_executor_implements_the_protocol():
    pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")
    flower = pytest.importorskip("fedfuse.flower.executor")
    assert not sorted(m for m in EXECUTOR_MEMBERS if not hasattr(flower.FlowerExecutor, m))


def test_nothing_probes_a_contract_member_by_name():
    """``getattr(x, "setup", None)`` / ``hasattr(x, "diagnostics")``: a contract found by probing is how hooks
    went undeclared; every member is declared, so call it."""
    probed = ALGORITHM_MEMBERS | EXECUTOR_MEMBERS
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in probed):
                bad.append(f"{path.relative_to(SRC)}:{node.lineno} {node.func.id}(…, {node.args[1].value!r})")
    assert not bad, "contract members probed by name:\n  " + "\n  ".join(bad)
