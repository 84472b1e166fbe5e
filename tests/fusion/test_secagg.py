"""Secure aggregation (SecAgg / SecAgg+ simulated in-process): exact sums in the ring, dropout recovery above the
threshold and a clear abort below it, a server transcript that holds only keys, ciphertext, masked vectors and the
shares the protocol allows, and FedAvg runs under secagg=true that equal the plain runs within float tolerance."""

from __future__ import annotations

import json

import pytest
import torch

from fedfuse.config import ConfigError, RunConfig, apply, validate
from fedfuse.engine.loop import strip_timing
from fedfuse.fusion.secagg import (
    FRAC_BITS,
    MODULUS,
    SecAggAbort,
    dequantize,
    harary_neighbors,
    quantize,
    secure_sum,
    shamir_join,
    shamir_split,
    threshold_of,
)
from fedfuse.runner import experiment


def _vectors(n: int, d: int = 300, seed: int = 0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {u: torch.randn(d, generator=g) * 3 for u in range(n)}


def test_quantisation_precision_and_range() -> None:
    x = torch.tensor([0.0, 1.0, -1.0, 3.14159, -2.5e-8, 1e6])
    q = quantize(x)
    assert bool((q >= 0).all()) and bool((q < MODULUS).all())
    assert float((dequantize(q) - x.double()).abs().max()) <= 2.0 ** -(FRAC_BITS + 1) + 1e-12
    with pytest.raises(ValueError, match="beyond"):
        quantize(torch.tensor([2.0 ** 40]))
    with pytest.raises(ValueError, match="non-finite"):
        quantize(torch.tensor([float("nan")]))


def test_shamir_any_t_shares_rebuild_and_fewer_do_not() -> None:
    secret = bytes(range(32))
    shares = shamir_split(secret, [1, 2, 3, 4, 5, 6], t=4)
    for pick in ([1, 2, 3, 4], [3, 4, 5, 6], [1, 3, 5, 6]):
        assert shamir_join({x: shares[x] for x in pick}) == secret
    with pytest.raises(SecAggAbort):  # three points of a cubic: (overwhelmingly) not the secret, not even 32 bytes
        shamir_join({x: shares[x] for x in (1, 2, 3)})
    assert threshold_of(7, 0.5) == 4 and threshold_of(5, 0.5) == 3 and threshold_of(10, 0.3) == 4


def test_harary_graph_is_k_regular_and_public() -> None:
    ids = list(range(0, 40, 2))
    g = harary_neighbors(ids, 6, seed=5)
    assert all(len(v) == 6 and u not in v for u, v in g.items())
    assert all(u in g[v] for u in g for v in g[u])  # symmetric
    assert g == harary_neighbors(ids, 6, seed=5) and g != harary_neighbors(ids, 6, seed=6)
    assert harary_neighbors(ids, 0, seed=5) == {u: set(ids) - {u} for u in ids}


@pytest.mark.parametrize("neighbors", [0, 4])
@pytest.mark.parametrize("drops", [(set(), set()), ({2, 5}, set()), ({3}, {1})])
def test_the_sum_is_exact_with_and_without_recovered_dropouts(neighbors, drops) -> None:
    xs = _vectors(9)
    q = {u: quantize(x) for u, x in xs.items()}
    before, after = drops
    total, tr = secure_sum(q, neighbors=neighbors, drop_before_masking=before, drop_before_unmasking=after)
    survivors = [u for u in q if u not in before]
    exact = torch.zeros_like(total)
    for u in survivors:
        exact = torch.remainder(exact + q[u], MODULUS)
    assert torch.equal(total, exact)  # exact in the ring
    plain = sum(xs[u].double() for u in survivors)
    assert float((dequantize(total) - plain).abs().max()) <= len(survivors) * 2.0 ** -(FRAC_BITS + 1)
    assert {u for u, k in tr.reconstructed.items() if k == "s"} == before  # the dropped clients' mask keys


def test_the_server_sees_only_keys_ciphertext_masked_vectors_and_allowed_shares() -> None:
    xs = _vectors(8, d=4000)
    q = {u: quantize(x) for u, x in xs.items()}
    total, tr = secure_sum(q, neighbors=4, drop_before_masking={6})
    kinds = {step for step, _, _ in tr.messages}
    assert kinds == {"public_keys", "ciphertext", "masked_input", "unmask_share"}
    for step, u, what in tr.messages:
        if step == "public_keys":
            assert [len(k) for k in what] == [32, 32]
        elif step == "ciphertext":  # 2 shares × 66 bytes + 12 nonce + 16 tag, not readable without the key
            v, blob = what
            assert len(blob) == 12 + 132 + 16 and v != u
        elif step == "masked_input":
            assert what.dtype == torch.int64 and what.shape == q[u].shape
            assert float((what == q[u]).double().mean()) < 0.01  # every coordinate is masked
            assert abs(float(what.double().mean()) / MODULUS - 0.5) < 0.02  # and looks uniform on the ring
            for v in q:  # no masked vector is another client's input either
                assert not torch.equal(what, q[v])
        else:
            v, kind, _ = what
            assert kind == ("s" if v == 6 else "b")  # the self mask of survivors, the mask key of the dropped
    assert set(tr.masked_inputs()) == set(q) - {6}
    plain = sum(xs[u].double() for u in q if u != 6)
    assert float((dequantize(total) - plain).abs().max()) < 1e-6  # and yet the sum comes out
    per_client: dict[int, set[str]] = {}
    for step, _, what in tr.messages:
        if step == "unmask_share":
            per_client.setdefault(what[0], set()).add(what[1])
    assert all(len(k) == 1 for k in per_client.values())  # never both secrets of one client


def test_too_many_dropouts_abort_with_a_clear_error() -> None:
    q = {u: quantize(x) for u, x in _vectors(7).items()}
    with pytest.raises(SecAggAbort, match=r"only 3 of 7 clients sent a masked input; the threshold is 4"):
        secure_sum(q, drop_before_masking={0, 1, 2, 3})
    with pytest.raises(SecAggAbort, match=r"shares from surviving clients; the threshold is 3"):
        # SecAgg+ with k = 4: a survivor whose neighbours mostly stop helping cannot be unmasked
        g = harary_neighbors(sorted(q), 4, seed=0)
        victim = 0
        secure_sum(q, neighbors=4, graph_seed=0, drop_before_unmasking=set(sorted(g[victim])[:3]) | {victim})


def _cfg(tmp_path, name: str, **kw) -> RunConfig:
    base = dict(dataset="digits", partition="dirichlet", model="mlp", clients=10, clients_per_round=6, rounds=3,
                batch_size=32, lr=0.05, seed=3, out=str(tmp_path / name), plots=False, model_options={"widths": [16]},
                partition_options={"alpha": 0.5, "min_size": 20})
    base.update(kw)
    return apply(RunConfig(), base)


def _run(cfg: RunConfig, spy: list | None = None) -> tuple[dict, list[dict]]:
    exp = experiment(cfg)
    if spy is not None:
        def refuse(*a, **k):
            raise AssertionError("the server received individual replies under secagg")

        inner = exp.algo.aggregate_sum

        def record(state, info, total):
            spy.append({k: v.clone() for k, v in total.items()})
            return inner(state, info, total)

        exp.algo.aggregate_fit = refuse
        exp.algo.aggregate_sum = record
    exp.run()
    recs = [json.loads(line) for line in (exp.out / "metrics.jsonl").open()]
    return exp.algo.global_model(exp.state)[0], recs


@pytest.mark.parametrize("algorithm,extra", [
    ("fedavg", {}), ("fedadam", {"algorithm_options": {"tau": 1e-3}}),
    ("fedprox", {"secagg_neighbors": 4, "dropout": 0.2, "clients_per_round": 8})])
def test_a_secagg_run_equals_the_plain_run(tmp_path, algorithm, extra) -> None:
    spy: list = []
    plain, plain_recs = _run(_cfg(tmp_path, "plain", algorithm=algorithm,
                                  **{k: v for k, v in extra.items() if k != "secagg_neighbors"}))
    secure, recs = _run(_cfg(tmp_path, "secure", algorithm=algorithm, secagg=True, **extra), spy)
    for k in plain:
        assert torch.allclose(plain[k].double(), secure[k].double(), atol=1e-5), k
    assert len(spy) == 3 and all(set(t) == set(plain) | {"secagg/count"} for t in spy)  # sums, nothing per client
    assert [r["dropped"] for r in recs] == [r["dropped"] for r in plain_recs]
    if "dropout" in extra:
        assert sum(r["secagg_recovered"] for r in recs) == sum(len(r["dropped"]) for r in recs) > 0
    assert all(r["secagg_survivors"] == r["replied"] for r in recs)


def test_a_round_below_the_threshold_is_skipped_and_says_why(tmp_path) -> None:
    _, recs = _run(_cfg(tmp_path, "drop", secagg=True, dropout=0.6, rounds=4, quorum=1))
    aborted = [r for r in recs if "secagg_abort" in r]
    assert aborted and all(r["round_skipped"] and "the threshold is" in r["secagg_abort"] for r in aborted)


def test_central_dp_under_secagg_equals_central_dp(tmp_path) -> None:
    dp = dict(dp="central", dp_noise=0.7, dp_clip=0.3, sampling="poisson")
    plain, prec = _run(_cfg(tmp_path, "dp", **dp))
    secure, srec = _run(_cfg(tmp_path, "dpsa", secagg=True, **dp))
    for k in plain:  # the clients clip, the server adds the same seeded noise to the decoded sum
        assert torch.allclose(plain[k].double(), secure[k].double(), atol=1e-5), k
    assert [strip_timing(r)["dp_epsilon"] for r in prec] == [r["dp_epsilon"] for r in srec]


def test_secagg_config_refusals() -> None:
    for bad, match in ((dict(algorithm="fedma"), "'fedma' does not admit secure aggregation"),
                       (dict(late_replies="next-round"), "late_replies"),
                       (dict(sampling="clustered"), "clustered sampling reads")):
        with pytest.raises(ConfigError, match=match):
            validate(apply(RunConfig(), {"secagg": True, **bad}))
    # executor=flower runs Flower's own SecAgg+ (fedfuse.flower.secure; tests/flower/test_secure.py)
    assert validate(apply(RunConfig(), {"secagg": True, "executor": "flower"})).secagg
