"""The Flower executor's waiting and giving up: the first round waits for the devices' answers (a resume after a
SuperLink restart, while devices reconnect or are marked offline), jobs expire with their round (stale jobs are never
delivered), and a run whose training rounds time out twice in a row says why on the server.

The grid here is a scripted stand-in for a SuperLink (``push_messages``/``pull_messages``, as the deployment grid):
it answers the discovery query as a device would, answers with Flower's own ``NODE_UNAVAILABLE`` error as a
SuperLink does for a node that missed its heartbeats, or never answers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")

from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.app.constants import DEFAULT_TTL
from flwr.common.constant import ErrorCode

from fedfuse.config import make_config
from fedfuse.engine.contract import Job
from fedfuse.flower import executor as xmod
from fedfuse.flower.executor import CLIENTS, FlowerExecutor

CFG = make_config({"algorithm": "fedavg", "dataset": "digits", "clients": 4, "clients_per_round": 4, "rounds": 2,
                   "seed": 0})


class ScriptedGrid:
    """``answer(node, message, attempt)`` -> a reply, or ``None`` (the node is silent); ``attempt`` counts the
    messages of that type sent to that node so far (0 first)."""

    def __init__(self, nodes: Iterable[int], answer: Callable[[int, Any, int], Any]) -> None:
        self.nodes = list(nodes)
        self.answer = answer
        self.sent: list[Any] = []
        self.replies: dict[str, Any] = {}
        from flwr.supercore.task_identity import TaskIdentity

        for attr, value in (("run_id", 1), ("task_id", 1), ("node_id", 0)):  # what a ServerApp runtime sets
            if getattr(TaskIdentity, "_" + attr) is None:
                setattr(TaskIdentity, attr, value)

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Any]) -> list[str]:
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id
            node, kind = m.metadata.dst_node_id, m.metadata.message_type
            attempt = sum(1 for s in self.sent if s.metadata.dst_node_id == node and s.metadata.message_type == kind)
            self.sent.append(m)
            reply = self.answer(node, m, attempt)
            if reply is not None:
                self.replies[m.metadata.message_id] = reply
            ids.append(m.metadata.message_id)
        return ids

    def pull_messages(self, ids: Iterable[str]) -> list[Any]:
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def holds(clients: list[int] | str) -> Callable[[Any], Any]:
    return lambda m: Message(RecordDict({CLIENTS: ConfigRecord({"clients": json.dumps(clients)})}), reply_to=m)


def unavailable(m: Any) -> Any:
    return Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Error: Node Unavailable"), reply_to=m)


def refused(m: Any) -> Any:
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="bundle of another run"), reply_to=m)


@pytest.fixture(autouse=True)
def _fast_requery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(xmod, "REQUERY_AFTER", 0.01)


def test_the_first_round_waits_until_a_reconnecting_node_answers() -> None:
    """Node 2 is offline at the SuperLink for its first three queries (its heartbeat lapsed while the SuperLink was
    down), then answers: its clients are served from the first round, not absent."""
    def answer(node: int, m: Any, attempt: int) -> Any:
        if node == 2 and attempt < 3:
            return unavailable(m)
        return holds([0, 2] if node == 1 else [1, 3])(m)

    grid = ScriptedGrid([1, 2], answer)
    ex = FlowerExecutor(grid, CFG, 0, min_nodes=2, node_wait=30)
    assert ex.present() is None
    assert ex.served == {1: [0, 2], 2: [1, 3]} and ex.answered == {1, 2}
    assert [m.metadata.dst_node_id for m in grid.sent] == [1, 2, 2, 2, 2]  # node 1 asked once, node 2 until it answered
    assert ex.holders([1, 2]) == {0: 1, 2: 1, 1: 2, 3: 2}


def test_without_the_wait_the_reconnecting_nodes_clients_would_be_absent() -> None:
    """The failure the wait removes: after the first round's wait (node_wait 0) a node offline at the SuperLink
    has its clients counted absent, and it is asked again on the next call."""
    grid = ScriptedGrid([1, 2], lambda node, m, attempt: unavailable(m) if node == 2 else holds([0, 2])(m))
    ex = FlowerExecutor(grid, CFG, 0, min_nodes=2, node_wait=0)
    ex.present()
    assert ex.served == {1: [0, 2]} and ex.holders([1, 2]) == {0: 1, 2: 1}
    ex.present()
    assert [m.metadata.dst_node_id for m in grid.sent].count(2) == 2  # asked again on the next call


def test_a_refusal_is_an_answer_and_is_not_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    grid = ScriptedGrid([1, 2], lambda node, m, attempt: refused(m) if node == 2 else holds([0, 2])(m))
    ex = FlowerExecutor(grid, CFG, 0, min_nodes=2, node_wait=600)
    with caplog.at_level(logging.WARNING, logger="fedfuse"):
        ex.present()
    assert ex.answered == {1, 2} and ex.served == {1: [0, 2]} and len(grid.sent) == 2
    assert "bundle of another run" in caplog.text and "answered within" not in caplog.text


def test_a_node_that_never_answers_ends_the_wait_at_node_wait(caplog: pytest.LogCaptureFixture) -> None:
    grid = ScriptedGrid([1, 2], lambda node, m, attempt: None if node == 2 else holds("*")(m))
    ex = FlowerExecutor(grid, CFG, 0, min_nodes=2, node_wait=0.3)
    with caplog.at_level(logging.WARNING, logger="fedfuse"):
        ex.present()
    assert ex.served == {1: None}
    assert "only 1 of the 2 nodes to wait for answered within" in caplog.text
    assert all(m.metadata.ttl <= 120 for m in grid.sent)  # the unanswered queries expire, never delivered late


def _jobs(clients: list[int], round_index: int) -> list[Job]:
    payload = {"w": torch.zeros(3)}
    return [Job(c, payload, None, ("fit", round_index, 0)) for c in clients]


def test_jobs_expire_with_their_round() -> None:
    """A job's TTL is the round timeout: the SuperLink drops it undelivered once its round is over (what a device
    busy with an earlier job would otherwise run next).  Without a timeout a job waits Flower's default TTL."""
    grid = ScriptedGrid([1], lambda node, m, attempt: holds("*")(m) if m.metadata.message_type == "query" else None)
    ex = FlowerExecutor(grid, CFG, 0, round_timeout=0.2)
    ex.send_jobs("fit", _jobs([0, 1], 0), "{}")
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert [m.metadata.ttl for m in train] == [0.2, 0.2]
    assert ex.lost == {0: "no reply (node gone or round timeout)", 1: "no reply (node gone or round timeout)"}
    grid = ScriptedGrid([1], lambda node, m, attempt: holds("*")(m) if m.metadata.message_type == "query" else None)
    untimed = FlowerExecutor(grid, CFG, 0)
    msg = untimed.message("fit", _jobs([0], 0)[0], 1, untimed_payload(), "{}")
    assert msg.metadata.ttl == DEFAULT_TTL


