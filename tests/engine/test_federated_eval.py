"""Federated evaluation (``global_eval=federated``): the global model evaluated on every client's own test split and
reported as the size-weighted mean; a federation without data refuses what needs server data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fedfuse.executors  # noqa: F401  (registers the batched and process-pool executors)
from fedfuse.algorithms import get_algorithm
from fedfuse.config import ConfigError, make_config
from fedfuse.engine.client import evaluate_model
from fedfuse.engine.federated_eval import (
    GLOBAL_META,
    PREFIX,
    aggregate_global,
    split_global,
    with_global_model,
)
from fedfuse.engine.loop import Experiment, build_federation
from fedfuse.types import ClientData, Federation, Message, Split


def _cfg(**kw):
    base = dict(algorithm="fedavg", dataset="digits", clients=4, clients_per_round=3, rounds=2, local_epochs=1,
                seed=5, threads=1, plots=False, global_eval="federated", model_options={"widths": [16]})
    base.update(kw)
    return make_config(base)


def test_aggregate_is_the_size_weighted_mean_by_hand():
    """acc = (0.5·2 + 1.0·6) / 8 = 0.875, loss = (2.0·2 + 1.0·6) / 8 = 1.25; a client without test examples (NaN
    metrics, count 0) and one that did not evaluate the global model do not count."""
    res = {0: {"global_test_accuracy": 0.5, "global_test_loss": 2.0, "global_test_count": 2},
           1: {"global_test_accuracy": 1.0, "global_test_loss": 1.0, "global_test_count": 6},
           2: {"global_test_accuracy": math.nan, "global_test_loss": math.nan, "global_test_count": 0},
           3: {"test_accuracy": 0.1, "test_count": 9}}
    assert aggregate_global(res) == {"global_accuracy": 0.875, "global_loss": 1.25, "global_eval_clients": 2}
    assert aggregate_global({}) == {"global_accuracy": None, "global_loss": None, "global_eval_clients": 0}


def test_global_model_rides_along_shared_payloads_and_splits_off_exactly():
    shared = Message({"w": torch.ones(2)}, {"k": 1})
    own = Message({"w": torch.zeros(2)}, {})
    model = ({"w": torch.full((2,), 3.0), "b": torch.zeros(1)}, {"model_options": {"widths": [4]}})
    out = with_global_model({0: shared, 1: shared, 2: own}, model)
    assert out[0] is out[1] and out[2] is not out[0]  # a broadcast stays one message (encoded once on the wire)
    assert set(out[0].tensors) == {"w", PREFIX + "w", PREFIX + "b"}
    assert out[0].meta[GLOBAL_META] == {"meta": {"model_options": {"widths": [4]}}, "in_payload": False}
    back, glob = split_global(out[0])
    assert back.meta == {"k": 1} and torch.equal(back.tensors["w"], torch.ones(2)) and set(back.tensors) == {"w"}
    assert glob is not None and torch.equal(glob[0]["w"], torch.full((2,), 3.0)) and glob[1] == model[1]
    assert split_global(shared) == (shared, None)  # a payload without the global model is left as it is
    # the default evaluation payload is the global model itself (equal values suffice): nothing is sent twice
    same = Message({k: v.clone() for k, v in model[0].items()}, dict(model[1]))
    sent = with_global_model({0: same}, model)[0]
    assert sent.nbytes == same.nbytes and sent.meta[GLOBAL_META]["in_payload"] is True
    back, glob = split_global(sent)
    assert back.meta == model[1] and glob is not None and glob[1] == model[1]
    assert all(torch.equal(glob[0][k], v) and torch.equal(back.tensors[k], v) for k, v in model[0].items())


def _by_hand(exp: Experiment) -> tuple[float, float, float]:
    """(accuracy, loss, test examples) of the run's final global model over the union of the clients' test splits,
    computed here independently of the engine."""
    tensors, meta = exp.algo.global_model(exp.state)
    correct = loss = count = 0.0
    for c in exp.fed.clients:
        st = evaluate_model(exp.ctx.load(tensors, meta), c.test, 512)
        correct, loss, count = correct + st.correct, loss + st.loss_sum, count + st.count
    return correct / count, loss / count, count


@pytest.mark.parametrize("algorithm", ["fedavg", "fedmr"])
def test_federated_global_metrics_equal_a_hand_computation(algorithm):
    """The run's global_accuracy/global_loss = Σ_i n_i·metric_i / Σ_i n_i of the final global model evaluated on
    each client's own test split (n_i its test count)."""
    exp = Experiment(_cfg(algorithm=algorithm), get_algorithm(algorithm))
    exp.run()
    acc, loss, count = _by_hand(exp)
    last = exp.history[-1]
    assert count == sum(len(c.test) for c in exp.fed.clients) > 0
    assert last["global_accuracy"] == pytest.approx(acc, rel=1e-12)
    assert last["global_loss"] == pytest.approx(loss, rel=1e-12)
    assert last["global_eval_clients"] == 4 and last["loss"] == last["global_loss"]


