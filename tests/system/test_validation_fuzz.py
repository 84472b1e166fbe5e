"""Property-based fuzz of configurations: a clean error or a successful run, never a traceback."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedfuse.algorithms import ALGORITHMS
from fedfuse.cli import main
from fedfuse.config import ConfigError, RunConfig, apply, validate

NUMBERS = st.one_of(
    st.integers(-3, 3), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 0.5, 1e6, -1e-9]),
)
JUNK = st.one_of(NUMBERS, st.text(max_size=6), st.booleans(), st.none(), st.lists(NUMBERS, max_size=3),
                 st.dictionaries(st.text(max_size=4), NUMBERS, max_size=2))
KEYS = ["rounds", "clients", "clients_per_round", "lr", "momentum", "seed", "batch_size", "grad_clip", "dropout",
        "stragglers", "deadline", "quorum", "norm_bound", "on_divergence", "corrupt", "corrupt_clients", "model",
        "optimizer", "val_fraction", "device", "alpha", "mu", "widths", "int_policy", "weighting", "fusion",
        "trim", "max_attempts", "topology", "warmup_rounds", "d", "bogus"]
ALGOS = st.sampled_from([*sorted(ALGORITHMS), "nope"])


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(algorithm=ALGOS, updates=st.dictionaries(st.sampled_from(KEYS), JUNK, max_size=4))
def test_config_fuzz_gives_config_error_or_a_valid_config(algorithm, updates):
    try:
        cfg = RunConfig()
        cfg = apply(cfg, {"algorithm": algorithm})
        for k, v in updates.items():
            cfg = apply(cfg, {k: v})
        cfg = validate(cfg)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert 0 < cfg.lr <= 100 and math.isfinite(cfg.lr) and cfg.clients_per_round <= cfg.clients
    assert validate(cfg) == cfg  # validation is idempotent


FLAG_VALUES = {
    "--rounds": st.sampled_from(["1", "2", "0", "-1", "x", "1.5"]),
    "--clients": st.sampled_from(["3", "4", "0", "2000", "nan"]),
    "--lr": st.sampled_from(["0.05", "nan", "inf", "-1", "1e6", "abc"]),
    "--seed": st.sampled_from(["0", "7", str(2**70), "-3"]),
    "--model": st.sampled_from(["mlp", "auto", "transformer", "resnet9", "nope"]),
}
SETS = st.sampled_from(["dropout=0.3", "dropout=2", "stragglers=0.5", "deadline=1.5", "quorum=2", "norm_bound=-1",
                        "corrupt=nan", "corrupt_clients=[0]", "corrupt=scale", "widths=[8]", "widths=[a]",
                        "on_divergence=rollback", "mu=2", "alpha=0", "check_updates=maybe"])


@pytest.mark.filterwarnings("ignore")
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(algorithm=ALGOS, flags=st.fixed_dictionaries({}, optional=FLAG_VALUES), sets=st.lists(SETS, max_size=3))
def test_cli_fuzz_clean_error_or_successful_run(tmp_path_factory, algorithm, flags, sets):
    out = tmp_path_factory.mktemp("fuzz") / "r"
    argv = ["run", "--algorithm", algorithm, "--clients-per-round", "2", "--local-epochs", "1", "--no-progress",
            "--out", str(out), "--set", "plots=false", "--set", "dataset_options.train_limit=300",
            "--set", "eval_every=2"]
    if "--rounds" not in flags:
        argv += ["--rounds", "1"]
    if "--clients" not in flags:
        argv += ["--clients", "4"]
    if "--model" not in flags:
        argv += ["--model", "mlp", "--set", "widths=[8]"]
    for k, v in flags.items():
        argv += [k, v]
    for s in sets:
        argv += ["--set", s]
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: a flag's value of the wrong type (usage line + one error line)
            code = e.code
            assert code == 2 and "error: argument" in err.getvalue(), err.getvalue()
    text = err.getvalue()
    assert "Traceback" not in text and "internal error" not in text, (argv, text)
    assert code in (0, 1, 2), (argv, code, text)
    if code == 2:
        assert text.startswith(("fedfuse: error:", "usage:")), (argv, text)
    if code == 1:  # only a run that diverged may fail
        assert "diverged" in text, (argv, text)
