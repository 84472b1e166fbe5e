"""What a device decides for itself (``fedfuse.flower.node_policy``), attacked as the server would attack it.

Adversary: the server (honest-but-curious, or actively weakening the job).  It writes the run config and the
seed every job carries, and it sees every reply.  Every message crosses Flower's protobuf wire
(:class:`~fedfuse.flower.executor.LocalGrid`).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

pytest.importorskip("flwr", reason="needs the flower extra: pip install -e '.[flower]'")
pytest.importorskip("opacus", reason="needs the dp extra: pip install -e '.[dp]'")

from fedfuse.config import make_config
from fedfuse.engine.client import TrainConfig
from fedfuse.engine.executor import Job, job_generator, seed_global
from fedfuse.engine.local_dp import local_epsilon, planned_steps, sample_rate, train_dp_sgd
from fedfuse.engine.loop import build_federation
from fedfuse.flower import app, wire
from fedfuse.flower.app import client_app, prepare_node
from fedfuse.flower.executor import JOB, FlowerExecutor, LocalGrid
from fedfuse.flower.node_policy import NodeDP, RefusedJob, composed_epsilon, node_view
from fedfuse.runner import experiment
from fedfuse.types import Split


def _cfg(**kw):
    base = dict(algorithm="fedavg", dataset="digits", model="mlp", clients=2, clients_per_round=2, rounds=1,
                local_epochs=1, batch_size=64, lr=0.1, dp="local", dp_noise=1.0, dp_clip=1.0, plots=False,
                model_options={"widths": [16]})
    base.update(kw)
    return make_config(base)


def _policy(tmp_path, **kw) -> dict:
    return {"dp-noise": 1.0, "dp-clip": 1.0, "dp-epsilon": 50.0, "state-dir": str(tmp_path / "node"), **kw}


def _run(cfg, node_config: dict | None, nodes: int = 1):
    app._RUNS.clear()
    grid = LocalGrid(client_app, nodes, node_config=[node_config or {}] * nodes)
    exp = experiment(cfg, executor=FlowerExecutor(grid, cfg, cfg.seed))
    exp.run()
    return exp


# ---- refusing weaker local DP ---------------------------------------------------------------------------------
@pytest.mark.parametrize("weaker", [{"dp_noise": 0.0}, {"dp": "none"}, {"dp_clip": 5.0}, {"dp_noise": 0.5}])
def test_a_job_asking_for_weaker_local_dp_is_refused_by_the_node(tmp_path, caplog, weaker):
    """The server sends ``dp_noise=0`` (or turns DP off, raises the clip): the node refuses every job, says why,
    the clients are dropouts and nothing is charged or trained."""
    caplog.set_level(logging.WARNING, logger="fedfuse")
    exp = _run(_cfg(**weaker), _policy(tmp_path))
    assert exp.history[0]["dropped"] == [0, 1] and exp.history[0]["replied"] == 0
    asked = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in weaker.items())
    refusals = [r.getMessage() for r in caplog.records if "trains only under dp=local" in r.getMessage()]
    assert refusals and all(asked in m and "job refused" in m for m in refusals), refusals
    assert not (tmp_path / "node" / "local-dp.json").exists()


def test_a_job_at_least_as_strong_runs_and_the_node_accounts_its_epsilon(tmp_path):
    """A run with the node's noise (or more) trains; the node's accountant holds each client's steps and its ε
    equals Opacus's RDP accountant over them (q = 1/⌈n/B⌉, local_epochs·⌈n/B⌉ steps)."""
    cfg = _cfg(dp_noise=1.3, dp_clip=0.5, rounds=2)
    exp = _run(cfg, _policy(tmp_path))
    assert [h["dropped"] for h in exp.history] == [[], []]
    book = json.loads((tmp_path / "node" / "local-dp.json").read_text())
    fed = build_federation(cfg)
    for c in (0, 1):
        n = len(fed.clients[c].train)
        q, steps = sample_rate(n, 64), planned_steps(n, TrainConfig(local_epochs=1, batch_size=64))
        assert book["clients"][str(c)] == [[1.3, q, steps], [1.3, q, steps]]
        eps = NodeDP.from_node_config(_policy(tmp_path)).accountant().epsilon(c)
        assert eps == pytest.approx(local_epsilon(1.3, q, 2 * steps, 1e-5), rel=1e-9) and eps > 0


