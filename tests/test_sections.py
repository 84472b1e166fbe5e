"""The run configuration's sections: every key in one section or named as the run's identity, each section
the flat keys' values, the engine built from the sections exactly as from the flat keys, the flat interface
(keys, YAML, config hash) unchanged."""

import dataclasses

import pytest

from fedfuse import sections
from fedfuse.config import RunConfig, apply, config_hash
from fedfuse.engine.faults import FaultPlan
from fedfuse.privacy.dp import DPSettings
from fedfuse.privacy.secure import SecAggSettings

#: a value other than the default for every sectioned key
CHANGED = dict(local_epochs=3, batch_size=7, lr=0.3, momentum=0.5, weight_decay=1e-3, optimizer="adam", grad_clip=2.0,
               dropout=0.2, stragglers=0.3, deadline=3.0, late_replies="next-round", quorum=2, check_updates=False,
               norm_bound=5.0, norm_max=7.0, on_divergence="rollback", corrupt="nan", corrupt_clients=[1, 4],
               dp="central", dp_noise=1.3, dp_clip=0.7, dp_quantile=0.5, dp_clip_lr=0.1, dp_count_noise=0.4,
               dp_delta=1e-6, dp_accountant="pld", dp_reproducible=True, dp_debug_metrics=True, secagg=True,
               secagg_threshold=0.6, secagg_min_clients=4, secagg_max_weight=9, secagg_neighbors=2,
               secagg_frac_bits=20, device="cpu", executor="batched", precision="bf16", memory_format="contiguous",
               fp32_matmul="bf16", threads="2")


def test_every_key_is_in_one_section_or_the_runs_identity():
    keys = [f.name for f in dataclasses.fields(RunConfig)]
    assert set(sections.SECTIONS).isdisjoint(sections.UNSECTIONED)
    assert sorted(keys) == sorted([*sections.SECTIONS, *sections.UNSECTIONED])
    assert set(CHANGED) == set(sections.SECTIONS)


def test_each_section_holds_the_flat_values():
    cfg = apply(RunConfig(), CHANGED)
    found = {}
    for part, obj in (("training", cfg.training), ("faults", cfg.faults), ("privacy.dp", cfg.privacy.dp),
                      ("privacy.secagg", cfg.privacy.secagg), ("runtime", cfg.runtime)):
        keys = {k for k, where in sections.SECTIONS.items() if where == part}
        values = dataclasses.asdict(obj)
        for key in keys:
            name = next(n for n in values if key in (n, f"dp_{n}", f"secagg_{n}") or (key, n) in
                        (("dp", "mode"), ("secagg", "enabled")))
            found[key] = values[name]
    assert found == {**CHANGED, "corrupt_clients": (1, 4)}
    assert cfg.training.max_steps == 0 and cfg.training.two_pass == ""  # the algorithm's, not the user's


def test_sections_are_values_of_the_config():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.lr = 1.0  # type: ignore[misc]
    cfg.lr = 0.2
    assert cfg.training.lr == 0.2  # built from the flat keys each time


def test_the_engine_types_built_from_the_sections_are_the_flat_ones():
    cfg = apply(RunConfig(), {**CHANGED, "corrupt": "none", "corrupt_clients": []})
    dp = DPSettings(**dataclasses.asdict(cfg.privacy.dp))
    assert dp == DPSettings(mode=cfg.dp, noise=cfg.dp_noise, clip=cfg.dp_clip, quantile=cfg.dp_quantile,
                            clip_lr=cfg.dp_clip_lr, count_noise=cfg.dp_count_noise, delta=cfg.dp_delta,
                            accountant=cfg.dp_accountant, reproducible=cfg.dp_reproducible,
                            debug_metrics=cfg.dp_debug_metrics)
    assert FaultPlan.from_settings(cfg.seed, cfg.faults) == FaultPlan(cfg.seed, 0.2, 0.3, 3.0, "none", ())
    sec, opts = SecAggSettings.from_config(cfg), cfg.privacy.secagg
    assert dataclasses.astuple(sec)[:5] == (opts.threshold, opts.neighbors, opts.frac_bits, opts.min_clients,
                                            opts.max_weight)


def test_the_flat_interface_is_unchanged():
    """Sections are properties, not keys: YAML, the key list and the config hash see only the flat fields."""
    cfg = RunConfig(lr=0.3)
    assert not {"training", "faults", "privacy", "runtime"} & set(cfg.to_dict())
    assert config_hash(cfg) == config_hash(RunConfig(**cfg.to_dict()))
    with pytest.raises(Exception, match="training"):
        apply(RunConfig(), {"training": {"lr": 0.1}})
