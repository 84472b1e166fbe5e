"""Width slicing: DSS index sets (Eq. 4), coverage and overlap, real sub-models, write-back, holder averaging."""

import pytest
import torch

from fedfuse.engine.client import train_flops_per_sample
from fedfuse.fusion.slicing import (
    _positions,
    accumulate,
    combine,
    dim_indices,
    dim_positions,
    dss_indices,
    group_positions,
    load_submodel,
    overlap_fraction,
    overlap_part,
    param_count,
    rolling_indices,
    slice_spec,
    slice_state,
    static_indices,
    write_back,
    zero_unselected,
)
from fedfuse.models import build_model

MODELS = [
    ("mlp", (20,), {"widths": [12, 10]}, "classification"),
    ("cnn", (1, 8, 8), {"channels": [6, 8], "hidden": 16}, "classification"),
    ("cnn-cifar", (3, 12, 12), {"channels": [6, 8], "hidden": [12, 10]}, "classification"),
    ("cnn-femnist", (1, 12, 12), {"channels": [6, 8], "hidden": 16}, "classification"),
    ("resnet18", (3, 8, 8), {"width_mult": 0.0625}, "classification"),
    ("resnet18", (3, 8, 8), {"width_mult": 0.0625, "norm": "bn-static"}, "classification"),
    ("transformer", (6,), {"vocab_size": 30, "d_model": 8, "n_heads": 2, "d_ff": 12, "dropout": 0.0}, "lm"),
]


def make(name, shape, opts, task, seed=0):
    torch.manual_seed(seed)
    m = build_model(name, shape, 30 if task == "lm" else 5, task=task, **opts)
    st = {}
    for k, v in m.state_dict().items():  # non-trivial BN statistics so their slicing is exercised
        if k.endswith("running_var"):
            v = 0.5 + torch.rand_like(v)
        elif k.endswith("running_mean") or (v.is_floating_point() and "bn" in k):
            v = v + 0.2 * torch.randn_like(v)
        elif k.endswith("num_batches_tracked"):
            v = torch.tensor(7)
        st[k] = v
    m.load_state_dict(st)
    return m


def inputs(name, shape, task):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 30, (3, *shape), generator=g) if task == "lm" else torch.randn(3, *shape, generator=g)


# ---- Eq. 4 ---------------------------------------------------------------------------------------------
def test_dss_matches_eq4_by_hand():
    # K=8, N=4, c=1 -> G=2; mu=0.5 -> 4 units
    assert dss_indices(8, 0.5, 0, 4, 1.0, 0).tolist() == [0, 1, 2, 3]
    assert dss_indices(8, 0.5, 1, 4, 1.0, 0).tolist() == [2, 3, 4, 5]
    assert dss_indices(8, 0.5, 3, 4, 1.0, 0).tolist() == [6, 7, 0, 1]  # wrap-around branch of Eq. 4
    assert dss_indices(8, 0.5, 2, 4, 1.0, 3).tolist() == [7, 0, 1, 2]  # 2*2 + 3*zeta = 7
    assert dss_indices(8, 0.5, 0, 4, 1.0, 8).tolist() == [0, 1, 2, 3]  # start wraps modulo K
    # K=10, N=4, c=0.5 -> G=1.25; n=3 starts at floor(3.75)=3; floor(0.25*10)=2 units
    assert dss_indices(10, 0.25, 3, 4, 0.5, 0).tolist() == [3, 4]
    assert dss_indices(10, 0.25, 3, 4, 0.5, 6).tolist() == [9, 0]
    assert dss_indices(8, 0.5, 1, 4, 1.0, 0, zeta=2).tolist() == [2, 3, 4, 5]
    assert dss_indices(8, 0.5, 1, 4, 1.0, 1, zeta=2).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("k,mu,num", [(60, 0.1, 10), (16, 0.25, 4), (128, 0.125, 8), (10, 0.3, 5), (7, 0.5, 3),
                                      (200, 0.25, 10)])
