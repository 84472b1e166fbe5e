"""Optional extras: a missing one is a usage error (exit 2) naming ``pip install 'fedfuse[EXTRA]'``, raised before
any long work.  The tests hide an installed extra the way Python does for a module that is absent
(``sys.modules[name] = None``: ``find_spec`` finds nothing and ``import`` raises ``ImportError``), so they run in
every environment, with or without the extras."""

from __future__ import annotations

import sys
import time

import pytest

import fedfuse.adapters.text
from fedfuse.cli import main
from fedfuse.config import check_extras, make_config, required_extras
from fedfuse.engine.callbacks import logger_names
from fedfuse.errors import UserError
from fedfuse.extras import (
    EXTRAS,
    MissingExtra,
    has_extra,
    import_extra,
    install_command,
    missing_message,
    missing_modules,
    require_extra,
)

FAST = ["--rounds", "2", "--clients", "4", "--clients-per-round", "2", "--set", "model_options.widths=[16]",
        "--model", "mlp", "--no-progress", "--set", "plots=false"]


@pytest.fixture
def hide(monkeypatch):
    """``hide("lora")`` makes every module of the lora extra unimportable for the test."""

    def _hide(*extras: str) -> None:
        for extra in extras:
            for module in EXTRAS[extra]:
                monkeypatch.setitem(sys.modules, module, None)

    return _hide


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("fedfuse: error: ") and "Traceback" not in err
    return lines[0]


# ---- the helper -----------------------------------------------------------------------------------------------
def test_install_command_names_the_extra_of_the_package():
    assert install_command("lora") == "pip install 'fedfuse[lora]'"
    assert install_command("tensorboard") == "pip install 'fedfuse[tensorboard]'"
    assert install_command("mlflow") == "pip install mlflow"  # a package no extra installs
    with pytest.raises(KeyError, match="unknown extra 'nope'"):
        install_command("nope")


def test_every_extra_is_declared_in_pyproject():
    import tomllib

    from support import ROOT

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRAS) <= set(declared)


def test_a_hidden_extra_is_missing_and_its_error_is_a_usage_error(hide):
    hide("dp")
    assert missing_modules("dp") == ["opacus"] and not has_extra("dp")
    with pytest.raises(MissingExtra) as e:
        require_extra("dp", "dp=local")
    assert str(e.value) == "dp=local needs the dp extra (opacus is not installed): pip install 'fedfuse[dp]'"
    assert isinstance(e.value, UserError) and isinstance(e.value, ImportError)


def test_message_lists_every_missing_module():
    msg = missing_message("lora", "fedit", ["peft", "transformers"])
    assert msg == "fedit needs the lora extra (peft, transformers are not installed): pip install 'fedfuse[lora]'"
    assert missing_message("mlflow", "--log mlflow", ["mlflow"]) == (
        "--log mlflow needs the package (mlflow is not installed): pip install mlflow")


def test_import_extra_turns_the_import_error_into_the_usage_error(hide):
    hide("flower")
    with pytest.raises(MissingExtra, match=r"^x needs the flower extra \(datasets is not installed\): "
                                           r"pip install 'fedfuse\[flower\]'$"):
        import_extra("datasets", "flower", "x")
    assert import_extra("json", "flower", "x").dumps([1]) == "[1]"  # an installed module is returned


def test_require_extra_imports_nothing(monkeypatch):
    """The check asks find_spec only: no module of the extra is imported by it."""
    for module in EXTRAS["lora"]:
        monkeypatch.delitem(sys.modules, module, raising=False)
    has_extra("lora")
    assert not any(m in sys.modules for m in EXTRAS["lora"])


# ---- what needs which extra ------------------------------------------------------------------------------------
def test_required_extras_of_a_config():
    assert required_extras(make_config()) == {}
    assert required_extras(make_config(algorithm="fedit", base="fedfuse:x.pt")) == {"lora": "fedit"}
    assert required_extras(make_config(dp="local")) == {"dp": "dp=local"}
    assert required_extras(make_config(executor="flower")) == {"flower": "executor 'flower'"}


