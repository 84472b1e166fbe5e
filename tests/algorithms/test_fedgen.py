"""FedGen: label weights, diversity loss, decay, the generator learns the clients' heads, FedAvg special case,
communication and determinism."""

import math

import numpy as np
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.algorithms.fedgen import Generator, decayed, diversity_loss, label_weights
from fedfuse.config import RunConfig, apply
from fedfuse.runner import experiment
from fedfuse.types import FitStats, Message


def _cfg(**kw) -> RunConfig:
    base = dict(
        dataset="digits", partition="dirichlet", model="mlp", clients=6, clients_per_round=3, rounds=3,
        batch_size=32, lr=0.05, seed=5, plots=False, local_epochs=1, model_options={"widths": [16]},
        partition_options={"alpha": 0.5, "min_size": 20}, algorithm="fedgen",
        algorithm_options={"hidden_dim": 32, "noise_dim": 8, "gen_epochs": 2},
    )
    base.update(kw)
    return apply(RunConfig(), base)


def test_label_weights_hand_case():
    counts = np.array([[1, 5, 1], [3, 1, 1]])  # 2 clients x 3 labels
    w, qualified = label_weights(counts)
    np.testing.assert_allclose(w[0], [0.25, 0.75])
    np.testing.assert_allclose(w[1], [5 / 6, 1 / 6])
    np.testing.assert_allclose(w.sum(axis=1), 1.0)
    assert qualified == [0, 1]  # label 2: nobody holds more than the initial count 1


def test_diversity_loss_hand_case_and_decay():
    eps = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    z = torch.tensor([[0.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    # pairs (i,j): noise mean-squared distance 1 and output mean-abs distance 2 off the diagonal, 0 on it
    assert math.isclose(float(diversity_loss(eps, z)), math.exp(-(2 * 1 * 2) / 4), rel_tol=1e-6)
    assert decayed(10.0, 0) == 10.0 and math.isclose(decayed(10.0, 2), 10 * 0.98**2)
    assert decayed(1e-3, 500) == 1e-4


def test_generator_learns_features_the_weighted_heads_classify_as_the_label():
    exp = experiment(_cfg(algorithm_options={"hidden_dim": 64, "noise_dim": 8, "gen_epochs": 40,
                                             "teacher_iters": 5, "gen_lr": 1e-2}))
    alg = exp.algo
    state = alg.init_state()
    torch.manual_seed(0)
    head_w = torch.randn(10, 16)
    results = {}
    for c in range(2):
        t = dict(state["global"])
        t["fc.weight"], t["fc.bias"] = head_w + 0.1 * torch.randn(10, 16), torch.zeros(10)
        results[c] = Message(t, {"label_counts": [5] * 10}, FitStats(num_examples=10))

    def acc(gstate):
        g = Generator(10, 16, 8, 64)
        g.load_state_dict(gstate)
        g.eval()
        y = torch.arange(10).repeat(20)
        z, _ = g(y, torch.Generator().manual_seed(1))
        return float(((z @ head_w.T).argmax(1) == y).float().mean())

    before = acc(state["generator"])
    gstate, _, diag = alg.train_generator(state, RoundInfo(0, 3), results)
    assert acc(gstate) > 0.9 > before
    assert diag["server_flops"] > 0


def test_without_generator_terms_fedgen_is_fedavg():
    opts = {"hidden_dim": 16, "noise_dim": 4, "gen_epochs": 0, "generative_alpha": 0.0, "generative_beta": 0.0}
    a = experiment(_cfg(algorithm_options=opts))
    a.run()
    b = experiment(_cfg(algorithm="fedavg", algorithm_options={}))
    b.run()
    for k, v in b.state["global"].items():
        torch.testing.assert_close(a.state["global"][k], v)


def test_fedgen_runs_deterministically_and_downloads_the_generator():
    a = experiment(_cfg())
    sa = a.run()
    sb = experiment(_cfg()).run()
    assert sa["final"]["global_accuracy"] == sb["final"]["global_accuracy"]
    model = 64 * 16 + 16 + 16 * 10 + 10
    gen = (8 + 10) * 32 + 32 + 32 * 2 + 32 * 16 + 16  # fc, bn weight/bias, out
    # + BN running mean/var (2 x 32 floats) and num_batches_tracked (one int64)
    assert a.history[0]["bytes_down"] == 3 * (4 * (model + gen + 2 * 32) + 8)
    assert a.history[0]["bytes_up"] == 3 * 4 * model
    assert a.history[-1]["generator_teacher_loss"] > 0


def test_declared_client_step_equals_eq5_computed_step_by_step():
    """The declared program (generator draws made up front, KL per sample, teacher term on refs) trains exactly
    the model of a step-by-step loop on Eq. 5 that draws the same noise and labels from the client's stream
    as it goes: ε for the batch's labels, then ŷ, then the teacher batch's ε, every step."""
    import torch.nn.functional as F

    from fedfuse.engine.client import train_local
    from fedfuse.rng import torch_generator

    exp = experiment(_cfg(local_epochs=2, momentum=0.5))
    alg, data, r = exp.algo, exp.fed.clients[1], 2
    state = alg.init_state()
    payload = Message(alg.configure_fit(state, RoundInfo(r, 3), [1])[1].tensors, {"round": r})
    prog = alg.client_program(payload, None, data)
    assert [t.name for t in prog.terms] == ["fedgen-latent", "fedgen-teacher"] and "eps1" in prog.refs
    got, _ = alg.fit(payload, None, data, torch_generator(4, 1))

    model = exp.ctx.load({k: v for k, v in payload.tensors.items() if not k.startswith("gen/")})
    g = Generator(exp.ctx.num_classes, alg.latent_dim, alg.opt.noise_dim, alg.opt.hidden_dim)
    g.load_state_dict({k[4:]: v for k, v in payload.tensors.items() if k.startswith("gen/")})
    g.eval()
    sgen = torch_generator(exp.ctx.seed, "fedgen-client", r, data.cid)
    alpha, beta = decayed(alg.opt.generative_alpha, r), decayed(alg.opt.generative_beta, r)
    bg = alg.opt.client_gen_batch

    def eq5(m, x, y, logits):
        with torch.no_grad():
            target = F.softmax(m.head(g(y, sgen)[0]), dim=1)
            ys = torch.randint(0, exp.ctx.num_classes, (bg,), generator=sgen)
            z = g(ys, sgen)[0]
        latent = beta * F.kl_div(F.log_softmax(logits, dim=1), target, reduction="batchmean")
        return bg / exp.ctx.train.batch_size * alpha * F.cross_entropy(m.head(z), ys) + latent

    def loss(m, x, y):
        logits = m(x)
        ce = F.cross_entropy(logits, y)
        return ce + eq5(m, x, y, logits), ce

    stats = train_local(model, data.train, exp.ctx.train, torch_generator(4, 1), loss=loss)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got.tensors[k], v, rtol=1e-5, atol=1e-6)
    assert got.stats.samples == stats.samples and got.stats.steps == stats.steps
    assert got.stats.flops > alg.fit_stats(model, data, stats).flops  # generator work is counted
