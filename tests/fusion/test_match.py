"""Matching (fusion/match.py): Hungarian permutation recovery, whole networks with BatchNorm statistics, matched
running statistics, class-weighted heads, one client."""


import numpy as np
import pytest
import torch

from fedfuse.fusion.match import class_weighted_average, hungarian, match_group, match_network
from fedfuse.fusion.permute import (
    chain_spec,
    permute_all,
    random_group_permutations,
)
from fedfuse.models import build_model
from support import randomise_bn


@pytest.mark.parametrize("metric", ["l1", "l2"])
def test_hungarian_recovers_a_permutation(metric):
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(50, 13))
    perm = rng.permutation(50)
    assert np.array_equal(hungarian(ref, ref[perm], metric)[perm], np.arange(50))
    other = ref[perm]
    assert np.array_equal(other[hungarian(ref, other, metric)], ref)


def _tiny_bn_net(seed: int):
    torch.manual_seed(seed)
    model = build_model("vgg16-bn", (3, 32, 32), 10, width_mult=0.0625)
    randomise_bn(model, torch.Generator().manual_seed(seed), tracked=3 + seed)
    return model


@pytest.mark.parametrize("method", ["hungarian", "bbp"])
def test_match_network_recovers_permuted_copies_with_batchnorm(method):
    model = _tiny_bn_net(0)
    state = model.state_dict()
    spec = chain_spec(model)
    perms = random_group_permutations(spec, torch.Generator().manual_seed(4))
    other = permute_all(state, spec, perms)
    other["body.1.num_batches_tracked"] = torch.tensor(11)
    glob, sizes, assigns = match_network(
        [state, other], spec, model.head_keys(), class_counts=[[3] * 10, [1] * 10], method=method,
        estimator="mean", sigma=0.01, sigma0=0.01,
    )
    assert sizes == [g.size for g in spec]
    for g, a in zip(spec, assigns):
        assert np.array_equal(a[1], perms[g.name])
    for k, v in state.items():
        if k == "body.1.num_batches_tracked":
            assert int(glob[k]) == 11  # integer counter: maximum over clients
        else:
            torch.testing.assert_close(glob[k], v, rtol=1e-6, atol=1e-6)


def test_match_group_running_statistics_are_weighted_averages_of_matched_units():
    model = _tiny_bn_net(1)
    a = model.state_dict()
    b = {k: v.clone() for k, v in a.items()}
    b["body.1.running_mean"] = a["body.1.running_mean"] + 4.0
    b["body.1.running_var"] = a["body.1.running_var"] * 3.0
    g = chain_spec(model)[0]
    gm = match_group([a, b], g, method="hungarian", weights=[1.0, 3.0])
    torch.testing.assert_close(gm.tensors["body.1.running_mean"], a["body.1.running_mean"] + 3.0)
    torch.testing.assert_close(gm.tensors["body.1.running_var"], a["body.1.running_var"] * 2.5)
    # a grown global unit matched by one client only carries that client's statistics
    far = {k: v.clone() for k, v in a.items()}
    far["body.0.weight"] = -a["body.0.weight"] * 50  # dissimilar atoms -> new global units
    gm = match_group([a, far], g, method="bbp", estimator="mean", iters=0)
    assert gm.size > g.size
    only_far = sorted(set(gm.assign[1].tolist()) - set(gm.assign[0].tolist()))
    local = [int(np.where(gm.assign[1] == i)[0][0]) for i in only_far]
    torch.testing.assert_close(gm.tensors["body.1.running_var"][only_far], far["body.1.running_var"][local])


def test_class_weighted_last_layer_hand_computed():
    w1 = {"fc.weight": torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]),
          "fc.bias": torch.tensor([1.0, 1, 1, 1])}
    w2 = {"fc.weight": torch.tensor([[3.0, 2.0], [9.0, 9.0], [1.0, 2.0], [-1.0, 0.0]]),
          "fc.bias": torch.tensor([3.0, 3, 3, 3])}
    counts = [[2, 0, 1, 0], [2, 4, 3, 0]]  # class 3: nobody -> fallback weights 1:3
    out = class_weighted_average([w1, w2], ["fc.weight", "fc.bias"], counts, fallback=[1.0, 3.0])
    want_w = torch.tensor([[2.0, 2.0], [9.0, 9.0], [0.25 * 5 + 0.75 * 1, 0.25 * 6 + 0.75 * 2], [0.25 * 7 - 0.75, 2.0]])
    want_b = torch.tensor([2.0, 3.0, 0.25 + 2.25, 0.25 + 2.25])
    torch.testing.assert_close(out["fc.weight"], want_w)
    torch.testing.assert_close(out["fc.bias"], want_b)


def test_one_client_matching_returns_that_client():
    torch.manual_seed(5)
    model = build_model("mlp", (20,), 4, widths=[9, 7])
    state = model.state_dict()
    glob, sizes, _ = match_network([state], chain_spec(model), model.head_keys(), class_counts=[[1, 0, 2, 5]],
                                   estimator="mean")
    assert sizes == [9, 7]
    for k in state:
        torch.testing.assert_close(glob[k], state[k], rtol=0, atol=1e-7)
