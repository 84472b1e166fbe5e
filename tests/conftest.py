"""Shared test settings."""

import pytest
import torch


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
