"""Statistics over seeds: hand-computed cases."""

import math

import pytest

from fedfuse.stats import (
    best_value,
    cost_to_target,
    final_mean,
    mean_std,
    paired_test,
    parse_seeds,
    rounds_to_target,
)

HIST = [
    {"round": 1, "global_accuracy": 0.2, "total_bytes": 10.0},
    {"round": 2, "global_accuracy": None, "total_bytes": 20.0},
    {"round": 3, "global_accuracy": 0.6, "total_bytes": 30.0},
    {"round": 4, "global_accuracy": 0.5, "total_bytes": 40.0},
]


def test_mean_std_hand_case():
    ms = mean_std([1.0, 2.0, 3.0, None, float("nan")])
    assert ms.n == 3 and ms.mean == pytest.approx(2.0) and ms.std == pytest.approx(1.0)
    assert ms.fmt() == "2.00 ± 1.00"
    assert mean_std([0.5]).fmt(scale=100) == "50.00"
    assert mean_std([]).n == 0 and mean_std([]).fmt() == "—"


def test_history_reductions():
    assert final_mean(HIST, last=2) == pytest.approx(0.55)  # 3 evaluations: window min(2, ceil(3/2)) = 2
    assert final_mean(HIST, last=10) == pytest.approx((0.6 + 0.5) / 2)  # the later half of 3, rounded up
    assert final_mean(HIST, last=1) == pytest.approx(0.5)
    assert best_value(HIST) == pytest.approx(0.6)
    assert rounds_to_target(HIST, 0.55) == 3
    assert rounds_to_target(HIST, 0.9) is None
    assert cost_to_target(HIST, 0.55) == 30.0
    assert final_mean([], last=3) is None


def test_paired_test():
    t = paired_test([0.8, 0.82, 0.81], [0.7, 0.71, 0.72])
    assert t.n == 3 and t.diff == pytest.approx(0.1) and t.significant()
    same = paired_test([0.5, 0.6], [0.5, 0.6])
    assert math.isnan(same.p_value) and not same.significant() and same.mark() == "(no test)"
    two = paired_test([0.5, 0.6], [0.5006, 0.6005])  # n = 2: one degree of freedom, p ~ 1e-2 — no claim
    assert math.isnan(two.p_value) and two.mark() == "(no test)"
    flat = paired_test([0.6, 0.7, 0.8], [0.5, 0.6, 0.7])  # the same difference on every seed: degenerate t
    assert flat.n == 3 and flat.diff == pytest.approx(0.1) and not flat.tested and flat.mark() == "(no test)"
    assert paired_test([0.8, 0.82, 0.81], [0.7, 0.71, 0.72]).mark() == "*"
    assert not paired_test([0.9], [0.1]).significant()  # one pair: no claim
    noisy = paired_test([0.5, 0.9, 0.4], [0.6, 0.5, 0.55])
    assert not noisy.significant() and noisy.mark() == "(n.s.)"


def test_final_window_is_the_last_5_and_never_more_than_the_later_half():
    from fedfuse.stats import final_window

    assert [final_window(n) for n in range(12)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 5]
    assert final_window(100) == 5 and final_window(100, last=10) == 10 and final_window(7, last=1) == 1
    assert final_window(3, last=0) == 1  # at least the last evaluation


def test_final_of_a_five_round_run_leaves_its_first_rounds_out():
    """The case of issue #43: a 5-round run's final averaged round 1's 0.2 in (51.7 % vs a best of 69.7 %)."""
    hist = [{"round": r, "global_accuracy": a} for r, a in enumerate([0.2, 0.5, 0.6, 0.7, 0.65], start=1)]
    assert final_mean(hist) == pytest.approx((0.6 + 0.7 + 0.65) / 3)