def test_union_covers_every_unit_when_mu_n_at_least_one(k, mu, num):
    assert mu * num >= 1 and int(mu * k) >= -(-k // num)  # the integer form of muN >= 1: floor(mu K) >= ceil(K/N)
    for r in range(0, 3 * k, 5):
        held = torch.zeros(k, dtype=torch.bool)
        for n in range(num):
            held[dss_indices(k, mu, n, num, 1.0, r)] = True
        assert held.all(), (k, mu, num, r)


def test_coverage_gap_from_rounding():
    """muN = 1 but floor(0.1*64) * 10 = 60 < 64: Eq. 4's floor leaves 4 units of a 64-unit layer untrained each
    round (the paper's coverage claim ignores rounding); the inter-round shift still reaches them later."""
    held = torch.zeros(64, dtype=torch.bool)
    for n in range(10):
        held[dss_indices(64, 0.1, n, 10, 1.0, 0)] = True
    assert int(held.sum()) == 60
    ever = torch.zeros(64, dtype=torch.bool)
    for r in range(8):
        for n in range(10):
            ever[dss_indices(64, 0.1, n, 10, 1.0, r)] = True
    assert ever.all()


@pytest.mark.parametrize("k,mu,num,c", [(40, 0.5, 10, 1.0), (40, 0.5, 10, 0.5), (80, 0.25, 10, 1.0),
                                        (64, 0.5, 8, 0.25), (128, 0.25, 8, 1.0)])
def test_adjacent_overlap_is_one_minus_c_over_mu_n(k, mu, num, c):
    expected = 1 - c / (mu * num)
    for r in (0, 3, 17):
        for n in range(num - 1):
            a = dss_indices(k, mu, n, num, c, r)
            b = dss_indices(k, mu, n + 1, num, c, r)
            assert overlap_fraction(a, b) == pytest.approx(expected)


def test_static_and_rolling_indices():
    assert static_indices(10, 0.25).tolist() == [0, 1, 2]  # ceil(2.5)
    assert rolling_indices(5, 0.4, 0).tolist() == [0, 1]
    assert rolling_indices(5, 0.4, 1).tolist() == [4, 0]  # roll(arange(5), 1)[:2]
    assert rolling_indices(5, 0.4, 7).tolist() == torch.roll(torch.arange(5), 2)[:2].tolist()


# ---- sub-models --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,shape,opts,task", MODELS)
def test_submodel_forward_equals_zeroed_full_model(name, shape, opts, task):
    m = make(name, shape, opts, task)
    spec = slice_spec(m)
    full = {k: v.clone() for k, v in m.state_dict().items()}
    sel = {g: dss_indices(k, 0.5, 3, 4, 1.0, 5) for g, k in spec.groups.items()}
    if task == "lm":  # attention uses 1/sqrt(head width): the identity holds for feed-forward slicing only
        sel = {g: (torch.arange(spec.groups[g]) if g.endswith("attn") else v) for g, v in sel.items()}
    sub = load_submodel(m, spec, slice_state(full, spec, sel), sel, tag="test")
    assert param_count(sub) < param_count(m)
    x = inputs(name, shape, task)
    m.load_state_dict(zero_unselected(full, spec, sel))
    m.eval()
    sub.eval()
    with torch.no_grad():
        torch.testing.assert_close(sub(x), m(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,shape,opts,task", MODELS)
def test_submodel_shrinks_flops_and_writes_back(name, shape, opts, task):
    m = make(name, shape, opts, task)
    spec = slice_spec(m)
    full = {k: v.clone() for k, v in m.state_dict().items()}
    sel = {g: dss_indices(k, 0.25, 1, 4, 1.0, 2) for g, k in spec.groups.items()}
    sub_state = slice_state(full, spec, sel)
    sub = load_submodel(m, spec, sub_state, sel, tag="flops")
    x = inputs(name, shape, task)
    y = torch.zeros(x.shape[:2] if task == "lm" else x.shape[:1], dtype=torch.long)
    assert train_flops_per_sample(sub, x, y, key=("s",)) < 0.6 * train_flops_per_sample(m, x, y, key=("f",))
    # untrained slice: write-back is the identity
    back = write_back(full, sub_state, spec, sel)
    for k in full:
        assert torch.equal(back[k], full[k]), k
    # a changed slice changes exactly the selected elements
    changed = {k: (v + 1 if v.is_floating_point() else v) for k, v in sub_state.items()}
    back = write_back(full, changed, spec, sel)
    back_sliced = slice_state(back, spec, sel)
    for k, v in full.items():
        if not v.is_floating_point() or not v.dim():
            continue
        assert int((back[k] != v).sum()) == changed[k].numel(), k
        assert torch.equal(back_sliced[k], changed[k])


def test_resnet_residual_stream_shares_one_group():
    m = make("resnet18", (3, 8, 8), {"width_mult": 0.125}, "classification")
    spec = slice_spec(m)
    d = spec.dims
    assert d["layer1.0.conv2.weight"][0] == d["conv1.weight"][0] == d["layer1.1.conv2.weight"][0]
    assert d["layer2.0.shortcut.0.weight"][0] == d["layer2.1.conv2.weight"][0]
    assert d["layer2.0.shortcut.0.weight"][1] == d["layer1.1.conv2.weight"][0]
    assert d["fc.weight"][0] is None and d["conv1.weight"][1] is None  # input and output layers never split
    assert d["layer1.0.bn1.num_batches_tracked"] == ()


# ---- holder averaging ----------------------------------------------------------------------------------------
def test_combine_averages_over_holders_and_keeps_unheld():
    m = make("mlp", (3,), {"widths": [4]}, "classification")
    spec = slice_spec(m)
    base = {k: torch.zeros_like(v) for k, v in m.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in base.items()}
    s1 = {"hidden.0": torch.tensor([0, 1])}
    s2 = {"hidden.0": torch.tensor([1, 2])}
    a = {k: torch.full_like(v, 2.0) for k, v in slice_state(base, spec, s1).items()}
    b = {k: torch.full_like(v, 4.0) for k, v in slice_state(base, spec, s2).items()}
    base["hidden.0.bias"][3] = 9.0
    out, cnt = combine(base, spec.full_selection(), spec, shapes, [(a, s1), (b, s2)])
    assert out["hidden.0.bias"].tolist() == [2.0, 3.0, 4.0, 9.0]  # unit 3: nobody -> keeps its value
    assert cnt["hidden.0.bias"].tolist() == [1, 2, 1, 0]
    assert out["fc.weight"][:, 1].tolist() == [3.0] * 5 and out["fc.weight"][:, 3].tolist() == [0.0] * 5
    assert out["fc.bias"].tolist() == [3.0] * 5  # unsplit: everyone holds it
    # label split: client a only has classes 0 and 2 -> rows 1, 3, 4 come from b only
    restrict = [{"fc.weight": [torch.tensor([0, 2]), None], "fc.bias": [torch.tensor([0, 2])]}, None]
    out, _ = combine(base, spec.full_selection(), spec, shapes, [(a, s1), (b, s2)], restrict)
    assert out["fc.bias"].tolist() == [3.0, 4.0, 3.0, 4.0, 4.0]


def test_combine_bn_buffers_and_num_batches_tracked():
    m = make("resnet18", (3, 8, 8), {"width_mult": 0.0625}, "classification")  # stem 4 channels
    spec = slice_spec(m)
    full = {k: v.clone() for k, v in m.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in full.items()}
    s1 = {g: torch.arange(k)[:2] for g, k in spec.groups.items()}
    s2 = {g: torch.arange(k)[1:3] for g, k in spec.groups.items()}
    a = slice_state(full, spec, s1)
    b = slice_state(full, spec, s2)
    a["bn1.running_mean"] = torch.tensor([1.0, 3.0])
    b["bn1.running_mean"] = torch.tensor([5.0, 7.0])
    a["bn1.num_batches_tracked"] = torch.tensor(3)
    b["bn1.num_batches_tracked"] = torch.tensor(11)
    out, _ = combine(full, spec.full_selection(), spec, shapes, [(a, s1), (b, s2)])
    rm = out["bn1.running_mean"]
    assert rm[:3].tolist() == [1.0, 4.0, 7.0] and rm[3] == full["bn1.running_mean"][3]
    assert out["bn1.num_batches_tracked"].item() == 11 and out["bn1.num_batches_tracked"].dtype == torch.long


def test_overlap_part_sends_only_common_elements():
    m = make("cnn", (1, 8, 8), {"channels": [4, 6], "hidden": 8}, "classification")
    spec = slice_spec(m)
    full = m.state_dict()
    shapes = {k: tuple(v.shape) for k, v in full.items()}
    a = {"conv1": torch.tensor([0, 1, 2]), "conv2": torch.tensor([4, 5, 0]), "fc1": torch.tensor([1, 2, 3, 4])}
    b = {"conv1": torch.tensor([2, 3, 0]), "conv2": torch.tensor([5, 1, 2]), "fc1": torch.tensor([7, 0, 1])}
    part = overlap_part(slice_state(full, spec, a), a, b, spec, shapes)
    assert part["conv1.weight"].shape[0] == 2 and part["conv2.weight"].shape[:2] == (1, 2)
    common = {"conv1": torch.tensor([0, 2]), "conv2": torch.tensor([5]), "fc1": torch.tensor([1])}
    assert torch.equal(part["conv2.weight"], full["conv2.weight"][5][[0, 2]].unsqueeze(0))
    hw = full["fc1.weight"].shape[1] // 6
    assert part["fc1.weight"].shape == (1, hw)
    assert torch.equal(part["fc1.weight"][0], full["fc1.weight"][1, 5 * hw: 6 * hw])
    assert set(part) == set(full) and common  # every tensor has a common part here


def _random_selection(spec, g):
    """A random subset of every group's units, in a random order (DSS windows wrap, so order matters)."""
    out = {}
    for name, k in spec.groups.items():
        n = int(torch.randint(1, k + 1, (1,), generator=g))
        out[name] = torch.randperm(k, generator=g)[:n]
    return out


@pytest.mark.parametrize("name,shape,opts,task", MODELS)
def test_group_positions_equal_the_per_dimension_index_matching(name, shape, opts, task):
    # the fast path (positions per unit group, expanded per dimension) against _positions of the global index
    # lists of every dimension, and combine() against the generic accumulate() it replaces
    m = make(name, shape, opts, task)
    spec = slice_spec(m)
    full = m.state_dict()
    shapes = {k: tuple(v.shape) for k, v in full.items()}
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        src, tgt = _random_selection(spec, g), _random_selection(spec, g)
        gpos = group_positions(spec, src, tgt)
        for key, shape_k in shapes.items():
            spos, tpos = dim_positions(spec, key, gpos, src, tgt)
            ref = [_positions(a, b, n) for a, b, n in zip(dim_indices(spec, src, key, shape_k),
                                                          dim_indices(spec, tgt, key, shape_k), shape_k)]
            for d, (rs, rt) in enumerate(ref):
                fs = torch.arange(rs.numel()) if spos[d] is None else spos[d]
                ft = torch.arange(rt.numel()) if tpos[d] is None else tpos[d]
                assert torch.equal(fs, rs) and torch.equal(ft, rt), (key, d)
        sources = [(slice_state({k: v + j for k, v in full.items()}, spec, sel), sel)
                   for j, sel in enumerate([src, _random_selection(spec, g)])]
        base = slice_state(full, spec, tgt)
        out, cnt = combine(base, tgt, spec, shapes, sources)
        for key, b in base.items():
            total = torch.zeros(b.shape, dtype=torch.float64 if b.is_floating_point() else b.dtype)
            c = torch.zeros(b.shape, dtype=torch.long)
            for st, sel in sources:
                accumulate(total, c, st[key], dim_indices(spec, sel, key, shapes[key]),
                           dim_indices(spec, tgt, key, shapes[key]), shapes[key])
            assert torch.equal(c, cnt[key]), key
            want = (torch.where(c > 0, (total / c.clamp_min(1)).to(b.dtype), b) if b.is_floating_point()
                    else torch.where(c > 0, total, b))
            assert torch.equal(out[key], want), key
