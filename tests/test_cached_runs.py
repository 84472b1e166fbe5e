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


def _plan(lrs):
    """One run per lr; the run of lr 0.2 diverges (every client's reply NaN, no update checks)."""
    bad = dict(check_updates=False, corrupt="nan", corrupt_clients=[0, 1, 2, 3])
    return [(f"lr{lr}", make_config(algorithm="fedavg", lr=lr, **SMALL, **(bad if lr == 0.2 else {})))
            for lr in lrs]


def test_a_diverged_run_does_not_stop_the_others_and_is_reported_when_it_stops(tmp_path, capsys):
    """A divergence is the outcome of one configuration: the plan's other runs finish and stay in the store
    (the second invocation loads them), the diverged one is named on its progress line and in the error, and
    its outcome (diverged.json) is stored too: loaded, never re-run."""
    import pytest

    from fedfuse.cached_runs import run_serial, split_stored
    from fedfuse.errors import DivergenceError

    todo = split_stored(_plan([0.05, 0.2, 0.1]), tmp_path, rerun=False)[0]
    with pytest.raises(DivergenceError, match=r"1 of 3 runs diverged .*lr0.2 seed 0: the run diverged in round 1"):
        run_serial(todo, False, [], [], verbose=False)
    err = capsys.readouterr().err
    assert "failed: lr0.2 seed 0 (run 2 of 3" in err and "done:" not in err  # only the failure is printed
    left, done = split_stored(_plan([0.05, 0.2, 0.1]), tmp_path, rerun=False)
    assert sorted(done) == [0, 1, 2] and left == []
    assert done[1].diverged["round"] == 1 and done[1].final() is None and done[1].summary == {}
    assert done[0].diverged is None and done[0].final() is not None
    assert split_stored(_plan([0.05, 0.2, 0.1]), tmp_path, rerun=True)[0][1][1] == "lr0.2"  # --fresh re-runs it


def test_parallel_runs_report_a_divergence_and_finish_the_rest(tmp_path, capsys):
    import pytest

    from fedfuse.cached_runs import run_parallel, split_stored
    from fedfuse.errors import DivergenceError

    todo = split_stored(_plan([0.2, 0.05, 0.1]), tmp_path, rerun=False)[0]
    with pytest.raises(DivergenceError, match="1 of 3 runs diverged"):
        run_parallel(todo, 2, [], [], verbose=True)
    err = capsys.readouterr().err
    assert err.count("done: ") == 2 and "failed: lr0.2 seed 0" in err
    assert sorted(split_stored(_plan([0.2, 0.05, 0.1]), tmp_path, rerun=False)[1]) == [0, 1, 2]


def test_a_sweep_raises_every_divergence_fresh_or_stored_unless_told_they_are_outcomes(tmp_path, capsys):
    """``Sweep.execute`` names each diverged run at the end, also when it was loaded from the store (the same
    error on every invocation); with ``diverged_ok`` the diverged run is a result with no final value."""
    import pytest

    from fedfuse.errors import DivergenceError
    from fedfuse.sweep import Point, Sweep

    def sweep():
        return Sweep([Point(label, cfg) for label, cfg in _plan([0.05, 0.2])], [0])

    for _ in range(2):  # fresh, then stored
        with pytest.raises(DivergenceError, match=r"1 of 2 runs diverged .*lr0.2 seed 0: the run diverged in round 1"):
            sweep().execute(store=tmp_path, verbose=True)
    assert "diverged (stored): lr0.2 seed 0: the run diverged in round 1" in capsys.readouterr().err
    got = sweep().execute(store=tmp_path, diverged_ok=True)
    bad, good = got.results["lr0.2"][0], got.results["lr0.05"][0]
    assert bad.cached and bad.diverged["round"] == 1 and bad.diverged["lr"] == 0.2 and bad.final() is None
    assert "diverged in round 1" in repr(bad) and good.final() is not None
    in_memory = Sweep([Point(label, cfg) for label, cfg in _plan([0.2])], [0]).execute(diverged_ok=True)
    assert "diverged in round 1" in in_memory.results["lr0.2"][0].diverged["why"]


def test_a_resumed_or_restarted_run_clears_an_earlier_divergence(tmp_path):
    """diverged.json is the outcome of the attempt that wrote it: a summary outranks it, and a run resumed in
    its directory removes it."""
    from fedfuse.cached_runs import run_cached
    from fedfuse.runfiles import DIVERGED

    cfg = make_config(out=str(tmp_path / "r"), algorithm="fedavg", **SMALL)
    (tmp_path / "r").mkdir()
    run_cached(cfg)
    (tmp_path / "r" / DIVERGED).write_text('{"round": 1, "why": "x", "lr": 0.1}')
    assert run_cached(cfg).diverged is None  # the summary wins: a finished run
    (tmp_path / "r" / "summary.json").unlink()
    import pytest

    from fedfuse.errors import DivergenceError

    with pytest.raises(DivergenceError, match="diverged in round 1: x"):
        run_cached(cfg)  # a stored divergence is an outcome: not resumed
    from fedfuse.runner import execute

    again = execute(cfg, resume=True)  # resumed by hand from its last checkpoint: it goes on, and finishes
    assert again.diverged is None and not (tmp_path / "r" / DIVERGED).exists()
    assert (tmp_path / "r" / "summary.json").exists()
