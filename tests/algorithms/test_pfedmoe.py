"""pFedMoE: only the global expert travels, its costs show, determinism."""

import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.rng import torch_generator
from fedfuse.runner import experiment
from fedfuse.types import Message
from support import check_same_seed_same_run, nparams
from support import mixture_cfg as cfg_for


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
    check_same_seed_same_run(cfg_for(algorithm), "personal_accuracy")