def test_global_eval_modes_change_only_the_global_metrics():
    """server (the default) evaluates on the global test set, none not at all; training is the same in all three."""
    runs = {}
    for mode in ("server", "federated", "none"):
        exp = Experiment(_cfg(global_eval=mode), get_algorithm("fedavg"))
        exp.run()
        runs[mode] = exp.history[-1]
    fed = build_federation(_cfg())
    assert len(fed.test) > 0 and runs["server"]["global_accuracy"] != runs["federated"]["global_accuracy"]
    assert runs["none"]["global_accuracy"] is None and runs["none"]["loss"] == runs["none"]["personal_loss"]
    assert "global_eval_clients" not in runs["server"] and "global_eval_clients" not in runs["none"]
    for key in ("train_loss", "personal_accuracy", "val_loss"):
        assert runs["server"][key] == runs["federated"][key] == runs["none"][key], key


def test_federated_evaluation_on_every_executor():
    """The wrapped client side runs on the batched and process-pool executors too (their training is their own;
    the global metrics are the hand computation's); an algorithm with entries that stay local has no global model."""
    ref = Experiment(_cfg(algorithm="fedper"), get_algorithm("fedper"))  # a ClientSide under the wrapper
    ref.run()
    assert ref.history[-1]["global_accuracy"] is None and ref.history[-1]["personal_accuracy"] is not None
    for executor in ("batched", "processes"):
        exp = Experiment(_cfg(executor=executor), get_algorithm("fedavg"))
        exp.run()
        acc, loss, _ = _by_hand(exp)
        assert exp.history[-1]["global_accuracy"] == pytest.approx(acc, rel=1e-12), executor
        assert exp.history[-1]["global_loss"] == pytest.approx(loss, rel=1e-12), executor


def _dataless(cfg) -> Federation:
    fed = build_federation(cfg)
    empty = Split(fed.test.x[:0], fed.test.y[:0])
    return Federation([ClientData(c.cid, empty, empty, empty) for c in fed.clients], empty, fed.num_classes,
                      fed.input_shape, fed.task, sizes=fed.client_sizes())


def test_a_federation_without_data_knows_sizes_and_refuses_what_needs_server_data():
    cfg = _cfg()
    fed = _dataless(cfg)
    assert not fed.holds_data and np.array_equal(fed.client_sizes(), build_federation(cfg).client_sizes())
    assert not fed.blinded().holds_data
    with pytest.raises(ConfigError, match="global_eval=server: the server holds no data"):
        Experiment(_cfg(global_eval="server"), get_algorithm("fedavg"), fed=fed, executor=object())  # type: ignore
    with pytest.raises(ConfigError, match="runs only on clients that hold their own data"):
        Experiment(cfg, get_algorithm("fedavg"), fed=fed)
    for algorithm, options, why in (("fedet", {}, "public set"), ("ensemble", {}, "server's test set"),
                                    ("msfusion", {"compare_assemblies": True}, "compare_assemblies")):
        c = _cfg(algorithm=algorithm, algorithm_options=options)
        with pytest.raises(ConfigError, match=f"cannot run on a server without data: .*{why}"):
            Experiment(c, get_algorithm(algorithm), fed=_dataless(c), executor=object())  # type: ignore


def test_global_eval_is_validated_and_fixed_on_resume(tmp_path):
    from fedfuse.rundir import check_resume

    with pytest.raises(ConfigError, match="global_eval: unknown value 'nope'; choose one of: server, federated, none"):
        _cfg(global_eval="nope")
    with pytest.raises(ConfigError, match="global_eval='server' but this run has global_eval='federated'"):
        check_resume(_cfg(global_eval="server").to_dict(), _cfg(), 1, "ck")


def test_central_dp_withholds_how_many_clients_the_global_metrics_average():
    """Under central DP the count of clients that answered an evaluation is withheld like the other counts; the
    global metrics themselves are aggregates and stay."""
    cfg = _cfg(dp="central", sampling="poisson", dp_noise=0.5)
    exp = Experiment(cfg, get_algorithm("fedavg"))
    exp.run()
    last = exp.history[-1]
    assert "global_eval_clients" not in last and last["global_accuracy"] is not None
