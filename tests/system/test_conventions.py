"""The research conventions and the documented install agree with the code: LICENSE, CITATION.cff, CHANGELOG.md
and ``fedfuse --version`` with ``pyproject.toml``; ``.ci/run`` with the README's install and test commands."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
import yaml

import fedfuse
from support import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def _fenced_line(text: str, start: str) -> str:
    """The first line of a ```bash block in ``text`` that starts with ``start``."""
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if line.startswith(start):
                return line.strip()
    raise AssertionError(f"no bash line starting with {start!r}")


def test_license_is_the_full_apache_2_text_and_matches_pyproject():
    assert PYPROJECT["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    sections = re.findall(r"^\s+(\d)\. (\w[\w ]*)\.", text, re.M)
    assert [int(n) for n, _ in sections] == list(range(1, 10))  # every section, Definitions to Accepting Warranty
    assert "END OF TERMS AND CONDITIONS" in text and "http://www.apache.org/licenses/LICENSE-2.0" in text


def test_citation_cff_is_cff_1_2_0_and_cites_this_version():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0"
    assert {"cff-version", "message", "title", "authors"} <= set(cff)  # the required keys
    assert all(a.get("name") or a.get("family-names") for a in cff["authors"])
    assert str(cff["version"]) == PYPROJECT["version"]
    assert cff["license"] == PYPROJECT["license"]["text"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(cff["date-released"]))


def test_changelog_has_a_section_for_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert versions[0] == "Unreleased" and PYPROJECT["version"] in versions


def test_version_comes_from_the_package_metadata(capsys):
    from importlib.metadata import version

    from fedfuse.cli import main

    assert fedfuse.__version__ == version("fedfuse") == fedfuse.package_version()
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"fedfuse {fedfuse.__version__}"


# ---- the README's install and test commands, and CI ------------------------------------------------------------
README_INSTALL = 'pip install torch==2.13.0 && pip install -e ".[test]"'
README_TEST = "python3 -m pytest -q -x --timeout 600"


def test_readme_states_the_install_and_test_commands_ci_uses():
    assert _fenced_line(README, "pip install torch==2.13.0").startswith(README_INSTALL)
    assert _fenced_line(README, "python3 -m pytest") == README_TEST


def test_ci_ends_with_the_readme_test_command_in_the_full_environment():
    lines = [line.strip() for line in CI.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert lines[-1] == README_TEST
    full = [i for i, line in enumerate(lines) if "pip install" in line and ".[test," in line]
    assert full and all("torch==2.13.0" in lines[i - 1] for i in full)  # torch's CPU wheel first


def test_ci_runs_the_extra_tests_with_exactly_the_readme_install():
    """A fresh venv (no system site packages) gets the README's two pip commands and nothing else, then the README's
    test command over the files ``.ci/extra_tests.py`` derives."""
    step = CI.split("# -- quick-start environment", 1)[1].split("# -- end", 1)[0]
    assert "python3 -m venv" in step and "--system-site-packages" not in step
    installs = re.findall(r"pip install[^\n]*", step)
    assert [re.sub(r"\s+(--quiet|-q)\b", "", i) for i in installs] == ['pip install "torch==2.13.0"',
                                                                      'pip install -e ".[test]"']
    assert f"{README_TEST} -m extra $(python3 .ci/extra_tests.py)" in step


def test_extra_tests_select_the_parameters_that_need_an_extra():
    """``-m extra`` keeps a test parametrized over algorithms for the LoRA ones only; a plain test that names a
    feature needing an extra is kept, one that does not is left out."""
    from extra_use import id_pattern, touches

    assert id_pattern().search("fedit-rank") and id_pattern().search("fedmerge-lora")
    assert not id_pattern().search("fedmerge-d") and not id_pattern().search("fedavg")
    assert touches('main(["run", "--log", "tensorboard"])') and touches("cfg = make_config(dp='local')")
    assert touches("import flwr") and touches("from fedfuse.flower.app import client_app")
    assert not touches('main(["run", "--log", "csv"])') and not touches("make_config(dp='central')")


def test_extra_tests_list_holds_the_files_that_touch_an_extra_and_only_those():
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "extra_tests.py")], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()
    for name in ("tests/test_records.py",  # a LoRA reproduction's record, through `reproduce fedmerge-lora`
                 "tests/adapters/test_lora.py", "tests/test_extras.py", "tests/engine/test_local_dp.py",
                 "tests/engine/test_callbacks.py", "tests/flower/test_executor.py",
                 "tests/data/test_flower_datasets.py"):
        assert name in out
    assert "tests/test_stats.py" not in out and len(out) < len(list((ROOT / "tests").rglob("test_*.py"))) / 2
