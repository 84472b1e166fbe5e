"""Reply checks (engine/validate.py): the reasons a reply is refused, and the round majority as the reference when
nothing comparable was sent."""

from __future__ import annotations

import math

import numpy as np
import torch

from fedfuse.algorithms.base import Algorithm
from fedfuse.engine.validate import check_replies, check_values
from fedfuse.types import FitStats, Message


def _msg(**tensors) -> Message:
    return Message({k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()},
                   stats=FitStats(num_examples=10, train_loss=0.5))


PLAIN = Algorithm(None)  # declares nothing about its replies: the round's replies vote


def test_check_replies_reasons():
    sent = {c: _msg(w=[[0.0, 0.0], [0.0, 0.0]], b=[0.0, 0.0]) for c in range(8)}
    good = {c: _msg(w=[[0.1 * c, 0.1], [0.1, 0.1]], b=[0.1, 0.2]) for c in range(8)}
    assert check_replies(PLAIN, sent, good, [10] * 8, norm_bound=10) == {}
    bad = dict(good)
    bad[0] = _msg(w=[[math.nan, 0], [0, 0]], b=[0, 0])
    bad[1] = _msg(w=[[0.1, 0.1]], b=[0.1, 0.1])  # broadcasts against (2, 2)
    bad[2] = Message(good[2].tensors, stats=FitStats(num_examples=10**12))
    bad[3] = _msg(w=[[1e4, 0], [0, 0]], b=[0, 0])
    bad[4] = Message({**good[4].tensors, "extra": torch.zeros(1)}, stats=FitStats(num_examples=10))
    why = check_replies(PLAIN, sent, bad, [10] * 8, norm_bound=10)
    assert "NaN" in why[0] and "shape (1, 2)" in why[1] and "holds 10" in why[2]
    assert "norm" in why[3] and "unexpected key extra" in why[4]
    assert set(why) == {0, 1, 2, 3, 4}
    assert check_replies(PLAIN, sent, bad, [10] * 8, norm_bound=0).keys() == {0, 1, 2, 4}


def test_check_replies_uses_round_majority_when_nothing_comparable_was_sent():
    sent = {c: Message() for c in range(4)}
    replies = {c: _msg(h=np.ones((3, 2)) * c) for c in range(4)}
    replies[2] = _msg(h=np.ones((1, 2)))
    why = check_replies(PLAIN, sent, replies, None, norm_bound=0)
    assert list(why) == [2] and "other replies (3, 2)" in why[2]
    # negative or fractional example counts and a non-finite loss are rejected too
    replies = {0: Message({}, stats=FitStats(num_examples=-1)), 1: Message({}, stats=FitStats(num_examples=2.5)),
               2: Message({}, stats=FitStats(train_loss=float("inf")))}
    why = check_replies(PLAIN, {c: Message() for c in range(3)}, replies, [5, 5, 5])
    assert "negative" in why[0] and "not an integer" in why[1] and "loss" in why[2]


def test_check_values_screens_by_norm_and_searches_only_a_failing_group():
    """The norm screen passes finite replies, also where a norm overflows (values near the float32 range: the
    element-wise search then clears them); a NaN or Inf is named with its key in any dtype group."""
    huge = {"w": torch.full((4, 4), 1e30), "b": torch.ones(4)}  # ||w|| overflows float32, every value finite
    assert not math.isfinite(torch.linalg.vector_norm(huge["w"]).item())
    assert check_values(Message(huge)) is None
    many = {f"peer/{i}": torch.randn(3, generator=torch.Generator().manual_seed(i)) for i in range(200)}
    assert check_values(Message(many)) is None
    for bad, what in ((math.nan, "NaN"), (math.inf, "Inf"), (-math.inf, "Inf")):
        t = dict(many, **{"half": torch.ones(5, dtype=torch.bfloat16)})
        t["peer/137"] = t["peer/137"].clone()
        t["peer/137"][1] = bad
        assert check_values(Message(t)) == f"non-finite values ({what}) in peer/137"
        t["peer/137"][1] = 0.0
        t["half"] = t["half"].clone()
        t["half"][4] = bad
        assert check_values(Message(t)) == f"non-finite values ({what}) in half"
    assert check_values(Message({"steps": torch.tensor([2**62])})) is None  # integers are not screened


def test_absolute_norm_bound_applies_when_no_median_is_a_reference():
    """With 2 replies a ×1000 update is half the round's "median": the relative bound cannot see it, the absolute
    ``norm_max`` can.  With ≥ 3 replies the relative bound applies and ``norm_max`` does not (hand-made norms)."""
    sent = {c: _msg(w=[0.0, 0.0]) for c in range(4)}
    honest = _msg(w=[3.0, 4.0])  # update norm 5
    pair = {0: honest, 1: _msg(w=[3000.0, 4000.0])}  # ×1000: norm 5000
    assert check_replies(PLAIN, sent, pair, [10] * 4, norm_bound=100) == {}  # the relative bound is blind here
    why = check_replies(PLAIN, sent, pair, [10] * 4, norm_bound=100, norm_max=1000)
    assert set(why) == {1} and "5e+03 exceeds the absolute bound norm_max=1000" in why[1]
    assert check_replies(PLAIN, sent, {0: pair[1]}, [10] * 4, norm_max=1000).keys() == {0}  # one reply
    assert check_replies(PLAIN, sent, {0: honest}, [10] * 4, norm_max=5.0) == {}  # the bound itself passes
    # three replies: a median exists, norm_max is not used (every norm is 5000 > 1000, none is an outlier)
    big = {c: _msg(w=[3000.0, 4000.0]) for c in range(3)}
    assert check_replies(PLAIN, sent, big, [10] * 4, norm_bound=100, norm_max=1000) == {}
    # ... and the relative bound does not catch a ×50 update (below 100 × the median): robust fusion's case
    x50 = {0: honest, 1: honest, 2: _msg(w=[150.0, 200.0])}
    assert check_replies(PLAIN, sent, x50, [10] * 4, norm_bound=100, norm_max=1000) == {}
    assert check_replies(PLAIN, sent, x50, [10] * 4, norm_bound=10).keys() == {2}


def test_a_scaled_update_in_a_two_reply_round_is_quarantined_by_the_absolute_bound():
    """A run with 2 clients a round and client 0 sending ×1000 its update: the default ``norm_max`` quarantines
    it in every round it is sampled, and the final model equals the run in which its reply is lost; with
    ``norm_max=0`` (the relative bound alone, blind with 2 replies) it is fused."""
    from fedfuse.config import RunConfig, apply, validate
    from fedfuse.runner import experiment

    def run(**kw):
        cfg = validate(apply(RunConfig(), dict(dataset="digits", model="mlp", model_options={"widths": [16]},
                                               clients=4, clients_per_round=2, rounds=3, local_epochs=1,
                                               plots=False, eval_every=3, threads=1, corrupt_clients=[0], **kw)))
        exp = experiment(cfg)
        exp.run()
        return exp.algo.global_model(exp.state)[0], exp.history

    scaled, hist = run(corrupt="scale")
    lost, _ = run(corrupt="drop")
    assert all(torch.equal(scaled[k], lost[k]) for k in lost)
    reasons = [why for h in hist for why in h["quarantined"].values()]
    assert reasons and all("absolute bound norm_max=100" in why for why in reasons)
    unchecked, _ = run(corrupt="scale", norm_max=0)
    assert max(float((unchecked[k] - lost[k]).abs().max()) for k in lost) > 1.0
