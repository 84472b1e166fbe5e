"""Shared test settings.  ``tests/`` is on ``sys.path`` (pytest's default import mode puts it there for this file;
the insert below keeps it so under ``--import-mode=importlib``), so test files import ``support`` and
``golden.make_golden``; test folders mirror ``src/fedfuse`` (docs/design.md, *Tests*)."""

import os
import sys
from pathlib import Path

import pytest
import torch

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

# ``threads = auto`` follows the load average unless this is set; a test that compares two runs needs the same
# count in both (float sums, and FedMA's matching through them, depend on it).  Subprocesses inherit it.
os.environ.setdefault("FEDFUSE_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "extra: touches an optional extra (tests/extra_use.py; .ci/run runs these "
                                       "with only the README's quick-start install)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that touch an optional extra, when a marker expression asks for them (``-m extra``)."""
    if "extra" not in (config.option.markexpr or ""):
        return
    from extra_use import select

    for item in select(items):
        item.add_marker(pytest.mark.extra)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The test models are tiny: one intra-op thread is faster than OpenMP spinning on a small shared CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _outputs_outside_the_repository(tmp_path, monkeypatch):
    """Every test runs in its own temporary directory, so a default output path (``runs/...``) never lands in
    the working tree."""
    monkeypatch.chdir(tmp_path)