def test_the_node_refuses_to_train_past_its_budget_across_rounds_and_runs(tmp_path, caplog):
    """The budget allows one round: round 2 is refused (its clients drop out, nothing more is charged), and a
    new run on the same node (same state directory) is refused from its first round."""
    cfg = _cfg(rounds=2)
    fed = build_federation(cfg)
    rounds = [[local_epsilon(1.0, sample_rate(len(c.train), 64), k * planned_steps(len(c.train), TrainConfig(
        local_epochs=1, batch_size=64)), 1e-5) for c in fed.clients] for k in (1, 2)]
    one, two = max(rounds[0]), min(rounds[1])
    assert one < two
    node = _policy(tmp_path, **{"dp-epsilon": (one + two) / 2})  # every client's first round, no second one
    caplog.set_level(logging.WARNING, logger="fedfuse")
    exp = _run(cfg, node)
    assert [h["dropped"] for h in exp.history] == [[], [0, 1]]
    assert any("past this node's budget" in r.getMessage() for r in caplog.records)
    book = (tmp_path / "node" / "local-dp.json").read_text()
    again = _run(_cfg(rounds=1, seed=7), node)
    assert again.history[0]["dropped"] == [0, 1]
    assert (tmp_path / "node" / "local-dp.json").read_text() == book  # a refused job charges nothing
    # more local epochs than the budget allows are refused up front, on a fresh node
    fresh = _policy(tmp_path / "fresh", **{"dp-epsilon": (one + two) / 2})
    assert _run(_cfg(local_epochs=3), fresh).history[0]["dropped"] == [0, 1]


def test_a_half_configured_node_refuses_rather_than_train_unprotected(tmp_path):
    with pytest.raises(RefusedJob, match="set dp-clip, dp-epsilon"):
        NodeDP.from_node_config({"dp-noise": 1.0, "state-dir": str(tmp_path)})
    with pytest.raises(RefusedJob, match="must be > 0"):
        NodeDP.from_node_config(_policy(tmp_path, **{"dp-epsilon": 0.0}))
    assert NodeDP.from_node_config({"data": "x"}) is None


def test_composed_epsilon_equals_one_accountant_over_all_steps():
    """Two entries of the same (noise, rate) compose to the ε of their summed steps; a noiseless step is ∞."""
    assert composed_epsilon([(1.1, 0.1, 30), (1.1, 0.1, 20)], 1e-5) == pytest.approx(
        local_epsilon(1.1, 0.1, 50, 1e-5), rel=1e-12)
    assert composed_epsilon([], 1e-5) == 0.0 and composed_epsilon([(0.0, 0.5, 1)], 1e-5) == float("inf")


