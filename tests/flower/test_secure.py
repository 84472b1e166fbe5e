"""secagg=true on Flower: Flower's own SecAgg+ (``SecAggPlusWorkflow`` + ``secaggplus_mod``) carrying fedfuse's
contributions (:mod:`fedfuse.flower.secure`).

Every job travels as a Flower message through Flower's protobuf serialisation to in-process ClientApp nodes
(:class:`~fedfuse.flower.executor.LocalGrid`); the real deployment (TLS SuperLink, SuperNodes, ``flwr run``) is
in ``tests/test_flower_deploy.py``.  Checked: the limb encoding survives Flower's quantiser and ring exactly; a
SecAgg+ run equals fedfuse's simulated SecAgg run exactly and the plain run within the fixed-point step; the
server receives masked vectors only; a node that drops out after sharing its keys is recovered.  Attack tests:
Flower's masks are a function of a 32-bit fold of the secret, fedfuse's are not, and every mask of a fedfuse
SecAgg+ round is expanded by fedfuse's AES-256-CTR generator; rounds with fewer than 3 nodes do not release a sum;
the threshold is a strict majority of every neighbourhood.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")

from fedfuse.config import RunConfig, apply, validate
from fedfuse.flower import secure
from fedfuse.flower.app import KEPT, client_app
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


@pytest.mark.parametrize("extra", [{}, {"dp": "central", "dp_noise": 0.7, "dp_clip": 0.3, "sampling": "poisson",
                                        "dp_reproducible": True, "dp_debug_metrics": True},  # seeded noise, counts
                                   {"secagg_neighbors": 2, "algorithm": "fedadam",
                                    "algorithm_options": {"tau": 1e-3}},
                                   {"algorithm": "scaffold", "algorithm_options": {"weighting": "samples"}}])
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
    if "c" in simulated.state:  # SCAFFOLD: c from the masked Δc sums; each c_i stayed on its node
        for k, v in simulated.state["c"].items():
            assert torch.equal(flower.state["c"][k], v) and torch.allclose(plain.state["c"][k], v, atol=1e-5), k
        assert all(st is None or st == {"c": KEPT} for st in flower.client_states.values())


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
    """Node 4 of 4 (clients 3 and 7) shares its keys, then never sends its masked vector: Flower's unmask step
    rebuilds its pairwise masks from the survivors' shares, the sum holds the six survivors of three nodes, and
    the model equals a plain round in which the same node is lost (within the fixed-point step)."""
    cfg = _cfg(secagg=True, rounds=1, clients=8, clients_per_round=8)
    secure_run, _ = _flower(cfg, nodes=4, fail={4: lambda call: call == 3})  # call 3: the masked-input step
    rec = secure_run.history[0]
    assert rec["dropped"] == [3, 7] and rec["replied"] == 6 and rec["secagg_clients"] == 6
    assert rec["secagg_nodes"] == 3
    plain, _ = _flower(_cfg(rounds=1, clients=8, clients_per_round=8), nodes=4, fail={4: lambda call: call == 1})
    assert plain.history[0]["dropped"] == [3, 7]
    for k, v in _model(plain).items():
        assert torch.allclose(_model(secure_run)[k], v, atol=1e-6), k


@pytest.mark.parametrize("nodes,fail", [(1, None), (2, None), (3, {3: lambda call: call == 3})])
def test_fewer_than_three_nodes_release_no_sum(nodes, fail) -> None:
    """One or two nodes in a round (each of two would learn the other's contribution from the next model), or
    three of which one drops before masking: the round's clients are lost, the round is skipped, the model is the
    initial one."""
    exp, _ = _flower(_cfg(secagg=True, rounds=1), nodes=nodes, fail=fail)
    rec = exp.history[0]
    assert rec["replied"] == 0 and rec["round_skipped"] and rec["dropped"] == list(range(6))
    assert "secagg_nodes" not in rec


def test_the_threshold_is_a_strict_majority_of_every_neighbourhood() -> None:
    """Flower's float rule round(½·h) gives t = h/2 for an even h; fedfuse passes t = ⌊f·h⌋ + 1 as a number."""
    for nodes in range(3, 40):
        for k in (0, 2, 4, 5):
            shares, t = secure.workflow_shares(secure.SecAggSettings(neighbors=k), nodes)
            holders = nodes if shares >= nodes else 2 * (shares >> 1) + 1  # Flower's ring neighbourhood
            assert 3 <= shares <= nodes and holders == (shares if shares < nodes else nodes)
            assert holders / 2 < t < shares, (nodes, k, shares, t)
    with pytest.raises(secure.SecAggAbort):
        secure.workflow_shares(secure.SecAggSettings(), 2)


def test_masks_come_from_the_whole_secret_not_a_32_bit_fold() -> None:
    """The attack on flwr 1.41's generator: two secrets with the same 32-bit XOR fold expand to the same mask, so
    the mask is one of 2^32 and a server that holds the rest of a masked vector searches them.  fedfuse's
    :func:`~fedfuse.flower.secure.aes_masks` keys AES-256-CTR with the whole secret: the same two secrets give
    unrelated masks, uniform on the ring."""
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    a = bytes(range(32))
    b = bytearray(a)
    b[0] ^= 0x5A
    b[4] ^= 0x5A  # the same bits flipped in two 4-byte words: the XOR fold is unchanged
    dims = [(1000,), ()]
    flwr_a, flwr_b = pseudo_rand_gen(a, secure.MOD, dims), pseudo_rand_gen(bytes(b), secure.MOD, dims)
    assert all(np.array_equal(x, y) for x, y in zip(flwr_a, flwr_b, strict=True))  # searchable: 32 bits decide
    ours_a, ours_b = secure.aes_masks(a, secure.MOD, dims), secure.aes_masks(bytes(b), secure.MOD, dims)
    assert not np.array_equal(ours_a[0], ours_b[0]) and ours_a[1].shape == ()
    assert all(np.array_equal(x, y) for x, y in zip(ours_a, secure.aes_masks(a, secure.MOD, dims), strict=True))
    assert ours_a[0].dtype == np.int64 and ours_a[0].min() >= 0 and ours_a[0].max() < secure.MOD
    assert abs(float(ours_a[0].mean()) / secure.MOD - 0.5) < 0.05


def test_every_mask_of_a_round_is_expanded_by_fedfuses_generator(monkeypatch) -> None:
    """In a SecAgg+ run, Flower's workflow (server) and mod (nodes) call fedfuse's generator for every mask —
    each node's self mask and pairwise masks, the server's unmasking — and never flwr's 32-bit one."""
    import importlib

    from flwr.common.secure_aggregation import secaggplus_utils

    calls: list[int] = []
    aes = secure.aes_masks

    def spy(seed, num_range, dims):
        calls.append(len(seed))
        return aes(seed, num_range, dims)

    def refuse(*a, **k):
        raise AssertionError("flwr's 32-bit-seeded generator expanded a mask")

    monkeypatch.setattr(secure, "aes_masks", spy)
    for name in secure.MASK_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "pseudo_rand_gen", refuse)
    monkeypatch.setattr(secaggplus_utils, "pseudo_rand_gen", refuse)
    exp, _ = _flower(_cfg(secagg=True, rounds=1))
    assert exp.history[0]["secagg_nodes"] == 3
    # 3 nodes: each a self mask and 2 pairwise masks; the server removes the 3 self masks
    assert len(calls) == 3 * 3 + 3 and all(n >= 32 for n in calls)


