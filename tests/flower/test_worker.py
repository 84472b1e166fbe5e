"""The warm worker's task pull is bounded: a task whose run died under it (a SuperLink crash mid-round) fails
within the worker's ``pull_timeout`` instead of holding the worker for Flower's 2-hour default."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr")


class NeverAvailable:
    """A Runtime API whose message objects never become available (what a SuperNode answers for a run the
    restarted SuperLink calls finished)."""

    def __init__(self) -> None:
        self.pulls = 0

    def PullTaskInput(self, request):
        return SimpleNamespace(task_id=7, run=SimpleNamespace(run_id=3), context=SimpleNamespace(node_id=5),
                               fab=None)

    def PullMessages(self, request):
        return SimpleNamespace(messages_list=[object()], message_object_trees=[SimpleNamespace(object_id="a" * 64,
                                                                                               children=[])])

    def PullObject(self, request):
        self.pulls += 1
        return SimpleNamespace(object_found=True, object_available=False, object_content=b"")

    def ConfirmMessageReceived(self, request):
        raise AssertionError("nothing was received")


def test_a_task_whose_objects_never_arrive_fails_within_the_pull_timeout(monkeypatch):
    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError
    from flwr.supernode.runtime import run_clientapp as rc

    from fedfuse.flower import worker

    monkeypatch.setattr(rc, "context_from_proto", lambda c: SimpleNamespace(node_id=c.node_id, run_id=3))
    monkeypatch.setattr(rc, "run_from_proto", lambda r: r)
    monkeypatch.setattr(rc, "fab_from_proto", lambda f: f)
    client = NeverAvailable()
    t0 = time.monotonic()
    with pytest.raises(ObjectPullError, match="timeout or retry limit"):
        worker.pull_task_input(client, max_time=2.0)
    took = time.monotonic() - t0
    assert client.pulls >= 1 and took < 30, took  # Flower's own default would retry for up to 7,200 s
    assert worker.DEFAULT_PULL_TIMEOUT <= 120


def test_the_worker_and_its_flag_carry_the_pull_timeout():
    from fedfuse.flower import worker

    w = worker.WarmWorker.__new__(worker.WarmWorker)
    worker.WarmWorker.__init__(w, "127.0.0.1:1", pull_timeout=5.0)
    assert w.pull_timeout == 5.0
    assert "--pull-timeout" in Path(worker.__file__).read_text()