# ---- the seed the server sends does not give it the noise ------------------------------------------------------
def _attack(tmp_path, node_config: dict | None) -> float:
    """The issue's attack: one client holds one example; it runs one full-batch DP-SGD step (q = 1).  The server
    knows the job's seed and keys, replays the step on an all-zero input with the same generators (so the replay's
    first-layer gradient is 0 and its noise is the node's, if the node used the seed) and subtracts: what is left
    of the first layer is the clipped gradient δ·xᵀ, whose top right singular vector is the private input.
    Returns |cos| between that vector and the true input."""
    cfg = _cfg(clients=1, clients_per_round=1, batch_size=1, lr=1.0, dp_noise=1.0, dp_clip=1.0)
    fed = build_federation(cfg)
    secret = fed.clients[0].train
    one = Split(secret.x[:1].clone(), secret.y[:1].clone())
    fed = dataclasses.replace(fed, clients=[dataclasses.replace(fed.clients[0], train=one)])
    app._RUNS.clear()
    prepare_node(cfg, fed=fed)
    grid = LocalGrid(client_app, 1, node_config=[node_config or {}])
    seen: list = []
    real = grid.send_and_receive

    def spy(messages, *, timeout=None):
        messages = list(messages)
        replies = real(messages, timeout=timeout)
        seen.extend(zip(messages, replies, strict=False))
        return replies

    grid.send_and_receive = spy
    exp = experiment(cfg, fed=fed, executor=FlowerExecutor(grid, cfg, cfg.seed))
    exp.run()
    sent, reply = next((m, r) for m, r in seen if int(m.content[JOB]["cid"]) == 0 and m.content[JOB]["method"] == "fit")
    assert not reply.has_error()
    job_rec = sent.content[JOB]
    payload = wire.from_records(sent.content[wire.PAYLOAD_ARRAYS], sent.content[wire.PAYLOAD_SKELETON])
    released = wire.unpack(reply.content)["result"][0].tensors
    # the server's replay: same seed, same keys, same generators, an input of zeros
    run = app._RUNS[next(iter(app._RUNS))]
    job = Job(0, payload, {}, tuple(json.loads(str(job_rec["keys"]))))
    seed_global(int(job_rec["seed"]), job)
    model = run.ctx.load(payload.tensors, payload.meta)
    dummy = Split(torch.zeros_like(one.x), one.y.clone())
    replay, _ = train_dp_sgd(model, dummy, TrainConfig(**json.loads(str(job_rec["train"]))),
                             job_generator(int(job_rec["seed"]), job), noise=1.0, clip=1.0)
    first = next(k for k, v in released.items() if v.dim() == 2)
    estimate = replay[first].double() - released[first].double()  # lr · (clipped gradient of the true input)
    x_hat = torch.linalg.svd(estimate).Vh[0]
    x = one.x.reshape(-1).double()
    return float(abs(x_hat @ x) / x.norm())


def test_the_servers_seed_does_not_regenerate_a_protected_nodes_noise(tmp_path):
    """Against a node without its own policy (noise from the job's seed) the attack recovers the private input
    (cosine ≈ 1); against a node enforcing its own local DP it recovers nothing (the noise and batches come from
    the node's OS-seeded generator)."""
    exposed = _attack(tmp_path, None)
    assert exposed > 0.999
    protected = _attack(tmp_path, _policy(tmp_path))
    assert protected < 0.6, protected  # noise-dominated: |cos| of a random direction in 64-d is ~0.12


# ---- paths come from the node ---------------------------------------------------------------------------------
def test_a_node_takes_every_path_from_its_own_config_never_from_the_server(tmp_path, monkeypatch):
    """The server names ``data_dir=/etc``, a LoRA base under its control and an ``hf:`` dataset path: the node
    uses its own ``data-dir`` (or none), its own ``lora-base`` and ``hf-dataset``, or refuses the run."""
    for var in ("FEDFUSE_DATA", "FEDFUSE_LORA_BASE", "FEDFUSE_HF_DATASET"):
        monkeypatch.delenv(var, raising=False)
    cfg = make_config(algorithm="fedavg", dataset="digits", data_dir="/etc", out="/srv/run", plots=False)
    mine = node_view(cfg, {"data-dir": str(tmp_path)})
    assert mine.data_dir == str(tmp_path) and mine.out is None
    assert node_view(cfg, {}).data_dir is None  # the node's default ($FEDFUSE_DATA), not the server's
    monkeypatch.setenv("FEDFUSE_DATA", str(tmp_path / "env"))
    assert node_view(cfg, {}).data_dir == str(tmp_path / "env")
    lora = dataclasses.replace(cfg, algorithm_options={"base": "fedfuse:/srv/attacker.pt", "rank": 2})
    with pytest.raises(RefusedJob, match="loads a base only from its own config"):
        node_view(lora, {})
    assert node_view(lora, {"lora-base": "fedfuse:/opt/base.pt"}).algorithm_options == {
        "base": "fedfuse:/opt/base.pt", "rank": 2}
    hf = dataclasses.replace(cfg, dataset="hf:/srv/attacker")
    with pytest.raises(RefusedJob, match="hf-dataset"):
        node_view(hf, {})
    assert node_view(hf, {"hf-dataset": "/data/mine"}).dataset == "hf:/data/mine"
    assert node_view(hf, {"data": "/data/bundle"}).dataset == "hf:/srv/attacker"  # node-local data: never read


