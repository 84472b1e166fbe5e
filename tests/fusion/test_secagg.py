"""Secure aggregation (SecAgg / SecAgg+ simulated in-process): exact sums in the ring, dropout recovery above the
threshold and a clear abort below it, a server transcript that holds only keys, ciphertext, masked vectors and the
shares the protocol allows, and FedAvg runs under secagg=true that equal the plain runs within float tolerance.

Attack tests, each as the adversary would attack: a server that runs a one- or two-client round to read a client's
update; a server that splits a client's shareholders when t ≤ n/2; clients whose values would wrap the ring; a
client that claims 10⁹ or 10¹² examples, scales its update ×1000, or forges the weight inside its masked input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedfuse.algorithms.base import RoundInfo
from fedfuse.config import ConfigError, RunConfig, apply, validate
from fedfuse.engine.loop import strip_timing
from fedfuse.fusion.secagg import (
    FRAC_BITS,
    MODULUS,
    EncodingError,
    SecAggAbort,
    _Client,
    agree,
    client_limit,
    dequantize,
    harary_neighbors,
    prg,
    quantize,
    ring_add,
    ring_sub,
    secure_sum,
    shamir_join,
    shamir_split,
    threshold_of,
)
from fedfuse.privacy import secure
from fedfuse.privacy.secure import SecAggSettings, client_encode, secure_round
from fedfuse.runner import experiment
from fedfuse.types import FitStats, Message


def _vectors(n: int, d: int = 300, seed: int = 0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {u: torch.randn(d, generator=g) * 3 for u in range(n)}


def test_quantisation_precision_and_range() -> None:
    x = torch.tensor([0.0, 1.0, -1.0, 3.14159, -2.5e-8, 1e6])
    q = quantize(x)
    assert bool((q >= 0).all()) and bool((q < MODULUS).all())
    assert float((dequantize(q) - x.double()).abs().max()) <= 2.0 ** -(FRAC_BITS + 1) + 1e-12
    with pytest.raises(EncodingError, match="beyond"):
        quantize(torch.tensor([2.0 ** 40]))
    with pytest.raises(EncodingError, match="non-finite"):
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
    ("fedprox", {"secagg_neighbors": 4, "dropout": 0.2, "clients_per_round": 8}),
    ("fedavgm", {}), ("scaffold", {"algorithm_options": {"weighting": "samples"}})])
def test_a_secagg_run_equals_the_plain_run(tmp_path, algorithm, extra) -> None:
    spy: list = []
    plain, plain_recs = _run(_cfg(tmp_path, "plain", algorithm=algorithm,
                                  **{k: v for k, v in extra.items() if k != "secagg_neighbors"}))
    secure, recs = _run(_cfg(tmp_path, "secure", algorithm=algorithm, secagg=True, **extra), spy)
    for k in plain:
        assert torch.allclose(plain[k].double(), secure[k].double(), atol=1e-5), k
    extra = {f"dc/{k}" for k in plain} if algorithm == "scaffold" else set()  # SCAFFOLD's Δc sums, masked too
    assert len(spy) == 3 and all(set(t) == set(plain) | extra | {"secagg/count"} for t in spy)  # sums only
    assert [r["dropped"] for r in recs] == [r["dropped"] for r in plain_recs]
    if "dropout" in extra:
        assert sum(r["secagg_recovered"] for r in recs) == sum(len(r["dropped"]) for r in recs) > 0
    assert all(r["secagg_survivors"] == r["replied"] for r in recs)


def test_a_round_below_the_threshold_is_skipped_and_says_why(tmp_path) -> None:
    _, recs = _run(_cfg(tmp_path, "drop", secagg=True, dropout=0.6, rounds=4, quorum=1))
    aborted = [r for r in recs if "secagg_abort" in r]
    assert aborted and all(r["round_skipped"] and "the threshold is" in r["secagg_abort"] for r in aborted)


def test_central_dp_under_secagg_equals_central_dp(tmp_path) -> None:
    # the research mode: both runs draw the same seeded noise (a run with a guarantee draws it from the OS)
    dp = dict(dp="central", dp_noise=0.7, dp_clip=0.3, sampling="poisson", dp_reproducible=True)
    plain, prec = _run(_cfg(tmp_path, "dp", **dp))
    secure, srec = _run(_cfg(tmp_path, "dpsa", secagg=True, **dp))
    for k in plain:  # the clients clip, the server adds the same seeded noise to the decoded sum
        assert torch.allclose(plain[k].double(), secure[k].double(), atol=1e-5), k
    assert [strip_timing(r)["dp_epsilon"] for r in prec] == [r["dp_epsilon"] for r in srec]


def test_secagg_config_refusals() -> None:
    for bad, match in ((dict(algorithm="fedma"), "'fedma' does not admit secure aggregation"),
                       (dict(late_replies="next-round"), "late_replies"),
                       (dict(sampling="clustered"), "clustered sampling reads"),
                       (dict(secagg_threshold=0.49), r"secagg_threshold: 0.49 gives t <= n/2"),
                       (dict(secagg_threshold=0.01), r"secagg_threshold: 0.01 gives t <= n/2"),
                       (dict(secagg_min_clients=2), "secagg_min_clients"),
                       (dict(clients_per_round=2), r"samples 2 clients, fewer than the 3 a secure sum needs"),
                       (dict(clients_per_round=4, secagg_min_clients=5), "fewer than the 5")):
        with pytest.raises(ConfigError, match=match):
            validate(apply(RunConfig(), {"secagg": True, **bad}))
    # executor=flower runs Flower's own SecAgg+ (fedfuse.flower.secure; tests/flower/test_secure.py)
    assert validate(apply(RunConfig(), {"secagg": True, "executor": "flower"})).secagg
    for bad in (dict(secagg_threshold=0.3), dict(secagg_min_clients=2)):  # and as one line, never a traceback
        with pytest.raises(ConfigError) as err:
            validate(apply(RunConfig(), {"secagg": True, **bad}))
        assert "\n" not in str(err.value)


# ---- attacks: a small cohort --------------------------------------------------------------------------------------
@pytest.mark.parametrize("lost", [[1, 2], [2]])
def test_a_one_or_two_client_round_releases_nothing(tmp_path, lost) -> None:
    """The server (or a network that loses replies) leaves one or two clients in a round: the protocol aborts
    before anything is unmasked, the model is the initial model after every round, and aggregate_sum never sees a
    sum over fewer than 3 clients."""
    cfg = _cfg(tmp_path, f"small{len(lost)}", secagg=True, clients=3, clients_per_round=3, rounds=2,
               corrupt="drop", corrupt_clients=lost)
    exp = experiment(cfg)
    initial: dict[str, torch.Tensor] = {}
    fresh = exp._fresh

    def snapshot() -> None:  # the model before round 1
        fresh()
        initial.update({k: v.clone() for k, v in exp.algo.global_model(exp.state)[0].items()})

    exp._fresh = snapshot
    sums: list = []
    inner = exp.algo.aggregate_sum
    exp.algo.aggregate_sum = lambda state, info, total: sums.append(total) or inner(state, info, total)
    exp.run()
    assert sums == []
    final = exp.algo.global_model(exp.state)[0]
    assert initial and all(torch.equal(final[k], initial[k]) for k in initial)  # client 0's update: in no model
    recs = [json.loads(line) for line in (exp.out / "metrics.jsonl").open()]
    reason = "the threshold is 2" if len(lost) == 2 else "a secure sum needs at least 3"  # t = 2 of 3 holders
    assert all(r["round_skipped"] and reason in r["secagg_abort"] for r in recs)
    assert all("secagg_survivors" not in r for r in recs)
    with pytest.raises(SecAggAbort, match="needs at least 3"):  # the protocol itself, with one client
        secure_sum({0: quantize(torch.ones(4))})
    with pytest.raises(ValueError, match="at least 3"):
        secure_sum({u: quantize(torch.ones(4)) for u in range(5)}, min_clients=1)


# ---- attacks: a threshold at most n/2 -----------------------------------------------------------------------------
def _split_view_attack(n: int, t: int, victim: int = 0) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A server that follows the protocol up to the unmasking step, then tells one part of the victim's
    shareholders "the victim survived" (they return shares of its self-mask seed b) and the others "the victim
    dropped" (shares of its mask key s).  Returns what it rebuilds of the victim's input (None if it cannot) and
    the input."""
    xs = {u: quantize(torch.randn(50, generator=torch.Generator().manual_seed(u))) for u in range(n)}
    clients = {u: _Client(u, xs[u]) for u in range(n)}
    roster = {u: c.advertise() for u, c in clients.items()}
    for u, c in clients.items():
        for v, blob in c.share_keys(roster, set(range(n)) - {u}, t).items():
            clients[v].inbox[u] = blob
    shared = set(range(n))
    y = clients[victim].masked_input(shared)  # the victim's masked input, as the server received it
    everyone = set(range(n))
    b_side, s_side = list(range(0, (n + 1) // 2)), list(range((n + 1) // 2, n))  # the victim itself says "b"
    b_shares = {h + 1: clients[h].unmask(everyone, shared)[victim][1] for h in b_side}
    s_shares = {h + 1: clients[h].unmask(everyone - {victim}, shared)[victim][1] for h in s_side}
    if len(b_shares) < t or len(s_shares) < t:
        return None, xs[victim]
    b = shamir_join(dict(sorted(b_shares.items())[:t]))
    s_sk = X25519PrivateKey.from_private_bytes(shamir_join(dict(sorted(s_shares.items())[:t])))
    x = ring_sub(y, prg(b, y.numel()))
    for v in sorted(shared - {victim}):  # the victim added +PRG(s_uv) for v > victim, −PRG(s_uv) for v < victim
        mask = prg(agree(s_sk, roster[v][1], b"mask"), y.numel())
        x = ring_sub(x, mask) if v > victim else ring_add(x, mask)
    return x, xs[victim]


def test_a_threshold_at_most_half_lets_a_split_view_server_unmask_a_client() -> None:
    """With n = 6 shareholders and t = 3 ≤ n/2 the server collects t shares of both of the victim's secrets and
    recovers its input exactly; with t = 4 > n/2 (fraction 0.5: ⌊0.5·6⌋ + 1) it cannot; a fraction below ½ is
    refused by the protocol and by the config."""
    recovered, x = _split_view_attack(6, 3)
    assert recovered is not None and torch.equal(recovered, x)
    assert threshold_of(6, 0.5) == 4
    assert _split_view_attack(6, threshold_of(6, 0.5))[0] is None
    assert all(threshold_of(h, 0.5) * 2 > h for h in range(1, 200))  # t > h/2 for every cohort at 0.5
    with pytest.raises(ValueError, match="t <= n/2"):
        secure_sum({u: quantize(torch.ones(3)) for u in range(6)}, threshold=0.4)
    with pytest.raises(ValueError, match="t <= n/2"):
        _round({0: 1.0, 1: 1.0, 2: 1.0}, {0: 1, 1: 1, 2: 1}, [1, 1, 1], threshold=0.4)


# ---- attacks and faults: encoding, weights, scaled updates --------------------------------------------------------
class _SumAlgo:
    """FedAvg's secure hooks in miniature: contribution n_i·(θ_i − θ) and n_i; the server keeps the decoded sum."""

    reply_kind = "state"

    def __init__(self, sizes: list[int]) -> None:
        self.ctx = type("Ctx", (), {"client_sizes": np.asarray(sizes)})()

    def secure_contribution(self, sent: Message, reply: Message) -> dict[str, torch.Tensor]:
        w = float(reply.num_examples)
        return {"x": (reply.tensors["x"].double() - sent.tensors["x"].double()) * w,
                "secagg/count": torch.tensor([w], dtype=torch.float64)}

    def aggregate_sum(self, state: dict, info: RoundInfo, total: dict) -> dict:
        return {**state, "total": total}


def _round(values: dict[int, float], counts: dict[int, int], sizes: list[int], absent=(), **settings):
    algo = _SumAlgo(sizes)
    sent = {c: Message({"x": torch.zeros(3, dtype=torch.float64)}) for c in [*values, *absent]}
    results = {c: Message({"x": torch.full((3,), v, dtype=torch.float64)}, stats=FitStats(num_examples=counts[c]))
               for c, v in values.items()}
    state, record, _ = secure_round(algo, {}, RoundInfo(0, 1), sent, results, SecAggSettings(**settings), 0)
    return state["total"], record


def test_values_that_would_wrap_the_ring_are_refused_never_decoded_wrongly() -> None:
    """Three clients at 1e11 each fit the ring alone (±1.37e11) but not their sum: without the cohort's bound the
    ring sum decodes to a wrong value silently; with it every client detects its own overflow and drops out, and
    the round aborts.  Within the bound (range/3) the sum is exact."""
    wrapped = quantize(torch.tensor([1e11]))
    for _ in range(2):
        wrapped = ring_add(wrapped, quantize(torch.tensor([1e11])))
    assert abs(float(dequantize(wrapped)[0]) - 3e11) > 1e11  # the old silent wrap (2.5e10 instead of 3e11)
    with pytest.raises(EncodingError, match="one client's share of the ring for a sum over 3 clients"):
        quantize(torch.tensor([1e11]), cohort=3)
    with pytest.raises(SecAggAbort, match="no contribution could be encoded"):
        _round({0: 1e11, 1: 1e11, 2: 1e11}, {0: 1, 1: 1, 2: 1}, [1, 1, 1])
    limit = client_limit(3)
    assert 4.5e10 < limit < 4.6e10 and abs(limit * 3 - 2.0 ** (61 - FRAC_BITS)) < 1e-3
    total, _ = _round({0: 4.5e10, 1: 4.5e10, 2: 4.5e10}, {0: 1, 1: 1, 2: 1}, [1, 1, 1])
    assert float(total["x"][0]) == pytest.approx(1.35e11, rel=1e-12)
    # a fourth client that received the payload counts in the cohort: 4.5e10 is then beyond range/4
    with pytest.raises(SecAggAbort):
        _round({0: 4.5e10, 1: 4.5e10, 2: 4.5e10}, {0: 1, 1: 1, 2: 1}, [1, 1, 1, 1], absent=[3])


@pytest.mark.parametrize("claimed", [10**9, 10**12, float("nan"), -5, 2.5])
def test_a_forged_example_count_is_that_clients_dropout(claimed) -> None:
    """A client claiming more examples than its public size (or a count that is not a non-negative integer) is
    refused by its own encoding: it drops out (counted, its masks recovered), the others' mean is exact, no
    crash — 10⁹ does not dominate and 10¹² does not raise."""
    total, record = _round({0: 1.0, 1: 2.0, 2: 3.0, 3: 500.0}, {0: 10, 1: 20, 2: 30, 3: claimed}, [10, 20, 30, 40])
    assert set(record["secagg_refused"]) == {"3"} and record["secagg_survivors"] == 3
    assert record["secagg_recovered"] == 1
    mean = float(total["x"][0]) / float(total["secagg/count"][0])
    assert mean == pytest.approx((10 * 1 + 20 * 2 + 30 * 3) / 60, abs=1e-6)


def test_a_weight_cap_bounds_an_honest_large_client() -> None:
    """``secagg_max_weight`` caps n_i before the client multiplies it in: a client of 1,000 examples weighs 50."""
    total, record = _round({0: 1.0, 1: 1.0, 2: 4.0}, {0: 10, 1: 10, 2: 1000}, [10, 10, 1000], max_weight=50)
    assert "secagg_refused" not in record
    assert float(total["secagg/count"][0]) == 70.0
    assert float(total["x"][0]) == pytest.approx(10 + 10 + 50 * 4.0, abs=1e-5)


def test_a_weight_forged_inside_the_masked_input_discards_the_round(monkeypatch) -> None:
    """A malicious client skips the honest encoding and masks a vector with weight 10⁹ (its declared count looks
    honest): the server cannot see it, but the decoded weight sum exceeds the survivors' public bound, and the
    round is discarded rather than dominated."""
    honest = secure.client_encode

    def malicious(algo, sent, reply, cohort, settings, size=None):
        contrib, vec = honest(algo, sent, reply, cohort, settings, size)
        if reply.tensors["x"][0] == 9.0:  # the attacker
            contrib = {"x": contrib["x"] * 1e8, "secagg/count": torch.tensor([1e9], dtype=torch.float64)}
            vec = quantize(torch.cat([contrib["x"], contrib["secagg/count"]]), settings.frac_bits)
        return contrib, vec

    monkeypatch.setattr(secure, "client_encode", malicious)
    with pytest.raises(SecAggAbort, match="forged weight"):
        _round({0: 1.0, 1: 2.0, 2: 9.0}, {0: 10, 1: 10, 2: 10}, [10, 10, 10])


def test_an_honest_clients_own_norm_check_bounds_a_scaled_update() -> None:
    """An honest client's code checks its update against ``norm_max`` (``check_updates``) and drops out when a
    fault scaled it; the server cannot check anything of the kind under SecAgg."""
    sent = Message({"x": torch.zeros(3, dtype=torch.float64)})
    reply = Message({"x": torch.full((3,), 1000.0, dtype=torch.float64)}, stats=FitStats(num_examples=1))
    with pytest.raises(EncodingError, match="exceeds the absolute bound norm_max=100"):
        client_encode(_SumAlgo([1]), sent, reply, 3, SecAggSettings(norm_max=100.0), 1)
    _, vec = client_encode(_SumAlgo([1]), sent, reply, 3, SecAggSettings(norm_max=0.0), 1)  # no check: encoded
    assert vec.numel() == 4


@pytest.mark.parametrize("corrupt", ["count", "scale"])
def test_a_faulty_client_under_secagg_is_a_dropout_not_a_crash(tmp_path, corrupt) -> None:
    """Runs: a client claiming 10¹² examples (which crashed the run before) or sending a ×1000 update is refused
    by its own encoding in every round; the model equals the run in which that client's reply is lost.  With
    ``check_updates=false`` (as for a malicious client, which skips its own checks) the ×1000 update is fused
    unseen — what SecAgg cannot check."""
    kw = dict(secagg=True, corrupt_clients=[1], rounds=2, norm_max=20.0, clients_per_round=10)
    bad, recs = _run(_cfg(tmp_path, corrupt, corrupt=corrupt, **kw))
    ref, _ = _run(_cfg(tmp_path, "lost", corrupt="drop", **kw))
    assert all(torch.equal(bad[k], ref[k]) for k in ref)
    assert all("1" in r["secagg_refused"] and r["secagg_survivors"] == r["replied"] - 1 for r in recs)
    if corrupt == "scale":
        unseen, _ = _run(_cfg(tmp_path, "unchecked", corrupt=corrupt, **{**kw, "check_updates": False}))
        drift = max(float((unseen[k].double() - ref[k].double()).abs().max()) for k in ref)
        assert drift > 1.0


def test_the_weight_check_takes_central_dps_centred_count() -> None:
    """Under central DP the weight slot sums the centred bits b_i − ½: a round in which every client was clipped
    decodes to −n/2 and is kept; a sum beyond ±n/2 (a forged bit) is discarded, as a forged weight is without DP.
    The settings say which: ``SecAggSettings.from_config`` sets ``centred_count`` for ``dp=central``."""
    centred = SecAggSettings(centred_count=True)
    total = {secure.WEIGHT_KEY: torch.tensor([-1.5], dtype=torch.float64)}
    secure._check_total(total, [0, 1, 2], [10, 10, 10], centred)  # all three clipped: kept
    secure._check_total({secure.WEIGHT_KEY: torch.tensor([1.5], dtype=torch.float64)}, [0, 1, 2], None, centred)
    for forged in (-1.6, 1.6, float("nan")):
        with pytest.raises(SecAggAbort, match="forged weight"):
            secure._check_total({secure.WEIGHT_KEY: torch.tensor([forged], dtype=torch.float64)}, [0, 1, 2],
                                [10, 10, 10], centred)
    with pytest.raises(SecAggAbort, match="forged weight"):  # without DP a negative weight sum is forged
        secure._check_total(total, [0, 1, 2], [10, 10, 10], SecAggSettings())
    cfg = validate(apply(RunConfig(), {"secagg": True, "dp": "central", "sampling": "poisson"}))
    assert SecAggSettings.from_config(cfg).centred_count
    assert not SecAggSettings.from_config(validate(apply(RunConfig(), {"secagg": True}))).centred_count
