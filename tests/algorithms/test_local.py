"""Local: no communication at all, personalised accuracy only."""

from fedfuse.runner import experiment
from support import small_cfg


def test_local_communicates_nothing(tmp_path):
    loc = experiment(small_cfg(tmp_path, out=None, algorithm="local"))
    s = loc.run()
    assert all(h["bytes_down"] == 0 and h["bytes_up"] == 0 for h in loc.history)
    assert s["final"]["global_accuracy"] is None and s["final"]["personal_accuracy"] > 0.3
