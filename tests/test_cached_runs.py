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


def test_progress_says_k_of_n_runs_and_the_time_left():
    from fedfuse.cached_runs import Progress

    now = iter([100.0, 130.0, 160.0, 250.0, 4000.0])
    p = Progress(4, clock=lambda: next(now))
    assert p.line("fedavg", 0) == "  done: fedavg seed 0 (run 1 of 4; 30 s elapsed, about 1 min 30 s left)"
    assert p.line("fedprox", 0) == "  done: fedprox seed 0 (run 2 of 4; 1 min 0 s elapsed, about 1 min 0 s left)"
    assert p.line("fedavg", 1) == "  done: fedavg seed 1 (run 3 of 4; 2 min 30 s elapsed, about 50 s left)"
    assert p.line("fedprox", 1) == "  done: fedprox seed 1 (run 4 of 4; 1 h 5 min elapsed)"
