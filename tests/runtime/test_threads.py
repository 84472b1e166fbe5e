"""Threads that do not fight (auto thread count, passive OpenMP wait policy) and the training precision."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from fedfuse.config import ConfigError, RunConfig, apply, parse_threads, validate
from fedfuse.engine.client import TrainConfig, train_local
from fedfuse.runtime.precision import (
    current_precision,
    native_bf16,
    resolve_precision,
    train_autocast,
    use_precision,
)
from fedfuse.runtime.threads import auto_threads, idle_cores, resolve_threads, worker_threads
from fedfuse.types import Split


def test_auto_threads_follows_the_load_average():
    # 2 logical CPUs on 2 physical cores: idle -> 2, half a core busy or more -> 1, never 0
    assert auto_threads(load=0.0, cpus=2, cores=2) == 2
    assert auto_threads(load=0.4, cpus=2, cores=2) == 2
    assert auto_threads(load=0.6, cpus=2, cores=2) == 1
    assert auto_threads(load=12.0, cpus=2, cores=2) == 1
    # hyper-threads do not count: 8 logical CPUs on 4 cores, idle -> 4; 8 CPUs, load 5.2 -> 3 idle
    assert auto_threads(load=0.0, cpus=8, cores=4) == 4
    assert idle_cores(load=5.2, cpus=8) == 3
    assert auto_threads(load=5.2, cpus=8, cores=4) == 3


def test_threads_setting_parses_auto_and_counts():
    assert parse_threads("auto") == parse_threads(" AUTO ") == "auto"
    assert parse_threads(3) == parse_threads("3") == 3
    assert parse_threads(0) == 0
    for bad in ("-1", "two", True, 1.5):
        with pytest.raises(ValueError):
            parse_threads(bad)
    assert resolve_threads(2) == 2 and resolve_threads(0) == 0 and resolve_threads("auto") >= 1
    assert worker_threads("auto") == worker_threads(0) == 1 and worker_threads(3) == 3


def test_fedfuse_threads_fixes_what_auto_resolves_to(monkeypatch):
    import fedfuse.runtime.threads as threads

    monkeypatch.setattr(threads, "auto_threads", lambda: 7)  # the load rule, made independent of the load
    monkeypatch.setenv("FEDFUSE_THREADS", "3")
    assert resolve_threads("auto") == 3
    assert resolve_threads(2) == 2  # an explicit count wins over the variable
    monkeypatch.setenv("FEDFUSE_THREADS", "auto")
    assert resolve_threads("auto") == 7
    monkeypatch.setenv("FEDFUSE_THREADS", "")
    assert resolve_threads("auto") == 7
    monkeypatch.setenv("FEDFUSE_THREADS", "many")
    with pytest.raises(ConfigError, match="FEDFUSE_THREADS='many'"):
        resolve_threads("auto")


def test_config_threads_default_auto_and_validation():
    assert RunConfig().threads == "auto"
    assert validate(apply(RunConfig(), {"threads": 2})).threads == "2"
    assert validate(apply(RunConfig(), {"threads": "auto"})).threads == "auto"
    with pytest.raises(ConfigError, match="threads"):
        validate(apply(RunConfig(), {"threads": "many"}))
    with pytest.raises(ConfigError, match="precision"):
        validate(apply(RunConfig(), {"precision": "fp16"}))


def test_importing_fedfuse_sets_a_passive_wait_policy_unless_set():
    code = "import os, fedfuse; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ACTIVE"


def test_precision_resolution():
    assert resolve_precision("fp32", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"
    assert resolve_precision("auto", "cpu") == ("bf16" if native_bf16("cpu") else "fp32")
    assert resolve_precision("auto", "meta") == "fp32"  # no native bf16 known: fp32
    with pytest.raises(ValueError):
        resolve_precision("fp16", "cpu")
    assert current_precision() == "fp32"
    with use_precision("bf16"):
        assert current_precision() == "bf16"
    assert current_precision() == "fp32"


def _model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = Split(torch.randn(40, 12, generator=g), torch.randint(0, 3, (40,), generator=g))
    return model, data


def test_bf16_autocasts_the_products_and_keeps_fp32_master_weights():
    model, data = _model_and_data()
    dtypes: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with use_precision("bf16"):
        train_local(model, data, TrainConfig(batch_size=10, lr=0.1), torch.Generator().manual_seed(0))
    assert set(dtypes) == {torch.bfloat16}  # the product ran in bf16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    bf16_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(start)
    dtypes.clear()
    train_local(model, data, TrainConfig(batch_size=10, lr=0.1), torch.Generator().manual_seed(0))
    assert set(dtypes) == {torch.float32}
    # the same steps: close to fp32 (bf16 keeps ~3 significant digits), but not equal
    for k, v in model.state_dict().items():
        assert torch.allclose(v, bf16_state[k], atol=2e-2), k
    assert any(not torch.equal(v, bf16_state[k]) for k, v in model.state_dict().items())


def test_fp32_context_is_a_no_op():
    model, data = _model_and_data()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    train_local(model, data, TrainConfig(batch_size=10, lr=0.1), torch.Generator().manual_seed(0))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(start)
    with use_precision("fp32"):
        with train_autocast("cpu"):
            assert not torch.is_autocast_enabled("cpu")
        train_local(model, data, TrainConfig(batch_size=10, lr=0.1), torch.Generator().manual_seed(0))
    assert all(torch.equal(v, plain[k]) for k, v in model.state_dict().items())


def test_channels_last_trains_the_same_model_and_hands_back_contiguous_weights():
    from fedfuse.models import build_model
    from fedfuse.runtime.precision import training_memory_format

    torch.manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 10)
    g = torch.Generator().manual_seed(1)
    data = Split(torch.randn(24, 1, 28, 28, generator=g), torch.randint(0, 10, (24,), generator=g))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    seen: list[bool] = []
    model.conv1.register_forward_hook(lambda m, i, o: seen.append(o.is_contiguous(memory_format=torch.channels_last)))
    trained = {}
    for fmt in ("contiguous", "channels_last", "auto"):
        model.load_state_dict(start)
        seen.clear()
        with use_precision("fp32", fmt):
            assert training_memory_format(model, data.x) == (None if fmt == "contiguous" else torch.channels_last)
            train_local(model, data, TrainConfig(batch_size=8, lr=0.05), torch.Generator().manual_seed(0))
        assert seen and all(seen) == (fmt != "contiguous")
        assert all(v.is_contiguous() for v in model.state_dict().values())  # default strides after training
        trained[fmt] = {k: v.clone() for k, v in model.state_dict().items()}
    for k, v in trained["contiguous"].items():  # same model up to the summation order of the kernels
        assert torch.allclose(v, trained["channels_last"][k], atol=1e-5), k
    # auto: MLPs and 2-D inputs are left alone
    with use_precision("fp32", "auto"):
        mlp, xs = _model_and_data()
        assert training_memory_format(mlp, xs.x) is None


def test_fp32_matmul_switch_is_scoped_to_the_run():
    before = torch.backends.mkldnn.matmul.fp32_precision
    a, b = torch.randn(64, 96), torch.randn(96, 32)
    exact = a.double() @ b.double()
    with use_precision("fp32", "auto", "bf16"):
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
        fast = a @ b
        assert fast.dtype == torch.float32
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    assert torch.allclose(fast.double(), exact, rtol=1e-3, atol=1e-3)  # fp32 output, bf16-based internal arithmetic
    with pytest.raises(ValueError), use_precision("fp32", "auto", "tf64"):
        pass
