"""Cached runs (cached_runs.py): a finished run is reused, not run again."""



from fedfuse.config import make_config
from fedfuse.engine.loop import strip_timing

SMALL = dict(dataset="digits", rounds=2, clients=4, clients_per_round=2, model="mlp",
             model_options={"widths": [8]}, threads=1, plots=False)


def test_run_cached(tmp_path):
    from fedfuse.cached_runs import run_cached

    cfg = make_config(out=str(tmp_path / "r"), algorithm="fedavg", **SMALL)
    first = run_cached(cfg)
    assert not first.cached and run_cached(cfg).cached
    (tmp_path / "r" / "summary.json").unlink()  # interrupted after its last checkpoint: resumed, same records
    again = run_cached(cfg)
    assert not again.cached and [strip_timing(h) for h in again.history] == [strip_timing(h) for h in first.history]
    other = run_cached(make_config(out=str(tmp_path / "r"), algorithm="fedavg", **{**SMALL, "lr": 0.05}))
    assert not other.cached and other.config.lr == 0.05  # another config in the same directory: run afresh