def test_a_client_a_node_cannot_encode_is_left_out_not_a_crash() -> None:
    """Every client's update exceeds the absolute bound the server sent (``norm_max``): each node's own encoding
    refuses its clients, no node can join the sum, the round is skipped — no crash, nothing released."""
    exp, _ = _flower(_cfg(secagg=True, rounds=1, norm_max=1e-6))
    rec = exp.history[0]
    assert rec["round_skipped"] and rec["replied"] == 0


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
    assert flw.summary["executor"]["used"] == "flower"
    for a, b in zip(flw.history, ref.history, strict=True):
        assert a["global_accuracy"] == b["global_accuracy"] and a["secagg_clients"] == b["secagg_clients"] == 4
        assert a["secagg_nodes"] >= 2


def test_a_node_refuses_to_unmask_a_sum_over_fewer_than_three_nodes() -> None:
    """The server asks a node for its unmasking shares with two active nodes: the node replies with an error (its
    dropout in Flower's workflow) instead of shares, so no sum over two nodes can be unmasked."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

    LocalGrid(client_app, 1)  # sets the run identity a ServerApp runtime would
    conf = ConfigRecord({Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: [1, 2], Key.DEAD_NODE_ID_LIST: [3]})
    msg = Message(RecordDict({RECORD_KEY_CONFIGS: conf}), dst_node_id=1, message_type="train")
    msg.metadata.__dict__["_message_id"] = msg.object_id

    def never(*a):
        raise AssertionError("the node went on with the protocol")

    reply = secure.secure_mod(msg, None, never)
    assert reply.has_error() and "only 2 nodes sent a masked vector" in reply.error.reason