def untimed_payload() -> Any:
    from fedfuse.flower import wire

    return wire.to_records({"w": torch.zeros(3)})


def test_two_timed_out_rounds_in_a_row_say_why(caplog: pytest.LogCaptureFixture) -> None:
    """Node 2 is connected but never finishes a job: the first timed-out round is a warning per client, the second
    in a row an error that names the round, the timeout, the silent clients and the cause; a round in which every
    job came back resets the count."""
    silent = {"on": True}

    def answer(node: int, m: Any, attempt: int) -> Any:
        if m.metadata.message_type == "query":
            return holds([0] if node == 1 else [1])(m)
        return None if node == 2 and silent["on"] else refused(m)  # an answer (an error reply), not a timeout

    grid = ScriptedGrid([1, 2], answer)
    ex = FlowerExecutor(grid, CFG, 0, round_timeout=0.1)
    with caplog.at_level(logging.WARNING, logger="fedfuse"):
        ex.send_jobs("fit", _jobs([0, 1], 0), "{}")
        assert ex.timed_out == 1 and not [r for r in caplog.records if r.levelno == logging.ERROR]
        ex._silent.clear()  # node 2 would be skipped for a few calls: ask it again at once
        ex.send_jobs("fit", _jobs([0, 1], 1), "{}")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and ex.timed_out == 2
    assert errors[0].startswith("flower: round 2 timed out, 2 training rounds in a row (round-timeout 0.1 s): 1 of 2 "
                                "training jobs unanswered (clients [1]): nodes [2] are connected but did not finish")
    assert "raise round-timeout" in errors[0]
    ex._silent.clear()
    silent["on"] = False
    ex.send_jobs("fit", _jobs([0, 1], 2), "{}")
    assert ex.timed_out == 0


def test_the_reason_names_nodes_that_left(caplog: pytest.LogCaptureFixture) -> None:
    """Both nodes are silent twice; node 2 is gone from the SuperLink's list by the end of the second round (a
    device that died): the reason tells the two apart."""
    def answer(node: int, m: Any, attempt: int) -> Any:
        if m.metadata.message_type == "query":
            return holds([0] if node == 1 else [1])(m)
        if node == 2 and attempt == 1:
            grid.nodes.remove(2)
        return None

    grid = ScriptedGrid([1, 2], answer)
    ex = FlowerExecutor(grid, CFG, 0, round_timeout=0.05)
    with caplog.at_level(logging.ERROR, logger="fedfuse"):
        ex.send_jobs("fit", _jobs([0, 1], 0), "{}")
        ex._silent.clear()
        ex.send_jobs("fit", _jobs([0, 1], 1), "{}")
    (error,) = [r.getMessage() for r in caplog.records]
    assert "2 of 2 training jobs unanswered (clients [0, 1])" in error
    assert "nodes [1] are connected but did not finish" in error and "nodes [2] left the federation" in error
