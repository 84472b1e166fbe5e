"""SCAFFOLD: option II control variates by hand, the correction term's gradient, one local step by hand, and the
first round equal to uniform FedAvg."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedfuse.algorithms.base import RoundInfo
from fedfuse.algorithms.scaffold import CV, DC, correction, option_two
from fedfuse.config import RunConfig, apply
from fedfuse.engine.loop import Experiment
from fedfuse.engine.program import Batch
from fedfuse.runner import experiment


def _exp(algorithm: str = "scaffold", **over) -> Experiment:
    cfg = dict(algorithm=algorithm, dataset="digits", model="mlp", clients=4, clients_per_round=3, rounds=1,
               batch_size=32, lr=0.05, seed=1, plots=False, executor="sequential", local_epochs=1, eval_every=1,
               model_options={"widths": [16]}, partition_options={"alpha": 1.0, "min_size": 20})
    return experiment(apply(RunConfig(), {**cfg, **over}))


def test_option_two_by_hand():
    """c_i⁺ = c_i − c + (x − y)/(K η_l): 1 − 0.5 + (2 − 1.5)/(2 · 0.25) = 1.5."""
    t = torch.tensor
    new = option_two({"w": t([1.0])}, {"w": t([0.5])}, {"w": t([2.0])}, {"w": t([1.5])}, steps=2, lr=0.25)
    assert new["w"].item() == 1.5
    assert option_two({"w": t([1.0])}, {"w": t([0.5])}, {"w": t([2.0])}, {"w": t([2.0])}, 0, 0.25)["w"].item() == 1.0


def test_correction_term_gradient_is_c_minus_ci():
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    corr = torch.tensor([0.3, -0.7])
    b = Batch(x=torch.zeros(1), y=torch.zeros(1), logits=torch.zeros(1), features=None, params={"w": w}, buffers={},
              refs={CV + "w": corr}, step=0)
    correction(b).backward()
    assert torch.equal(w.grad, corr)


def test_one_local_step_is_y_minus_lr_times_corrected_gradient():
    """y = x − η (∇L(x) − c_i + c) for one full-batch SGD step with non-zero c and c_i."""
    exp = _exp(batch_size=4096)
    algo, client = exp.algo, exp.fed.clients[0]
    msg = algo.configure_fit(exp.algo.init_state(), RoundInfo(0, 1), [0])[0]
    g = torch.Generator().manual_seed(0)
    keys = sorted(k for k in msg.tensors if k.startswith(CV))
    c = {k[len(CV):]: torch.randn(msg.tensors[k].shape, generator=g) * 0.1 for k in keys}
    ci = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in c.items()}
    payload = type(msg)({**{k: v for k, v in msg.tensors.items() if not k.startswith(CV)},
                         **{CV + k: v for k, v in c.items()}})
    reply, state = algo.fit(payload, {"c": ci}, client, torch.Generator().manual_seed(1))
    model = algo.ctx.load({k: v for k, v in payload.tensors.items() if not k.startswith(CV)})
    model.zero_grad()
    F.cross_entropy(model(client.train.x), client.train.y).backward()
    for name, p in model.named_parameters():
        expect = p.detach() - 0.05 * (p.grad - ci[name] + c[name])
        assert torch.allclose(reply.tensors[name], expect, atol=1e-6), name
        assert torch.allclose(state["c"][name], ci[name] - c[name] + (p.detach() - reply.tensors[name]) / 0.05,
                              atol=1e-4)
        assert torch.equal(reply.tensors[DC + name], state["c"][name] - ci[name])


def test_first_round_is_uniform_fedavg_and_c_is_the_mean_control_update():
    """With c = c_i = 0 the first round trains like FedAvg (uniform weights); c ← (1/N) Σ Δc_i over N = 4."""
    sc, fa = _exp(), _exp("fedavg", algorithm_options={"weighting": "uniform"})
    sc.run()
    fa.run()
    g_sc, g_fa = sc.state["global"], fa.state["global"]
    assert all(torch.equal(g_sc[k], g_fa[k]) for k in g_fa)
    cs = [s["c"] for s in sc.client_states.values() if s]
    assert len(cs) == 3
    for k, v in sc.state["c"].items():
        assert torch.allclose(v, sum(c[k] for c in cs) / 4, atol=1e-7)


def _reference_rounds(exp: Experiment, schedule: list[list[int]], lr: float, bs: int) -> tuple[dict, dict]:
    """Algorithm 1 of the paper written out directly (option II, uniform average, η_g = 1), on the experiment's
    own model class and client data, drawing each client's batches exactly as the engine does (one permutation
    per epoch from a generator seeded by round and client)."""
    net = exp.algo.ctx.load(exp.algo.init_state()["global"])
    x = {k: v.detach().clone() for k, v in net.state_dict().items()}
    keys = [k for k, _ in net.named_parameters()]
    n_clients = len(exp.fed.clients)
    c = {k: torch.zeros_like(x[k]) for k in keys}
    ci = {i: {k: torch.zeros_like(x[k]) for k in keys} for i in range(n_clients)}
    for r, chosen in enumerate(schedule):
        ys, dcs = [], []
        for i in chosen:
            d, g = exp.fed.clients[i].train, torch.Generator().manual_seed(100 * r + i)
            net.load_state_dict(x)
            params = dict(net.named_parameters())
            steps = 0
            for _ in range(exp.cfg.local_epochs):
                perm = torch.randperm(len(d), generator=g)
                for s in range(0, len(d), min(bs, len(d))):
                    idx = perm[s : s + bs]
                    net.zero_grad()
                    F.cross_entropy(net(d.x[idx]), d.y[idx]).backward()
                    with torch.no_grad():
                        for k, p in params.items():
                            p -= lr * (p.grad - ci[i][k] + c[k])
                    steps += 1
            y = {k: v.detach().clone() for k, v in net.state_dict().items()}
            new = {k: ci[i][k] - c[k] + (x[k] - y[k]) / (steps * lr) for k in keys}
            ys.append(y)
            dcs.append({k: new[k] - ci[i][k] for k in keys})
            ci[i] = new
        x = {k: sum(y[k] for y in ys) / len(ys) for k in x}
        c = {k: c[k] + sum(dc[k] for dc in dcs) / n_clients for k in keys}
    return x, c


def test_rounds_on_a_cnn_match_algorithm_one_written_out():
    """Three rounds with partial participation on a convolutional model: the server's x and c equal those of the
    paper's Algorithm 1 written out by hand (the CNN benchmarks' SCAFFOLD results are the method's, not a
    conv-layer bug of the implementation)."""
    exp = _exp(model="cnn-cifar", model_options={"channels": [4, 6], "hidden": [12, 10]}, local_epochs=2,
               batch_size=16, clients=5)
    algo, schedule = exp.algo, [[0, 1, 2], [1, 3], [0, 2, 3, 4]]
    state, client_states = algo.init_state(), {}
    for r, chosen in enumerate(schedule):
        info = RoundInfo(r, len(schedule))
        payloads = algo.configure_fit(state, info, chosen)
        results = {}
        for i in chosen:
            results[i], client_states[i] = algo.fit(payloads[i], client_states.get(i), exp.fed.clients[i],
                                                    torch.Generator().manual_seed(100 * r + i))
        state = algo.fuse(state, info, results)
    x, c = _reference_rounds(exp, schedule, lr=0.05, bs=16)
    assert any(v.dim() == 4 for v in x.values())  # a conv weight is among the compared tensors
    for k, v in x.items():
        assert torch.allclose(state["global"][k], v, atol=1e-5), k
    assert set(state["c"]) == set(c)
    for k, v in c.items():
        assert v.abs().sum() > 0 and torch.allclose(state["c"][k], v, atol=1e-4), k
