"""Secure aggregation as a mechanism (:mod:`fedfuse.privacy.mean`): a way to compute the sum of a mean-of-deltas
update.  FedProx, FedAvgM, FedAdam and SCAFFOLD wear it without code of their own.

* the math, by hand: :class:`SecureSum`'s contributions and mean on a three-client case computed on paper, and
  SCAFFOLD's control-variate entries that enter with weight 1;
* the invariant, per algorithm: the mean the algorithm's step receives from a secure round equals the exact
  weighted mean of the same replies within the fixed-point bound n·2^-(f+1)/D (each of n contributions is rounded
  to 2^-f), and the new state equals the algorithm's plain rule;
* attacks, as the adversary would run them: a client claiming 10¹² examples under SCAFFOLD (its encoding refuses:
  a counted dropout, the others' mean exact); a client that skips its own code and masks a forged weight (the
  round is discarded); the server reading the masked inputs (each looks uniform on the ring; no client's Δc is in
  it); and under central DP a client's huge Δc_i clipped with its model update as one vector.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedfuse.config import RunConfig, apply
from fedfuse.engine.context import RoundInfo
from fedfuse.fusion.secagg import FRAC_BITS, MODULUS, SecAggAbort, dequantize, quantize
from fedfuse.privacy.central import CLIP_META, CentralDP
from fedfuse.privacy.dp import DPSettings
from fedfuse.privacy.mean import WEIGHT_KEY, MeanOfDeltas, SecureSum
from fedfuse.privacy.secure import SecAggSettings, secure_round
from fedfuse.runner import experiment
from fedfuse.types import FitStats, Message

OPTIONS = {"fedprox": {"mu": 0.1}, "fedavgm": {}, "fedadam": {"tau": 1e-3}, "scaffold": {},
           "scaffold-samples": {"weighting": "samples"}}
N, M = 8, 4


# ---- the math by hand ---------------------------------------------------------------------------------------
def test_contributions_and_mean_by_hand() -> None:
    """b = (w: [1, 2], dc/w: [0, 0]); three clients with weights 2, 1, 3.

    client 0: w [1.5, 2.0], dc [0.25, 0]  → w·Δ = [1.0, 0.0],  dc Δ = [0.25, 0]   (dc: weight 1)
    client 1: w [0.0, 3.0], dc [0.0, 1.0] → w·Δ = [−1.0, 1.0], dc Δ = [0.0, 1.0]
    client 2: w [2.0, 2.5], dc [−0.5, 0.5] → w·Δ = [3.0, 1.5], dc Δ = [−0.5, 0.5]
    Σ = w [3.0, 2.5], dc [−0.25, 1.5], D = 6  →  mean w = [1.5, 2.41666…], mean dc = [−1/24, 1/4]."""
    sums = SecureSum(MeanOfDeltas(unweighted=("dc/",)))
    base = {"w": torch.tensor([1.0, 2.0]), "dc/w": torch.zeros(2)}
    replies = [({"w": [1.5, 2.0], "dc/w": [0.25, 0.0]}, 2), ({"w": [0.0, 3.0], "dc/w": [0.0, 1.0]}, 1),
               ({"w": [2.0, 2.5], "dc/w": [-0.5, 0.5]}, 3)]
    contribs = [sums.contribution(base, {k: torch.tensor(v) for k, v in r.items()}, w, {}) for r, w in replies]
    assert contribs[0]["w"].tolist() == [1.0, 0.0] and contribs[0]["dc/w"].tolist() == [0.25, 0.0]
    assert contribs[2]["w"].tolist() == [3.0, 1.5] and contribs[2]["dc/w"].tolist() == [-0.5, 0.5]
    assert [float(c[WEIGHT_KEY]) for c in contribs] == [2.0, 1.0, 3.0]
    total = {k: sum(c[k] for c in contribs) for k in contribs[0]}
    mean, d, record = sums.mean({}, base, total, 0)
    assert d == 6.0 and record is None
    assert mean["w"].tolist() == pytest.approx([1.5, 2.0 + 2.5 / 6])
    assert mean["dc/w"].tolist() == pytest.approx([-0.25 / 6, 1.5 / 6])
    assert (mean["dc/w"] * d).tolist() == pytest.approx([-0.25, 1.5])  # Σ Δc back, unweighted
    nothing, d0, _ = sums.mean({}, base, {**total, WEIGHT_KEY: torch.zeros(1, dtype=torch.float64)}, 0)
    assert nothing is None and d0 == 0.0  # no weight: no mean (the state stays)


def test_with_central_dp_a_client_masks_its_clipped_update_and_centred_bit() -> None:
    """Under dp=central the weight slot is b_i − ½ and the update is clipped at the payload's clip; the server's mean
    has the fixed denominator m."""
    central = CentralDP(DPSettings(mode="central", noise=0.0, clip=1.0), per_round=4, seed=0)
    sums = SecureSum(MeanOfDeltas(), central)
    base = {"w": torch.zeros(2)}
    big = sums.contribution(base, {"w": torch.tensor([3.0, 4.0])}, 7.0, {CLIP_META: 1.0})  # norm 5 → clipped
    small = sums.contribution(base, {"w": torch.tensor([0.3, 0.4])}, 7.0, {CLIP_META: 1.0})
    assert big["w"].tolist() == pytest.approx([0.6, 0.8]) and float(big[WEIGHT_KEY]) == -0.5
    assert small["w"].tolist() == pytest.approx([0.3, 0.4]) and float(small[WEIGHT_KEY]) == 0.5
    total = {k: big[k] + small[k] for k in big}
    mean, d, record = sums.mean({}, base, total, 0)
    assert d == 4.0 and mean["w"].tolist() == pytest.approx([0.9 / 4, 1.2 / 4]) and record["noise_std"] == 0.0


# ---- per algorithm: SecAgg computes the plain rule's sum ----------------------------------------------------------
def _algo(name: str, **kw):
    algorithm = name.split("-")[0]
    cfg = apply(RunConfig(), dict(dataset="digits", partition="iid", model="mlp", clients=N, clients_per_round=M,
                                  rounds=1, seed=5, out=None, plots=False, model_options={"widths": [8]},
                                  algorithm=algorithm, algorithm_options=OPTIONS[name], secagg=True, **kw))
    return experiment(cfg).algo


def _round(algo, clients=range(M), forge: dict[int, float] | None = None):
    """The payloads and replies of one round: the global model moved by a fixed random delta (SCAFFOLD: a Δc of
    its own), each client declaring its public size (or the ``forge``d count)."""
    state = algo.init_state()
    info = RoundInfo(index=0, total=1)
    sent = algo.configure_fit(state, info, list(clients))
    results = {}
    for c in clients:
        g = torch.Generator().manual_seed(100 + c)
        tensors = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state["global"].items()}
        if "c" in state:
            tensors.update({f"dc/{k}": 0.1 * torch.randn(v.shape, generator=g) for k, v in state["c"].items()})
        n = (forge or {}).get(c, int(algo.ctx.client_sizes[c]))
        results[c] = Message(tensors, {}, FitStats(num_examples=n))
    return state, info, sent, results


def _spy_mean(algo) -> list:
    seen: list = []
    inner = algo.step_on_mean

    def spy(state, info, mean, denominator, replies):
        seen.append(({k: v.clone() for k, v in mean.items()}, denominator))
        return inner(state, info, mean, denominator, replies)

    algo.step_on_mean = spy
    return seen


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_secagg_computes_the_plain_rule_s_sum(name: str) -> None:
    algo = _algo(name)
    state, info, sent, results = _round(algo)
    seen = _spy_mean(algo)
    new, record, _ = secure_round(algo, state, info, sent, results, SecAggSettings(), seed=0)
    assert record["secagg_survivors"] == M
    ((mean, d),) = seen
    w = {c: algo.delta_weight(r) for c, r in results.items()}
    assert d == sum(w.values())  # the decoded weight sum: integers, exact
    bound = M * 2.0 ** -(FRAC_BITS + 1) / d  # n contributions each rounded to 2^-f, divided by D
    for k, b in algo.server_base(state).items():
        if not b.is_floating_point():
            continue
        ws = {c: 1.0 if k.startswith("dc/") else w[c] for c in results}
        exact = b.double() + sum(ws[c] * (r.tensors[k].double() - b.double()) for c, r in results.items()) / d
        err = float((mean[k].double() - exact).abs().max())
        assert err <= bound + 1e-7 * float(exact.abs().max()), (k, err, bound)  # + the float32 of the mean
    plain = algo.fuse(state, info, results)
    for part in ("global", "c") if "c" in state else ("global",):
        for k, v in plain[part].items():
            assert torch.allclose(new[part][k].double(), v.double(), atol=1e-5), (part, k)
    if "server_opt" in plain:  # the optimiser took the same step (momentum / Adam moments)
        assert new["server_opt"].keys() == plain["server_opt"].keys()


def test_a_new_mean_of_deltas_algorithm_admits_secagg_without_code_of_its_own() -> None:
    """FedAvgM declares its server update and its server optimiser, nothing about privacy; it admits SecAgg and
    central DP by that declaration alone (its privacy entry is derived)."""
    from fedfuse.algorithms import ALGORITHMS
    from fedfuse.algorithms.mean_base import DeltaMean

    cls = ALGORITHMS["fedavgm"]
    own = set(vars(cls))
    assert own.isdisjoint({"secure_contribution", "aggregate_sum", "aggregate_fit", "configure_fit", "fit",
                           "client_program", "central_dp", "secure_sum"})
    assert issubclass(cls, DeltaMean) and "server_update" in own
    entry = cls.privacy_for()
    assert entry.secagg.ok and entry.central_dp.ok and entry.secagg.why.startswith("derived")


# ---- attacks --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["scaffold", "scaffold-samples"])
def test_a_forged_1e12_example_count_under_scaffold_is_that_client_s_dropout(name: str) -> None:
    """A client claiming 10¹² examples (to dominate the weighted mean, or crash the encoding) is refused by its own
    encoding — a counted dropout whose masks are recovered — and the round's mean is the other clients' exactly as
    if it had not replied."""
    algo = _algo(name)
    state, info, sent, results = _round(algo, range(M + 1), forge={M: 10 ** 12})
    got, record, _ = secure_round(algo, state, info, sent, results, SecAggSettings(), seed=0)
    assert list(record["secagg_refused"]) == [str(M)] and "public size" in record["secagg_refused"][str(M)]
    assert record["secagg_survivors"] == M
    honest = {c: r for c, r in results.items() if c != M}
    want = algo.fuse(state, info, honest)
    for part in ("global", "c"):
        for k, v in want[part].items():
            assert torch.allclose(got[part][k].double(), v.double(), atol=1e-5), (part, k)


def test_a_weight_forged_inside_scaffold_s_masked_input_discards_the_round(monkeypatch) -> None:
    """A malicious client skips its checks and masks weight 10⁹ with its (y_i − x, Δc_i): the decoded weight sum
    leaves the survivors' public bound and the round is discarded, never applied."""
    algo = _algo("scaffold-samples")
    state, info, sent, results = _round(algo)
    honest = algo.secure_contribution

    def forged(s: Message, r: Message):
        out = honest(s, r)
        if r is results[0]:
            out = {k: v * 1e9 / float(out[WEIGHT_KEY]) if k == WEIGHT_KEY else v for k, v in out.items()}
        return out

    monkeypatch.setattr(algo, "secure_contribution", forged)
    with pytest.raises(SecAggAbort, match="forged weight"):
        secure_round(algo, state, info, sent, results, SecAggSettings(), seed=0)


