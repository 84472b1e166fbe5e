"""IFCA: the cluster a client picks, untouched clusters keeping their model, uniform vs sample weighting,
determinism."""

import pytest
import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.algorithms.ifca import pack, per_sample_losses, pick_cluster, unpack
from fedfuse.fusion.average import weighted_average
from fedfuse.rng import torch_generator
from fedfuse.runner import experiment
from support import check_same_seed_same_run, nbytes
from support import mixture_cfg as cfg_for


def test_ifca_picks_the_lowest_loss_cluster_and_untouched_clusters_keep_their_model():
    exp = experiment(cfg_for("ifca", algorithm_options={"k": 3}))
    algo, data = exp.algo, exp.fed.clients[2]
    state = algo.init_state()
    # make cluster 1 the obvious choice: a head bias that favours the client's own labels
    state["models"][1]["fc.bias"] = torch.full_like(state["models"][1]["fc.bias"], -5.0)
    state["models"][1]["fc.bias"][data.train.y.unique()] = 5.0
    losses = [float(per_sample_losses(exp.ctx.load(s), data.train).mean()) for s in state["models"]]
    assert pick_cluster(losses) == 1
    payload = algo.configure_fit(state, RoundInfo(0, 1), [2])[2]
    assert payload.nbytes == 3 * nbytes(exp)  # all K models go down
    res, _ = algo.fit(payload, None, data, torch_generator(0, 2))
    assert res.meta["cluster"] == 1 and res.meta["cluster_losses"] == pytest.approx(losses)
    assert res.nbytes == nbytes(exp)  # one model comes back
    new = algo.aggregate_fit(state, RoundInfo(0, 1), {2: res})
    for j in (0, 2):
        for k, v in state["models"][j].items():
            assert torch.equal(new["models"][j][k], v)
    for k, v in res.tensors.items():
        assert torch.equal(new["models"][1][k], v)
    assert new["assign"][2] == 1 and pick_cluster([0.3, 0.1, 0.1]) == 1  # ties → lowest index
    packed = pack(state["models"])
    assert all(torch.equal(a[k], b[k]) for a, b in zip(unpack(packed, 3), state["models"]) for k in a)


def test_ifca_uniform_vs_sample_weighting():
    for weighting in ("uniform", "samples"):
        exp = experiment(cfg_for("ifca", algorithm_options={"k": 1, "weighting": weighting}))
        algo = exp.algo
        state = algo.init_state()
        p = algo.configure_fit(state, RoundInfo(0, 1), [0, 3])
        res = {c: algo.fit(p[c], None, exp.fed.clients[c], torch_generator(0, c))[0] for c in (0, 3)}
        new = algo.aggregate_fit(state, RoundInfo(0, 1), res)
        w = [1.0, 1.0] if weighting == "uniform" else [res[c].stats.num_examples for c in (0, 3)]
        expect = weighted_average([res[0].tensors, res[3].tensors], w)
        torch.testing.assert_close(new["models"][0]["fc.weight"], expect["fc.weight"])


@pytest.mark.parametrize("algorithm", ["ifca"])
def test_same_seed_identical_metrics(algorithm):
    check_same_seed_same_run(cfg_for(algorithm), "personal_accuracy")
