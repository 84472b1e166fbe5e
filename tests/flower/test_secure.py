"""secagg=true on Flower: Flower's own SecAgg+ (``SecAggPlusWorkflow`` + ``secaggplus_mod``) carrying fedfuse's
contributions (:mod:`fedfuse.flower.secure`).

Every job travels as a Flower message through Flower's protobuf serialisation to in-process ClientApp nodes
(:class:`~fedfuse.flower.executor.LocalGrid`); the real deployment (TLS SuperLink, SuperNodes, ``flwr run``) is
in ``tests/test_flower_deploy.py``.  Checked: the limb encoding survives Flower's quantiser and ring exactly; a
SecAgg+ run equals fedfuse's simulated SecAgg run exactly and the plain run within the fixed-point step; the
server receives masked vectors only; a node that drops out after sharing its keys is recovered.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")

from fedfuse.config import RunConfig, apply, validate
from fedfuse.flower import secure
from fedfuse.flower.app import client_app
from fedfuse.flower.executor import FlowerExecutor, LocalGrid
from fedfuse.fusion.secagg import MODULUS, ring_add
from fedfuse.runner import experiment


def _cfg(**kw) -> RunConfig:
    base = dict(algorithm="fedavg", dataset="digits", partition="dirichlet", model="mlp", clients=6,
                clients_per_round=6, rounds=3, batch_size=32, lr=0.05, seed=3, plots=False, threads=1,
                model_options={"widths": [16]}, partition_options={"alpha": 0.5, "min_size": 20})
    base.update(kw)
    return validate(apply(RunConfig(), base))


def _flower(cfg: RunConfig, nodes: int = 3, fail=None, keep: bool = False):
    grid = LocalGrid(client_app, nodes, fail=fail)
    grid.keep_replies = keep
    exp = experiment(cfg, executor=FlowerExecutor(grid, cfg, cfg.seed))
    exp.run()
    return exp, grid


def _model(exp) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in exp.algo.global_model(exp.state)[0].items()}


@pytest.mark.parametrize("nodes", [1, 2, 3, 7, 1023])
def test_limbs_pass_flowers_quantiser_and_ring_exactly(nodes: int) -> None:
    """Flower's own quantize → masked sum mod 2^32 → dequantize → offset → 1/N of the limbs gives back the exact
    sum in Z_2^62, also with every limb at its largest value (the carries of 1023 nodes)."""
    from flwr.common.secure_aggregation.quantization import dequantize, quantize

    g = torch.Generator().manual_seed(nodes)
    rings = [torch.randint(0, MODULUS, (257,), generator=g, dtype=torch.int64) for _ in range(nodes)]
    rings[0][:3] = torch.tensor([0, MODULUS - 1, 1])
    if nodes == 1023:
        rings = [torch.full((5,), MODULUS - 1, dtype=torch.int64)] * nodes
    total, summed = None, None
    for r in rings:
        # Flower's stochastic rounding (int32; the node adds its int64 masks to it)
        q = [a.astype(np.int64) for a in quantize(secure.to_limbs(r), secure.CLIP, secure.TARGET)]
        assert all(np.array_equal(a, ((r.numpy() >> (secure.LIMB_BITS * j)) & (secure.TARGET - 1)))
                   for j, a in enumerate(q))  # ... is the identity on the limbs
        total = q if total is None else [a + b for a, b in zip(total, q, strict=True)]
        summed = r if summed is None else ring_add(summed, r)
    assert total is not None and summed is not None
    recon = [a % secure.MOD for a in total]  # what Flower's unmask stage holds once the masks are removed
    means = [v + (-(nodes - 1) * secure.CLIP) for v in dequantize(recon, secure.CLIP, secure.TARGET)]
    means = [v * (secure.TARGET / (nodes * secure.TARGET)) for v in means]
    assert torch.equal(secure.from_limbs(means, nodes), summed)


@pytest.mark.parametrize("extra", [{}, {"dp": "central", "dp_noise": 0.7, "dp_clip": 0.3, "sampling": "poisson"},
                                   {"secagg_neighbors": 2, "algorithm": "fedadam",
                                    "algorithm_options": {"tau": 1e-3}}])
def test_secagg_plus_on_flower_equals_simulated_secagg_and_the_plain_run(extra) -> None:
    """The same run three ways: fedfuse's simulated SecAgg (in-process), Flower's SecAgg+ over Flower messages,
    and no secure aggregation.  Flower's sum is the exact ring sum: the model equals the simulated SecAgg run bit
    for bit, and the plain run within the fixed-point step; the metrics agree."""
    simulated = experiment(_cfg(secagg=True, **extra))
    simulated.run()
    plain = experiment(_cfg(**extra))
    plain.run()
    flower, grid = _flower(_cfg(secagg=True, **extra))
    assert grid.calls >= 4 * 3  # four SecAgg+ steps a round
    for k, v in _model(simulated).items():
        assert torch.equal(_model(flower)[k], v), k
        assert torch.allclose(_model(plain)[k], v, atol=1e-5), k
    for a, b, c in zip(flower.history, simulated.history, plain.history, strict=True):
        assert a["global_accuracy"] == b["global_accuracy"]
        assert abs(a["global_accuracy"] - c["global_accuracy"]) <= 0.01
        assert a["secagg_clients"] == 6 and a["secagg_nodes"] == 3 and a["replied"] == 6
        assert a.get("dp_epsilon") == b.get("dp_epsilon")


def test_the_server_receives_masked_vectors_and_the_aggregate_only(monkeypatch) -> None:
    """Every reply that reaches the server: no array record holds anything, and each node's masked vector shares
    no more entries with its plain limbs than chance; the strategy code gets one aggregate for all, and the loop
    gets replies without tensors."""
    from flwr.common import bytes_to_ndarray, parameters_to_ndarrays
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
    from flwr.common.serde import message_from_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage

    plain: list[list[np.ndarray]] = []
    to_limbs = secure.to_limbs
    monkeypatch.setattr(secure, "to_limbs", lambda r: plain.append(to_limbs(r)) or plain[-1])
    seen: list[list[list[np.ndarray]]] = []
    aggregate_fit = secure._Round.aggregate_fit

    def spy(self, server_round, results, failures):
        seen.append([parameters_to_ndarrays(res.parameters) for _, res in results])
        return aggregate_fit(self, server_round, results, failures)

    monkeypatch.setattr(secure._Round, "aggregate_fit", spy)
    replies: list = []
    fit = FlowerExecutor.fit

    def loop_view(self, target, jobs):
        out = fit(self, target, jobs)
        replies.extend(r for r, _ in out.values())
        return out

    monkeypatch.setattr(FlowerExecutor, "fit", loop_view)
    cfg = _cfg(secagg=True, rounds=2)
    _, grid = _flower(cfg, keep=True)
    masked = []
    for raw in grid.received:
        proto = ProtoMessage()
        proto.ParseFromString(raw)
        msg = message_from_proto(proto)
        if msg.metadata.message_type != "train":
            continue
        assert all(len(rec) == 0 for rec in msg.content.array_records.values())  # no tensor travels in the clear
        conf = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if conf is not None and Key.MASKED_PARAMETERS in conf:
            masked.append([bytes_to_ndarray(b) for b in conf[Key.MASKED_PARAMETERS]][1:])  # [0]: weight factor
    assert len(masked) == len(plain) == 2 * 3
    for m in masked:  # each masked limb vector against every plain one: agreement at chance level (2^-32)
        for p in plain:
            same = sum(int((a % secure.MOD == (b + secure.CLIP).astype(np.int64)).sum()) for a, b in zip(m, p))
            assert same <= 2, same
    assert len(seen) == 2 and all(len(r) == 3 for r in seen)
    for round_results in seen:  # the workflow hands the strategy the same aggregate in every result
        for arrays in round_results[1:]:
            assert all(np.array_equal(a, b) for a, b in zip(arrays, round_results[0], strict=True))
    assert len(replies) == 2 * 6 and all(isinstance(r, secure.MaskedReply) and not r.tensors for r in replies)
    assert len({id(r.summed) for r in replies}) == 2


def test_a_node_that_drops_after_sharing_keys_is_recovered() -> None:
    """Node 3 (clients 2 and 5) shares its keys, then never sends its masked vector: Flower's unmask step
    rebuilds its pairwise masks from the survivors' shares, the sum holds the four survivors, and the model
    equals a plain round in which the same node is lost (within the fixed-point step)."""
    cfg = _cfg(secagg=True, rounds=1)
    secure_run, _ = _flower(cfg, fail={3: lambda call: call == 3})  # call 3: the masked-input step of round 1
    rec = secure_run.history[0]
    assert rec["dropped"] == [2, 5] and rec["replied"] == 4 and rec["secagg_clients"] == 4
    plain, _ = _flower(_cfg(rounds=1), fail={3: lambda call: call == 1})  # the plain round's fit call
    assert plain.history[0]["dropped"] == [2, 5]
    for k, v in _model(plain).items():
        assert torch.allclose(_model(secure_run)[k], v, atol=1e-6), k


def test_too_few_nodes_skip_the_round_and_say_why() -> None:
    """Flower's SecAgg+ needs two nodes: with one, the round's clients are lost and the round is skipped."""
    exp, _ = _flower(_cfg(secagg=True, rounds=1), nodes=1)
    rec = exp.history[0]
    assert rec["replied"] == 0 and rec["round_skipped"] and rec["dropped"] == list(range(6))


@pytest.mark.slow
def test_secagg_in_flowers_simulation_runtime_equals_simulated_secagg() -> None:
    """``--executor flower --set secagg=true``: Flower's SecAgg+ between Ray-simulated nodes; the metrics equal
    fedfuse's simulated SecAgg run."""
    pytest.importorskip("ray", reason="needs the flower extra: pip install -e '.[flower]'")
    from fedfuse.api import run

    opts = dict(algorithm="fedavg", dataset="digits", clients=4, clients_per_round=4, rounds=2, threads=1,
                model_options={"widths": [16]}, plots=False, secagg=True)
    ref = run(**opts)
    flw = run(**opts, executor="flower")
    assert flw.summary["executor"].startswith("flower")
    for a, b in zip(flw.history, ref.history, strict=True):
        assert a["global_accuracy"] == b["global_accuracy"] and a["secagg_clients"] == b["secagg_clients"] == 4
        assert a["secagg_nodes"] >= 2
