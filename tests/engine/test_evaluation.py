"""The means an evaluation reports, by hand: unweighted and sample-weighted, clients without a test split left
out, extra per-client metrics averaged over the clients reporting them."""

import math

from fedfuse.engine.evaluation import aggregate_client_metrics


def client(acc, loss, n, val_loss=1.0, val_n=2, **extra):
    return {"test_accuracy": acc, "test_loss": loss, "test_count": n, "val_loss": val_loss, "val_accuracy": 0.5,
            "val_count": val_n, **extra}


def test_means_by_hand():
    res = {0: client(1.0, 0.5, 1, val_loss=2.0, val_n=1, test_rouge1=0.4),
           1: client(0.5, 1.0, 3, val_loss=1.0, val_n=3),
           2: client(0.0, 9.0, 0, val_loss=4.0, val_n=0, test_rouge1=math.nan)}  # no test split, no val split
    out = aggregate_client_metrics(res)
    assert math.isclose(out["personal_accuracy"], 0.75)  # (1.0 + 0.5) / 2
    assert math.isclose(out["personal_accuracy_weighted"], (1.0 * 1 + 0.5 * 3) / 4)
    assert math.isclose(out["personal_loss"], (0.5 * 1 + 1.0 * 3) / 4)
    assert math.isclose(out["val_loss"], (2.0 * 1 + 1.0 * 3) / 4)
    assert out["clients_without_test"] == 1
    assert out["client_test_accuracy"] == {"0": 1.0, "1": 0.5, "2": 0.0}
    assert math.isclose(out["personal_rouge1"], 0.4)  # the non-finite value is not averaged


def test_no_clients_no_metrics():
    assert aggregate_client_metrics({}) == {}
