"""Simple-FedMA's alignment (fusion/align.py): a permuted transformer is aligned back to the reference."""


import pytest
import torch

from fedfuse.fusion.align import align_to
from fedfuse.fusion.permute import (
    permute_all,
    random_group_permutations,
    transformer_spec,
)
from fedfuse.models import build_model


@pytest.mark.parametrize("n_heads", [1, 2])
def test_simple_fedma_alignment_recovers_a_permuted_transformer(n_heads):
    torch.manual_seed(6)
    model = build_model("transformer", (10,), 30, task="lm", d_model=8, n_heads=n_heads, n_layers=2, d_ff=12,
                        dropout=0.0, persistent_pe=True)
    state = model.state_dict()
    spec = transformer_spec(model)
    perms = random_group_permutations(spec, torch.Generator().manual_seed(7))
    aligned, found = align_to(state, permute_all(state, spec, perms), spec)
    for k in state:
        assert torch.equal(aligned[k], state[k]), k
    assert set(found) == {g.name for g in spec}
