"""Simple-FedMA: aligned (permuted) clients average back to the reference model."""

import numpy as np
import torch

from fedfuse.algorithms.base import RoundInfo, RunContext
from fedfuse.algorithms.simple_fedma import SimpleFedMA
from fedfuse.engine.client import TrainConfig
from fedfuse.fusion.permute import permute_all, random_group_permutations, transformer_spec
from fedfuse.types import FitStats, Message


def _lm_ctx(model_options):
    return RunContext(
        model_name="transformer", model_options=model_options, input_shape=(10,), num_classes=30, task="lm",
        train=TrainConfig(), num_clients=2, clients_per_round=2, client_sizes=np.array([5, 5]), seed=0,
        device=torch.device("cpu"),
    )


def test_simple_fedma_averages_aligned_clients():
    opts = dict(d_model=8, n_heads=2, n_layers=1, d_ff=12, dropout=0.0, persistent_pe=True)
    algo = SimpleFedMA(_lm_ctx(opts))
    state = algo.init_state()
    torch.manual_seed(3)
    ref = {k: v.clone() for k, v in algo.ctx.build().state_dict().items()}
    spec = transformer_spec(algo.ctx.model())
    other = permute_all(ref, spec, random_group_permutations(spec, torch.Generator().manual_seed(4)))
    fit = FitStats(num_examples=5)
    new = algo.aggregate_fit(state, RoundInfo(0, 1), {0: Message(ref, stats=fit), 1: Message(other, stats=fit)})
    for k in ref:
        torch.testing.assert_close(new["global"][k], ref[k])
    diag = algo.diagnostics(new, None, RoundInfo(0, 1))
    assert sum(diag.values()) > 0 and "moved/residual" in diag
