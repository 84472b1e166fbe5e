"""fedfuse reaches a device as a wheel (``python -m build``), installed with one ``pip install``; the app bundle
names the exact fedfuse version, and a device running another version refuses the bundle before running anything."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")

from fedfuse.flower.deploy import build_fab, check_fedfuse_bundle, installed_fedfuse, write_app

ROOT = Path(__file__).resolve().parents[2]


def _with_dependencies(fab: bytes, deps: list[str]) -> bytes:
    """``fab`` with its pyproject's dependencies replaced (what a bundle built elsewhere would carry)."""
    import re

    src, out = zipfile.ZipFile(io.BytesIO(fab)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name in src.namelist():
            data = src.read(name)
            if name == "pyproject.toml":
                data = re.sub(rb"dependencies = \[.*?\n\]", ("dependencies = " + json.dumps(deps)).encode(), data,
                              flags=re.S)
                assert json.dumps(deps).encode() in data
            z.writestr(name, data)
    return out.getvalue()


def test_the_app_names_the_installed_fedfuse_and_a_device_with_another_version_refuses_it(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("algorithm: fedavg\ndataset: digits\nclients: 2\n")
    fab = build_fab(write_app(tmp_path / "app", tmp_path / "c.yaml"))
    version = installed_fedfuse()
    assert f'"fedfuse=={version}"' in zipfile.ZipFile(io.BytesIO(fab)).read("pyproject.toml").decode()
    check_fedfuse_bundle(fab)  # this device runs that version
    check_fedfuse_bundle(_with_dependencies(fab, ["fedfuse", "flwr"]))  # no pin: nothing to compare
    with pytest.raises(PermissionError, match=r"built for fedfuse 9\.9\.9, and this device runs fedfuse "
                                              rf"{version}: install the operator's wheel"):
        check_fedfuse_bundle(_with_dependencies(fab, ["fedfuse==9.9.9", "flwr"]))


@pytest.mark.slow
def test_the_wheel_carries_fedfuse_and_installs_with_one_command(tmp_path: Path) -> None:
    """``python -m build --wheel`` of a copy of the source tree (``--no-isolation``: offline, with the installed
    setuptools), then the one ``pip install`` a device runs (``--no-deps``: torch and Flower are already here): the
    installed fedfuse — not the source tree — imports its Flower app and worker, at the version the app pins."""
    pytest.importorskip("build", reason="needs the test extra (build): pip install -e '.[test]'")
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"),
                    str(tree)], check=True, capture_output=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("fedfuse-*-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"fedfuse/flower/app.py", "fedfuse/flower/worker.py", "fedfuse/flower/supernode.py",
            "fedfuse/catalog.json"} <= set(names)
    site = tmp_path / "device-site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    probe = ("import json, fedfuse, fedfuse.flower.app, fedfuse.flower.worker\n"
             "from fedfuse.flower.deploy import installed_fedfuse\n"
             "print(json.dumps([fedfuse.__file__, installed_fedfuse()]))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, check=True, capture_output=True,
                         text=True, timeout=300)
    where, version = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(where).is_relative_to(site) and wheel.name.startswith(f"fedfuse-{version}-")