def test_a_lora_run_on_flower_loads_the_nodes_base_not_the_servers(tmp_path, monkeypatch):
    """End to end: the server's run names a base path the node must not open; the node's job builds the adapter
    model from its own ``lora-base`` (the file the server named is never opened)."""
    pytest.importorskip("peft", reason="needs the lora extra")
    from fedfuse.adapters import lora
    from support import SHARED_DATA, lora_tiny_base

    monkeypatch.delenv("FEDFUSE_LORA_BASE", raising=False)
    mine = lora_tiny_base(tmp_path)
    opened: list[str] = []
    real = lora.load_base
    monkeypatch.setattr(lora, "load_base", lambda base, device="cpu": opened.append(base) or real(base, device))
    run_json = json.dumps(make_config(
        algorithm="fedit", dataset="tiny-shakespeare", model="transformer", partition="iid", clients=2,
        clients_per_round=2,
        rounds=1, plots=False, algorithm_options={"base": "fedfuse:/srv/attacker.pt", "rank": 2}).to_dict(),
        sort_keys=True, default=str)
    app._RUNS.clear()
    with pytest.raises(RefusedJob, match="lora-base"):
        app.node_run(run_json, {})
    try:
        run = app.node_run(run_json, {"lora-base": mine, "data-dir": str(SHARED_DATA)})
    except Exception as e:  # the data may be missing on this machine; the base is loaded first either way
        pytest.skip(f"tiny-shakespeare not available: {e}")
    assert run.cfg.algorithm_options["base"] == mine and opened and set(opened) == {mine}


def test_every_dp_sgd_call_is_checked_with_the_parameters_it_really_runs_with(tmp_path, monkeypatch, caplog):
    """The check sits in DP-SGD itself (``local_dp.guarded``), not in the run config: a client step that calls
    DP-SGD with a weaker noise than the node's is refused even when the run config says otherwise, and a client
    step that trains without DP-SGD at all has its reply withheld."""
    import fedfuse.engine.local_dp as local_dp  # the client-step wrapper (LocalDPClient) calls DP-SGD from here
    from fedfuse.engine.client import TrainStats

    caplog.set_level(logging.WARNING, logger="fedfuse")
    real = local_dp.train_dp_sgd
    monkeypatch.setattr(local_dp, "train_dp_sgd", lambda *a, noise, clip: real(*a, noise=noise / 10, clip=clip))
    exp = _run(_cfg(), _policy(tmp_path))
    assert exp.history[0]["dropped"] == [0, 1]
    assert not (tmp_path / "node" / "local-dp.json").exists() or json.loads(
        (tmp_path / "node" / "local-dp.json").read_text())["clients"] == {}

    def plain_sgd(model, split, train, gen, *, noise, clip):  # a client step that skips DP-SGD
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, TrainStats(steps=5, samples=50)

    monkeypatch.setattr(local_dp, "train_dp_sgd", plain_sgd)
    exp = _run(_cfg(), _policy(tmp_path / "b"))
    assert exp.history[0]["dropped"] == [0, 1] and exp.history[0]["replied"] == 0
    assert "DP-SGD asked with noise 0.1" in caplog.text and "without DP-SGD" in caplog.text