def test_final_note_says_what_final_is():
    from fedfuse.stats import final_note, final_rule

    assert final_rule() == ("final = the mean of the last 5 evaluations, or of the later half (rounded up) of a "
                            "run's evaluations when it has fewer than 10")
    assert final_note(5, [20, 20]) == "final = the mean of the last 5 evaluations"
    assert final_note(5, [9]) == "final = the mean of the last 5 evaluations"  # ceil(9 / 2) = 5
    assert final_note(1, [3]) == "final = the last evaluation"
    assert final_note(5, [5, 5]) == ("final = the mean of the last 5 evaluations; these runs evaluated 5 times, "
                                     "so final = the mean of their later half, the last 3")
    assert final_note(5, [2], "this run").endswith("this run evaluated 2 times, so final = its last evaluation")
    assert final_note(5, [1], "this run").endswith("this run evaluated 1 time, so final = its only evaluation")
    assert final_note(5, [2, 4, 9]).endswith("(the last 1 of 2, the last 2 of 4 evaluations here)")


def test_best_round_and_primary_metric():
    from fedfuse.stats import best_round, is_evaluation_metric, primary_metric

    assert best_round(HIST)["round"] == 3 and best_round(HIST, "nope") is None
    losses = [{"round": 1, "val_loss": 0.5}, {"round": 2, "val_loss": 0.3}, {"round": 3, "val_loss": 0.3}]
    assert best_round(losses, "val_loss")["round"] == 2  # lowest, the earliest on a tie
    assert primary_metric(HIST) == "global_accuracy"
    assert primary_metric([{"personal_accuracy": 0.4, "global_accuracy": None}]) == "personal_accuracy"
    assert all(map(is_evaluation_metric, ["loss", "val_loss", "global_accuracy", "personal_rouge1"]))
    assert not any(map(is_evaluation_metric, ["train_loss", "total_bytes_up", "dp_epsilon", "server_parameters"]))


def test_parse_seeds():
    assert parse_seeds("3") == [0, 1, 2]
    assert parse_seeds(2) == [0, 1]
    assert parse_seeds("0,4,7") == [0, 4, 7]
    with pytest.raises(ValueError, match="seeds"):
        parse_seeds("x")
    with pytest.raises(ValueError, match="seeds"):
        parse_seeds(0)


def test_single_seed_and_count_zero_message():
    assert parse_seeds("5,") == [5]
    with pytest.raises(ValueError, match="write '0,'"):
        parse_seeds("0")


# ---- ranks, Friedman's test, Pareto fronts (the benchmark matrix) ---------------------------------------------
def test_ranks_give_ties_their_average_rank_and_follow_the_direction():
    from fedfuse.stats import mean_ranks, ranks

    assert ranks([[0.9, 0.8, 0.8], [0.1, 0.3, 0.2]]) == [[1.0, 2.5, 2.5], [3.0, 1.0, 2.0]]
    assert ranks([[3.0, 1.0, 2.0]], higher_is_better=False) == [[3.0, 1.0, 2.0]]
    assert mean_ranks([[0.9, 0.8, 0.8], [0.1, 0.3, 0.2]]) == [2.0, 1.75, 2.25]


def test_friedman_matches_the_hand_computed_statistic():
    """A always first, B second, C third over n = 4 problems: rank sums 4, 8, 12, so
    χ² = 12 / (n k (k+1)) Σ R² − 3 n (k+1) = 12/48 · 224 − 48 = 8 and p = exp(−8/2) (χ² with 2 dof)."""
    from fedfuse.stats import friedman

    m = [[0.9, 0.8, 0.7], [0.6, 0.5, 0.1], [0.95, 0.9, 0.2], [0.5, 0.4, 0.3]]
    fr = friedman(m)
    assert (fr.n, fr.k) == (4, 3)
    assert fr.statistic == pytest.approx(8.0)
    assert fr.p_value == pytest.approx(math.exp(-4.0))
    assert math.isnan(friedman([[0.1, 0.2, 0.3]]).p_value)  # one problem: undefined
    assert math.isnan(friedman([[0.1, 0.2], [0.3, 0.4]]).p_value)  # two methods: use a paired test


def test_pareto_front_keeps_exactly_the_undominated_points():
    from fedfuse.stats import pareto_front

    pts = [(1.0, 0.5), (2.0, 0.7), (2.0, 0.6), (3.0, 0.7), (0.5, 0.4)]
    # (2, 0.6) is dominated by (2, 0.7) (same cost, better); (3, 0.7) by (2, 0.7) (cheaper, as good)
    assert pareto_front(pts) == [4, 0, 1]
    assert pareto_front([(1.0, 0.5), (1.0, 0.5)]) == [0, 1]  # equal points dominate neither