def test_check_extras_names_the_first_config_that_needs_a_missing_one(hide):
    hide("lora")
    with pytest.raises(MissingExtra, match="fedmerge-lora needs the lora extra"):
        check_extras(make_config(), make_config(algorithm="fedmerge-lora", base="fedfuse:x.pt"))


def test_logger_names_check_the_extra_before_building_a_logger(hide):
    hide("tensorboard")
    assert logger_names("csv, CSV") == ["csv", "csv"]
    with pytest.raises(MissingExtra, match=r"--log tensorboard needs the tensorboard extra .*"
                                           r"pip install 'fedfuse\[tensorboard\]'"):
        logger_names(["csv", "tensorboard"])


# ---- the command line: exit 2, one line, before any work -------------------------------------------------------
def test_run_with_a_missing_logger_exits_2_before_loading_data(hide, monkeypatch, tmp_path, capsys):
    hide("tensorboard")
    import fedfuse.engine.assemble

    def no_data(*a, **k):
        raise AssertionError("the data was loaded before the missing extra was reported")

    monkeypatch.setattr(fedfuse.engine.assemble, "build_federation", no_data)
    out = tmp_path / "r"
    assert main(["run", *FAST, "--log", "tensorboard,csv", "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.endswith("--log tensorboard needs the tensorboard extra (tensorboard is not installed): "
                         "pip install 'fedfuse[tensorboard]'")
    assert not out.exists()


@pytest.mark.parametrize(("argv", "extra", "what"), [
    (["run", "--algorithm", "fedit", "--set", "base=fedfuse:x.pt"], "lora", "fedit"),
    (["run", "--set", "dp=local"], "dp", "dp=local"),
    (["compare", "--algorithms", "fedavg,local-lora", "--set", "base=fedfuse:x.pt"], "lora", "local-lora"),
])
def test_commands_needing_a_missing_extra_exit_2_and_write_nothing(argv, extra, what, hide, tmp_path, capsys):
    hide(extra)
    out = tmp_path / "o"
    assert main([*argv, *FAST, "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"fedfuse: error: {what} needs the {extra} extra")
    assert line.endswith(f": pip install 'fedfuse[{extra}]'")
    assert not out.exists()  # compare: not even fedavg ran first


def test_reproduce_fedmerge_lora_without_lora_exits_2_within_seconds_without_pretraining(hide, monkeypatch,
                                                                                         tmp_path, capsys):
    hide("lora")

    def no_pretraining(*a, **k):
        raise AssertionError("pretrained a base before reporting the missing extra")

    monkeypatch.setattr(fedfuse.adapters.text, "pretrain", no_pretraining)
    monkeypatch.setenv("FEDFUSE_CACHE", str(tmp_path / "cache"))  # no cached base: it would pretrain one
    t0 = time.perf_counter()
    rc = main(["reproduce", "fedmerge-lora", "--quick", "--data-dir", str(tmp_path / "data"),
               "--out", str(tmp_path / "rep")])
    assert rc == 2 and time.perf_counter() - t0 < 30
    line = _one_error_line(capsys.readouterr().err)
    assert "reproduce fedmerge-lora needs the lora extra" in line and line.endswith("pip install 'fedfuse[lora]'")
    assert not (tmp_path / "rep").exists()


def test_verifying_a_lora_record_checks_the_extra_before_pretraining(hide, monkeypatch):
    from fedfuse.reproduce import fedmerge_lora

    hide("lora")
    monkeypatch.setattr(fedfuse.adapters.text, "pretrain", lambda *a, **k: pytest.fail("pretrained"))
    cfg = make_config(algorithm="fedmerge-lora", base="fedfuse:/nonexistent/base.pt")
    with pytest.raises(MissingExtra, match="fedmerge-lora needs the lora extra"):
        fedmerge_lora.rebuild({"task": "roles"}, cfg)
