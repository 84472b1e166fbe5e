"""FedMR's recombination (fusion/recombine.py): the multiset invariant with BatchNorm units, untouched units stay
bit-identical, key granularity, segments, the pairwise cosine, the secure exchange's mixing."""

import math

import numpy as np
import pytest
import torch

from fedfuse.fusion.recombine import (
    any_pure,
    mean_pairwise_cosine,
    random_unit_permutations,
    recombine,
    secure_exchange,
    segment_units,
    units_from_layers,
)
from fedfuse.models import build_model
from support import random_states, source_of
from support import same_tensor as same


def bn_net():
    return build_model("resnet9", (1, 8, 8), 10, width_mult=0.25)


def test_recombine_hand_case():
    a = {"l1.w": torch.tensor([1.0]), "l2.w": torch.tensor([2.0])}
    b = {"l1.w": torch.tensor([10.0]), "l2.w": torch.tensor([20.0])}
    units = [("l1.w",), ("l2.w",)]
    out = recombine([a, b], units, np.array([[1, 0], [0, 1]]))
    assert out[0] == {"l1.w": torch.tensor([10.0]), "l2.w": torch.tensor([2.0])}
    assert out[1] == {"l1.w": torch.tensor([1.0]), "l2.w": torch.tensor([20.0])}
    with pytest.raises(ValueError):
        recombine([a, b], units, np.array([[0, 0], [0, 1]]))  # not a permutation: a unit would be lost
    with pytest.raises(ValueError):
        recombine([a, {"l1.w": torch.tensor([3.0])}], units, np.array([[0, 1], [0, 1]]))  # missing key


@pytest.mark.parametrize("k", [2, 5])
def test_multiset_invariant_with_bn_units(k):
    model = bn_net()
    units = units_from_layers([layer.keys for layer in model.layers()], "module")
    inputs = random_states(model, k, seed=k)
    perms = random_unit_permutations(len(units), k, np.random.default_rng(1))
    out = recombine(inputs, units, perms)
    for u, unit in enumerate(units):
        sources = [source_of(unit, o, inputs) for o in out]  # whole unit (BN stats incl.) from ONE model
        assert sorted(sources) == list(range(k))  # every uploaded layer used exactly once
        assert sources == [int(p) for p in perms[u]]
    for o in out:  # exactly one copy of every layer position; dtypes (int64 counters) kept
        assert list(o) == list(inputs[0])
        for key in o:
            assert o[key].dtype == inputs[0][key].dtype


def test_untrained_unit_stays_bit_identical():
    model = bn_net()
    units = units_from_layers([layer.keys for layer in model.layers()], "module")
    inputs = random_states(model, 3)
    frozen = model.state_dict()["fc.weight"].clone()  # a parameter nobody trained: identical everywhere
    for s in inputs:
        s["fc.weight"] = frozen.clone()
    out = recombine(inputs, units, random_unit_permutations(len(units), 3, np.random.default_rng(0)))
    for o in out:
        assert same(o["fc.weight"], frozen)


def test_key_granularity_splits_bn_statistics_from_affine():
    model = bn_net()
    layers = [layer.keys for layer in model.layers()]
    units = units_from_layers(layers, "key")
    assert all(len(u) == 1 for u in units) and len(units) == len(model.state_dict())
    inputs = random_states(model, 6)
    out = recombine(inputs, units, random_unit_permutations(len(units), 6, np.random.default_rng(3)))
    split = 0
    for keys in layers:
        if len(keys) > 1:
            split += len({source_of((key,), out[0], inputs) for key in keys}) > 1
    assert split > 0  # the author-code behaviour: BN stats can come from another model than its weight


def test_segments_hand_case_and_intact():
    units = [("a",), ("b",), ("c",), ("d",), ("e",)]
    assert segment_units(units, 2) == [("a", "b", "c"), ("d", "e")]
    assert segment_units(units, 5) == units
    assert segment_units(units, 1) == [("a", "b", "c", "d", "e")]
    assert segment_units(units, 0) == units
    with pytest.raises(ValueError):
        segment_units(units, 6)
    model = bn_net()
    layer_units = units_from_layers([layer.keys for layer in model.layers()])
    segs = segment_units(layer_units, 3)
    assert [k for s in segs for k in s] == [k for u in layer_units for k in u]  # contiguous, in order
    inputs = random_states(model, 4)
    out = recombine(inputs, segs, random_unit_permutations(len(segs), 4, np.random.default_rng(2)))
    for o in out:
        for seg in segs:
            source_of(seg, o, inputs)  # the whole segment comes from a single model


def test_one_segment_is_redispatch_only():
    model = bn_net()
    segs = segment_units(units_from_layers([layer.keys for layer in model.layers()]), 1)
    inputs = random_states(model, 4)
    out = recombine(inputs, segs, random_unit_permutations(1, 4, np.random.default_rng(7)))
    assert sorted(source_of(tuple(inputs[0]), o, inputs) for o in out) == [0, 1, 2, 3]


def test_mean_pairwise_cosine_hand_case():
    states = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 1.0])}, {"w": torch.tensor([1.0, 1.0])}]
    assert mean_pairwise_cosine(states, ["w"]) == pytest.approx(math.sqrt(2) / 3)
    assert mean_pairwise_cosine(states[:1], ["w"]) is None


@pytest.mark.parametrize("k,n_units", [(2, 2), (3, 2), (5, 4), (10, 5)])
def test_secure_exchange_mixes_and_preserves_multiset(k, n_units):
    for seed in range(30):
        ex = secure_exchange(k, n_units, np.random.default_rng(seed))
        for u in range(n_units):
            assert sorted(ex.sources[:, u].tolist()) == list(range(k))  # every layer used exactly once
        assert not any_pure(ex.sources)  # no client ends with a single client's model
        assert ex.passes >= 1 and len(ex.messages) > 0
        for s, r, u in ex.messages:
            assert s != r and 0 <= u < n_units
