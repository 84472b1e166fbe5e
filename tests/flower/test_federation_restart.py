"""LocalFederation.restart: a SuperNode killed without a goodbye stays online at the SuperLink until its
heartbeats lapse, and the SuperLink refuses to activate its key until then; restart retries exactly that."""

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


RESTART_CONFIG = """\
algorithm: fedavg
dataset: digits
clients: 2
clients_per_round: 2
rounds: 4
eval_every: 2
threads: 1
plots: false
seed: 5
model_options:
  widths: [16]
"""


@pytest.mark.slow
def test_superlink_restart_keeps_devices_registered_and_the_run_resumes(tmp_path: Path) -> None:
    """The documented deployment (SuperLink with --database on loopback, gateway, signed app, warm workers): the
    SuperLink (and its ServerApp) is SIGKILLed once both devices have received their round-3 job (checkpoint after
    round 2), and started again on the same database.  The devices neither exit nor re-register (same processes,
    same node ids); `flwr run --run-config resume=true` continues from the checkpoint — its first round waits for
    both devices' answers, so none of their clients is a dropout — and the run ends equal to the in-process run of
    the same config.  Both runs' progress (round, loss, accuracy) is in `flwr log`, the killed run's too."""
    import json
    import os
    import time

    import fedfuse
    from fedfuse.config import make_config
    from fedfuse.engine.loop import build_federation, strip_timing
    from fedfuse.flower.deploy import write_app
    from fedfuse.flower.node_data import write_node_bundles
    from fedfuse.runner import experiment

    pytest.importorskip("flwr")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(RESTART_CONFIG)
    bundles = write_node_bundles(build_federation(make_config(str(cfg))), tmp_path / "nodes", 2)
    experiment(make_config(str(cfg), out=str(tmp_path / "ref"), executor="sequential")).run()
    out = tmp_path / "out"
    app = write_app(tmp_path / "app", cfg, out=out, round_timeout=0.0, min_nodes=2)
    src = str(Path(fedfuse.__file__).resolve().parents[1])
    env = {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}

    def metrics() -> list[dict]:
        path = out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    with LocalFederation(tmp_path / "fed", nodes=2, env=env, warm=True, gateway=True, signed=True, database=True,
                         node_config=[f"data='{b}'" for b in bundles]) as fed:
        first = fed.run(app)
        deadline = time.monotonic() + 600
        while len(metrics()) < 2 or min(_jobs_received(p.log) for p in fed.nodes if p) < 3:  # round 3 in flight
            assert time.monotonic() < deadline, (fed.logs / f"run-{first}.log").read_text()[-3000:]
            time.sleep(0.05)
        nodes, ids = [p.popen.pid for p in fed.nodes if p], list(fed.node_id)
        fed.restart_superlink()  # a crash: SIGKILL, the ServerApp with it
        assert sorted(fed.node_ids()) == sorted(ids)  # still registered and online after the restart
        second = fed.run(app, run_config={"resume": True})
        assert fed.wait(second, timeout=600) == "finished:completed", (fed.logs / f"run-{second}.log").read_text()
        assert [p.popen.pid for p in fed.nodes if p] == nodes and all(p.popen.poll() is None for p in fed.nodes if p)
        links = (fed.logs / "superlink.log").read_text()
        shown = fed.flwr("log", str(second), fed.connection, "--show")
        killed = fed.flwr("log", str(first), fed.connection, "--show")
    got = metrics()
    assert [r["round"] for r in got] == [1, 2, 3, 4]
    ref = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert [strip_timing(r) for r in got] == [strip_timing(r) for r in ref]
    assert "No SuperNode found" not in links and "Invalid run configuration" not in links
    # `flwr log`: the resumed run's rounds 3 and 4 with their loss and accuracy, as metrics.jsonl has them
    for r in got[2:]:
        assert f"fedfuse round {r['round']}/4: 2/2 replied, train_loss {r['train_loss']:.4f}" in shown
    assert f"global_accuracy {got[3]['global_accuracy']:.4f}" in shown and "fedfuse round 2/4" in killed


def _jobs_received(log: Path) -> int:
    """Training jobs a SuperNode has received so far (its log's ``Receiving: train message`` lines)."""
    return log.read_text(errors="replace").count("Receiving: train message")
