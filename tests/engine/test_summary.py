"""summary.json and the records: hand-computed blocks, the best-validation-loss rule, NaN clean-up, and the
privacy account's entries taking the place of the totals."""

import math

from fedfuse.config import RunConfig
from fedfuse.engine.round import Totals
from fedfuse.engine.summary import TIMING_KEYS, clean, final_block, improves_val_loss, run_summary, strip_timing


def rec(r, acc, val_loss=None, **kw):
    base = {"round": r, "personal_accuracy": acc, "global_accuracy": acc, "bytes_down": 10, "total_bytes_down": 10 * r,
            "total_bytes_up": 5 * r, "total_bytes_peer": 0, "total_client_flops": 2.0 * r, "seconds": 0.1,
            "clients": [0, 1]}
    if val_loss is not None:
        base["val_loss"] = val_loss
    return {**base, **kw}


def test_improves_val_loss():
    assert not improves_val_loss(None, {"round": 1})  # no validation loss: never the best
    assert not improves_val_loss(None, {"val_loss": math.nan})
    assert not improves_val_loss(None, {"val_loss": None})
    assert improves_val_loss(None, {"val_loss": 3.0})
    assert improves_val_loss({"val_loss": 3.0}, {"val_loss": 2.5})
    assert not improves_val_loss({"val_loss": 3.0}, {"val_loss": 3.0})  # a tie keeps the earlier round


def test_final_block_is_the_mean_of_the_later_evaluations():
    hist = [rec(1, 0.2), rec(2, 0.4), rec(3, 0.6), rec(4, 0.8)]  # 4 evaluations: the later half, rounds 3 and 4
    block = final_block(hist, hist[-1])
    assert math.isclose(block["personal_accuracy"], 0.7) and math.isclose(block["global_accuracy"], 0.7)
    assert block["window"] == 2
    assert block["round"] == 4  # not an evaluation metric: as at the last round
    assert block["bytes_down"] == 40 and block["bytes_up"] == 20 and block["client_flops"] == 8.0  # the totals
    assert "seconds" not in block and "clients" not in block  # per-round values and lists are not in a block


def test_run_summary_blocks_and_the_privacy_entries():
    cfg = RunConfig(algorithm="fedavg", dataset="digits", rounds=3)
    hist = [rec(1, 0.2, 2.0), rec(2, 0.9, 1.5), rec(3, 0.5, 1.8)]
    totals = Totals(bytes_down=30, wall_seconds=4.0)
    s = run_summary(cfg, "classification", 6, hist, hist[1], totals, precision="fp32", threads=1)
    assert s["rounds_completed"] == 3 and s["clients"] == 6 and s["task"] == "classification"
    assert s["last"]["round"] == 3 and s["best"]["round"] == 2 and s["best"]["metric"] == "global_accuracy"
    assert s["best_val_loss"]["round"] == 2
    assert s["totals"]["bytes_down"] == 30 and s["wall_seconds"] == 4.0 and s["precision"] == "fp32"
    private = run_summary(cfg, "classification", 6, hist, None, totals, dp_guarantee=True,
                          totals={"wall_seconds": 4.0})
    assert private["totals"] == {"wall_seconds": 4.0} and private["dp_guarantee"] is True
    assert list(private).index("totals") == list(s).index("totals")  # same place in summary.json
    assert private["best_val_loss"]["round"] == 3  # no best record: the last evaluated round


def test_an_empty_history_has_empty_blocks():
    s = run_summary(RunConfig(), "classification", 2, [], None, Totals())
    assert s["rounds_completed"] == 0 and s["last"]["bytes_down"] is None


def test_clean_and_strip_timing():
    assert clean({"a": math.inf, "b": [1.0, -math.inf, {"c": math.nan}], "d": "x"}) == \
        {"a": None, "b": [1.0, None, {"c": None}], "d": "x"}
    assert strip_timing({"round": 1, **dict.fromkeys(TIMING_KEYS, 0.5)}) == {"round": 1}
