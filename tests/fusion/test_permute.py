"""Permutation utilities: a permuted network computes the same function; scatter_units/gather are inverse maps."""

import numpy as np
import pytest
import torch

from fedfuse.fusion.permute import (
    chain_spec,
    gather,
    head_structured,
    permute,
    permute_all,
    random_group_permutations,
    scatter_units,
    transformer_spec,
)
from fedfuse.models import build_model, width_options
from support import randomise_bn


def _randomise_bn(model: torch.nn.Module, gen: torch.Generator) -> None:
    randomise_bn(model, gen, tracked=7)


CHAINS = [
    ("mlp", (64,), {"widths": [16, 12, 8]}),
    ("simple-mlp", (784,), {}),
    ("cnn", (1, 8, 8), {"channels": [4, 6], "hidden": 10}),
    ("cnn-cifar", (3, 16, 16), {"channels": [3, 5], "hidden": [12, 7]}),
    ("vgg16-bn", (3, 32, 32), {"width_mult": 0.0625, "fc_hidden": [7]}),
]


@pytest.mark.parametrize("name,shape,opts", CHAINS, ids=[c[0] for c in CHAINS])
def test_permuted_chain_computes_the_same_function(name, shape, opts):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = build_model(name, shape, 10, **opts)
    _randomise_bn(model, gen)
    model.eval()
    x = torch.randn(6, *shape, generator=gen)
    ref = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    spec = chain_spec(model)
    perms = random_group_permutations(spec, gen)
    assert any((p != np.arange(len(p))).any() for p in perms.values())
    permuted = permute_all(state, spec, perms)
    assert any(not torch.equal(permuted[k], state[k]) for k in state)
    model.load_state_dict(permuted)
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    if name == "vgg16-bn":  # BN statistics moved with their channels; the batch counter is untouched
        g0 = spec[0]
        bn = next(m.key for m in g0.members if m.key.endswith("running_mean"))
        assert torch.equal(permuted[bn], state[bn][torch.as_tensor(perms[g0.name])])
        assert all(int(permuted[k]) == 7 for k in permuted if k.endswith("num_batches_tracked"))


@pytest.mark.parametrize("n_heads,norm_first,n_layers", [(1, False, 1), (2, False, 2), (4, True, 1)])
def test_permuted_transformer_computes_the_same_function(n_heads, norm_first, n_layers):
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model = build_model("transformer", (12,), 40, task="lm", d_model=16, n_heads=n_heads, n_layers=n_layers,
                        d_ff=24, dropout=0.0, norm_first=norm_first, persistent_pe=True)
    with torch.no_grad():  # non-trivial LayerNorm affine parameters and biases
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    model.eval()
    x = torch.randint(0, 40, (3, 12), generator=gen)
    ref = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    spec = transformer_spec(model)
    assert spec[0].name == "residual"
    perms = random_group_permutations(spec, gen)
    model.load_state_dict(permute_all(state, spec, perms))
    torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-5)
    # Q/K and V of a block must share the head order: a different head order for V changes the output
    if n_heads > 1:
        hd = 16 // n_heads
        swap = head_structured([1, 0, *range(2, n_heads)], [np.arange(hd)] * n_heads, hd)
        vgroup = next(g for g in spec if g.name.endswith(".v"))
        model.load_state_dict(permute(state, vgroup, swap))
        assert not torch.allclose(model(x), ref, atol=1e-4)


def test_residual_permutation_needs_persistent_positions():
    model = build_model("transformer", (8,), 20, task="lm", d_model=8, n_heads=1, n_layers=1, d_ff=8)
    assert all(g.name != "residual" for g in transformer_spec(model))
    with pytest.raises(ValueError, match="persistent_pe"):
        transformer_spec(model, residual=True)


def test_expand_then_gather_is_identity_and_fills_absent_units():
    torch.manual_seed(2)
    model = build_model("vgg16-bn", (3, 32, 32), 10, width_mult=0.0625)
    _randomise_bn(model, torch.Generator().manual_seed(3))
    state = model.state_dict()
    g = chain_spec(model)[0]  # 4 channels: conv weight/bias, BN affine and stats, next conv input
    assign = [5, 0, 3, 6]
    big = scatter_units(state, g, assign, 8)
    for m in g.members:
        assert big[m.key].shape[m.axis] == 8 * m.block
    rv = next(m.key for m in g.members if m.key.endswith("running_var"))
    rm = next(m.key for m in g.members if m.key.endswith("running_mean"))
    absent = [1, 2, 4, 7]
    assert torch.all(big[rv][absent] == 1) and torch.all(big[rm][absent] == 0)
    assert torch.all(big[g.members[0].key][absent] == 0)
    back = gather(big, g, assign)
    for k in state:
        assert torch.equal(back[k], state[k]), k
    with pytest.raises(ValueError):
        scatter_units(state, g, [0, 0, 1, 2], 8)


def test_conv_to_linear_block_patching():
    model = build_model("cnn", (1, 8, 8), 10, channels=[2, 3], hidden=5)
    g = chain_spec(model)[1]  # conv2 (3 channels) -> fc1 with 2x2 positions per channel
    out = next(m for m in g.members if m.role == "out")
    assert out.key == "fc1.weight" and out.block == 4
    state = model.state_dict()
    big = scatter_units(state, g, [2, 0, 4], 5, roles=("out",))
    assert big["fc1.weight"].shape == (5, 20)
    assert torch.equal(big["fc1.weight"][:, 8:12], state["fc1.weight"][:, 0:4])  # channel 0 -> slot 2
    assert torch.equal(big["fc1.weight"][:, 4:8], torch.zeros(5, 4))  # slot 1 is nobody's
    assert big["conv2.weight"].shape == state["conv2.weight"].shape  # "in" members untouched


def test_width_options_rebuild_models():
    assert width_options("simple-mlp", [21, 100, 130, 84]) == {"widths": [21, 100, 130, 84]}
    opts = width_options("cnn", [5, 7, 9])
    m = build_model("cnn", (1, 8, 8), 10, **opts)
    assert [g.size for g in chain_spec(m)] == [5, 7, 9]
    with pytest.raises(ValueError):
        width_options("resnet9", [1, 2])
