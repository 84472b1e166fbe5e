"""Forgiving names: case-insensitive lookup and "did you mean" suggestions."""

from fedfuse.names import canonical, closest, did_you_mean, unknown


def test_canonical_ignores_case_only_when_unambiguous():
    assert canonical("FedProx", ["fedavg", "fedprox"]) == "fedprox"
    assert canonical("MNIST", ["mnist", "femnist"]) == "mnist"
    assert canonical("fedavg_ft", ["fedavg-ft"]) == "fedavg-ft"
    assert canonical("ab", ["AB", "ab"]) == "ab"  # exact spelling wins
    assert canonical("Ab", ["AB", "ab"]) is None  # two names differ only in case: no guess
    assert canonical("zzz", ["fedavg"]) is None


def test_closest_and_messages():
    assert closest("clients_per_rnd", ["clients", "clients_per_round", "rounds"])[0] == "clients_per_round"
    assert closest("fedpro", ["fedprox", "fedavg", "local"]) == ["fedprox"]
    assert did_you_mean("muu", ["mu", "lr"]) == "did you mean mu?"
    assert did_you_mean("qqqq", ["mu", "lr"]) == ""
    many = [f"name{i:02d}x" for i in range(60)]
    msg = unknown("algorithm", "zzz", many, listing="fedfuse list algorithms")
    assert msg == "unknown algorithm 'zzz' (all: fedfuse list algorithms)"  # never 60 names on one line
    assert unknown("optimizer", "lbfgs", ["sgd", "adam"]) == "unknown optimizer 'lbfgs'; choose one of: sgd, adam"