def test_the_server_sees_no_client_s_scaffold_contribution_unmasked() -> None:
    """What the server receives of client i is its masked input: uniform on the ring, equal to no client's encoded
    (y_i − x, Δc_i) in any coordinate block; only the sum decodes to something meaningful."""
    algo = _algo("scaffold")
    state, info, sent, results = _round(algo)
    _, _, transcript = secure_round(algo, state, info, sent, results, SecAggSettings(), seed=0)
    masked = transcript.masked_inputs()
    assert set(masked) == set(results)
    plain = {c: quantize(torch.cat([v.double().reshape(-1) for v in algo.secure_contribution(sent[c], r).values()]))
             for c, r in results.items()}
    for c, m in masked.items():
        assert m.shape == plain[c].shape
        assert float((m == plain[c]).double().mean()) < 0.01  # every coordinate masked
        assert abs(float(m.double().mean()) / MODULUS - 0.5) < 0.05  # and uniform-looking
        decoded = dequantize(m)
        assert float(decoded.abs().median()) > 1e3  # nothing like a model delta (|Δ| ≈ 0.05) is readable


def test_under_central_dp_scaffold_s_pair_is_clipped_as_one_vector_by_the_client() -> None:
    """dp=central + secagg: client i's contribution is clip(y_i − x, Δc_i) with the payload's clip — a Δc_i of norm
    10³ cannot buy influence on c — and the weight slot is its centred bit."""
    algo = _algo("scaffold", dp="central", dp_noise=1.0, dp_clip=0.5, sampling="poisson")
    _, _, sent, results = _round(algo)
    big = results[0]
    key = next(k for k in big.tensors if k.startswith("dc/"))
    big.tensors[key] = big.tensors[key] * 0 + 1e3
    contrib = algo.secure_contribution(sent[0], big)
    norm = math.sqrt(sum(float((v ** 2).sum()) for k, v in contrib.items() if k != WEIGHT_KEY))
    assert norm == pytest.approx(0.5) and float(contrib[WEIGHT_KEY]) == -0.5
    assert any(k.startswith("dc/") for k in contrib)  # the control variates are inside the masked, clipped vector


def test_central_dp_under_secagg_equals_central_dp_for_scaffold() -> None:
    """The research mode seeds the noise from (seed, round, stage): the same noise on the client-clipped decoded
    sum as on the server-clipped one, so SecAgg changes how the sum is made and nothing else."""
    dp = dict(dp="central", dp_noise=0.8, dp_clip=0.2, sampling="poisson", dp_reproducible=True)
    algo = _algo("scaffold", **dp)
    state, info, sent, results = _round(algo)
    secure, _, _ = secure_round(algo, state, info, sent, results, SecAggSettings(centred_count=True), seed=0)
    plain = algo.aggregate_fit(state, info, results)
    for part in ("global", "c"):
        for k, v in plain[part].items():
            assert torch.allclose(secure[part][k].double(), v.double(), atol=1e-5), (part, k)
    assert secure["dp"]["noise_std"] == plain["dp"]["noise_std"] > 0
