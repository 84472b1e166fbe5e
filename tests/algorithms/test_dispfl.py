"""Dis-PFL: sparse aggregation, ERK densities, prune-and-regrow mask updates, bytes as values plus bitmap, the
dense static case equal to D-PSGD."""

import numpy as np
import torch

from fedfuse.algorithms.dispfl import (
    erk_densities,
    pack_mask,
    prune_and_regrow,
    sparse_average,
    unpack_mask,
)
from fedfuse.runner import experiment
from support import peer_cfg


def test_sparse_average_hand_case():
    own_mask = {"w": torch.tensor([1.0, 1.0, 0.0, 1.0])}
    models = {
        0: {"w": torch.tensor([2.0, 4.0, 0.0, 6.0]), "bn": torch.tensor([1.0]), "nbt": torch.tensor(2)},
        1: {"w": torch.tensor([0.0, 8.0, 5.0, 0.0]), "bn": torch.tensor([3.0]), "nbt": torch.tensor(5)},
    }
    masks = {0: {"w": torch.tensor([1.0, 1.0, 0.0, 1.0])}, 1: {"w": torch.tensor([0.0, 1.0, 1.0, 0.0])}}
    out = sparse_average(0, models, masks, own_mask)
    # element 0: only 0 holds it -> 2; element 1: (4 + 8)/2; element 2: 1 holds it but 0's mask drops it; 3: 6
    torch.testing.assert_close(out["w"], torch.tensor([2.0, 6.0, 0.0, 6.0]))
    torch.testing.assert_close(out["bn"], torch.tensor([2.0]))
    assert int(out["nbt"]) == 5


def test_erk_densities_keep_the_overall_density():
    shapes = {"conv": (16, 3, 3, 3), "fc1": (120, 400), "fc1.b": (120,), "fc": (10, 84)}
    for d in (0.2, 0.5, 0.8):
        dens = erk_densities(shapes, d)
        total = sum(np.prod(s) for s in shapes.values())
        kept = sum(dens[k] * np.prod(s) for k, s in shapes.items())
        assert abs(kept / total - d) < 1e-9
        assert all(0 < v <= 1 for v in dens.values())
        assert dens["fc1.b"] == 1.0 and dens["fc1"] < d  # small tensors dense, large ones sparser


def test_prune_and_regrow_keeps_density_drops_smallest_grows_largest_gradient():
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    w = torch.tensor([0.1, -5.0, 0.01, 0.0, 0.0, 2.0])
    g = torch.tensor([0.0, 0.0, 0.0, 0.3, 0.9, 0.0])
    new = prune_and_regrow(mask, w, g, rate=0.5)  # ceil(0.5 * 4) = 2 dropped: |0.01| and |0.1|
    torch.testing.assert_close(new, torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 1.0]))  # regrown: largest |g|
    m = (torch.rand(1000) < 0.3).float()
    torch.testing.assert_close(unpack_mask(pack_mask(m), (1000,)), m)
    assert pack_mask(m).numel() == 125


def test_dispfl_models_stay_on_their_masks_and_bytes_are_values_plus_bitmap():
    exp = experiment(peer_cfg(algorithm="dispfl", rounds=2, algorithm_options={"static": True}))
    exp.run()
    alg = exp.algo
    nnz_total = 0
    for c in range(5):
        st = exp.client_states[c]
        for k, m in st["mask"].items():
            assert (st["model"][k][m == 0] == 0).all()
        nnz = int(sum(float(m.sum()) for m in st["mask"].values()))
        assert abs(nnz / alg.numel - 0.5) < 0.01
        nnz_total += nnz
    # masks differ between participants (personalised)
    assert not torch.equal(exp.client_states[0]["mask"]["fc.weight"], exp.client_states[1]["mask"]["fc.weight"])
    bitmap = sum((int(np.prod(s)) + 7) // 8 for s in alg.shapes.values())
    assert exp.history[0]["bytes_peer"] == 2 * (4 * nnz_total + 5 * bitmap)


def test_dense_static_dispfl_is_dpsgd_with_uniform_mixing():
    opts = {"dense_ratio": 1.0, "static": True, "lr_decay": 1.0}
    a = experiment(peer_cfg(algorithm="dispfl", algorithm_options=opts))
    a.run()
    b = experiment(peer_cfg(algorithm="dpsgd", algorithm_options={"mixing": "uniform"}))
    b.run()
    for c in range(5):
        for k, v in b.client_states[c]["model"].items():
            torch.testing.assert_close(a.client_states[c]["model"][k], v, rtol=1e-5, atol=1e-6)


def test_dispfl_mask_update_changes_masks_but_keeps_density():
    exp = experiment(peer_cfg(algorithm="dispfl", rounds=2))
    exp.run()
    st = exp.client_states[0]
    init = exp.algo.initial_mask(0)
    changed = sum(int((st["mask"][k] != init[k]).sum()) for k in init)
    assert changed > 0
    for k in init:
        assert int(st["mask"][k].sum()) == int(init[k].sum())
