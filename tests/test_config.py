"""Configuration (config.py): make_config from its sources and its errors; the config hash ignores outputs only."""

import dataclasses

import pytest

import fedfuse
from fedfuse.config import ConfigError, config_hash, make_config


def test_make_config_sources_and_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("algorithm: fedprox\nrounds: 7\nalgorithm_options: {mu: 0.5}\n")
    cfg = make_config(f, mu=0.25, lr=0.05)
    assert (cfg.algorithm, cfg.rounds, cfg.lr, cfg.algorithm_options["mu"]) == ("fedprox", 7, 0.05, 0.25)
    assert cfg.model == "mlp"  # resolved from the dataset
    assert make_config(cfg) == cfg
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        make_config(bogus=1)
    with pytest.raises(ConfigError, match="unknown option 'mu' for algorithm 'fedavg'"):
        make_config(algorithm_options={"mu": 1})
    with pytest.raises(ConfigError, match=r"fedfuse\.compare"):
        fedfuse.run(seeds=3)
    with pytest.raises(ConfigError, match="nothing to resume"):
        fedfuse.run(resume=True, out=str(tmp_path / "none"))


def test_config_hash_ignores_outputs_but_not_anything_that_changes_metrics():
    cfg = make_config(algorithm="fedprox")
    same = dataclasses.replace(cfg, out="/elsewhere", plots=False, threads=4, data_dir="/d", checkpoint_every=5)
    assert config_hash(same) == config_hash(cfg)
    for change in ({"seed": 1}, {"lr": 0.01}, {"algorithm_options": {**cfg.algorithm_options, "mu": 0.5}}):
        assert config_hash(dataclasses.replace(cfg, **change)) != config_hash(cfg)
