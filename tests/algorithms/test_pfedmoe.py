"""pFedMoE: only the global expert travels, its costs show, determinism."""

import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.config import RunConfig, apply
from fedfuse.engine.loop import Experiment, strip_timing
from fedfuse.rng import torch_generator
from fedfuse.runner import experiment
from fedfuse.types import Message


def cfg_for(algorithm: str, **kw) -> RunConfig:
    base = dict(
        dataset="digits", partition="label-cluster", model="mlp", clients=6, clients_per_round=3, rounds=2,
        batch_size=32, lr=0.1, local_epochs=1, seed=7, out=None, plots=False, algorithm=algorithm,
        model_options={"widths": [16]}, partition_options={"clusters": 3},
    )
    base.update(kw)
    return apply(RunConfig(), base)


def nparams(exp: Experiment) -> int:
    return sum(p.numel() for p in exp.ctx.model().parameters())


def nbytes(exp: Experiment) -> int:
    return sum(t.numel() * t.element_size() for t in exp.ctx.model().state_dict().values())


def test_pfedmoe_only_the_global_expert_travels_and_costs_show():
    exp = experiment(cfg_for("pfedmoe"))
    algo = exp.algo
    state = algo.init_state()
    head = set(exp.ctx.model().head_keys())
    assert set(state["expert"]) == set(exp.ctx.model().state_dict()) - head
    p = algo.configure_fit(state, RoundInfo(0, 1), [0])[0]
    res, cs = algo.fit(p, None, exp.fed.clients[0], torch_generator(0, 0))
    assert set(res.tensors) == set(state["expert"]) and res.nbytes == p.nbytes
    extractor = nparams(exp) - sum(v.numel() for k, v in exp.ctx.model().named_parameters() if k in head)
    gate = (64 + 1) * 2  # linear gate on the flattened 8x8 digit
    assert res.stats.trained_params == 2 * extractor + (nparams(exp) - extractor) + gate
    assert set(cs) == {"local", "gate"}
    assert not torch.equal(cs["local"]["fc.weight"], algo._local_init(0)["local"]["fc.weight"])  # trained
    fa = experiment(cfg_for("fedavg"))
    fa_res = fa.algo.fit(Message(fa.algo.init_state()["global"]), None, fa.fed.clients[0], torch_generator(0, 0))[0]
    assert res.stats.flops > fa_res.stats.flops
    new = algo.aggregate_fit(state, RoundInfo(0, 1), {0: res})
    assert all(torch.equal(new["expert"][k], res.tensors[k]) for k in res.tensors)
    assert algo.server_parameters(new) == extractor


@pytest.mark.parametrize("algorithm", ["pfedmoe"])
def test_same_seed_identical_metrics(algorithm):
    a = experiment(cfg_for(algorithm))
    a.run()
    b = experiment(cfg_for(algorithm), fed=a.fed)
    b.run()
    assert [strip_timing(h) for h in a.history] == [strip_timing(h) for h in b.history]
    assert a.history[-1]["personal_accuracy"] is not None
