"""LocalFederation.restart: a SuperNode killed without a goodbye stays online at the SuperLink until its
heartbeats lapse, and the SuperLink refuses to activate its key until then; restart retries exactly that.

A SuperLink crash mid-run (devices stay registered, the run resumes through ``flwr run`` and equals the
uninterrupted run, both runs' rounds in ``flwr log``) is deployed by the executed guide,
``test_federation_guide.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedfuse.flower import federation as fmod
from fedfuse.flower.federation import FederationError, LocalFederation

REFUSED = ("supernode-1 exited with 1:\nERROR: Exit Code: 305\nFailed to initialize the connection to the SuperLink.\n"
           "[code: 2004] Failed to activate SuperNode.")


def _federation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcomes: list[object],
                startup_timeout: float = 60.0) -> tuple[LocalFederation, dict[str, int]]:
    """A federation whose node 1 was killed; each start of node 1 ends with the next of ``outcomes`` (an
    exception to raise or a node id)."""
    fed = LocalFederation(tmp_path, nodes=2, startup_timeout=startup_timeout)
    fed.nodes, fed.workers, fed.node_id = [object(), None], [None, None], [3, 5]
    calls = {"start": 0, "kill": 0, "sleep": 0}

    def start(i: int) -> object:
        calls["start"] += 1
        return object()

    def wait(i: int) -> int:
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return int(out)  # type: ignore[call-overload]

    def kill(i: int) -> None:
        calls["kill"] += 1
        fed.nodes[i] = None

    monkeypatch.setattr(fed, "_start_node", start)
    monkeypatch.setattr(fed, "_wait_node", wait)
    monkeypatch.setattr(fed, "kill", kill)
    monkeypatch.setattr(fmod.time, "sleep", lambda s: calls.__setitem__("sleep", calls["sleep"] + 1))
    return fed, calls


def test_restart_retries_while_the_superlink_refuses_the_killed_nodes_key(tmp_path, monkeypatch):
    fed, calls = _federation(tmp_path, monkeypatch, [FederationError(REFUSED), FederationError(REFUSED), 9])
    assert fed.restart(1) == 9 and fed.node_id == [3, 9] and fed.nodes[1] is not None
    assert calls == {"start": 3, "kill": 2, "sleep": 2}  # each refused start reaped before the next
    assert fed.restart(0) == 3 and calls["start"] == 3  # a running node is not restarted


def test_restart_raises_other_failures_at_once_and_refusals_after_the_deadline(tmp_path, monkeypatch):
    fed, calls = _federation(tmp_path, monkeypatch, [FederationError("supernode-1 exited with 1:\nboom")])
    with pytest.raises(FederationError, match="boom"):
        fed.restart(1)
    assert calls["start"] == 1 and calls["kill"] == 0
    # a deadline already passed (startup_timeout below -NODE_OFFLINE_AFTER): the first refusal is final
    fed, calls = _federation(tmp_path, monkeypatch, [FederationError(REFUSED), 9],
                             startup_timeout=-fmod.NODE_OFFLINE_AFTER - 1)
    with pytest.raises(FederationError, match="Failed to activate SuperNode"):
        fed.restart(1)
    assert calls["start"] == 1
