"""The stacked executor (``executors/stacked.py``): linear models' clients trained as batched matrix products.

The stacked step must equal the sequential step (within float summation order) for everything a declared
program can say — momentum, weight decay, clipping, Adam, a proximal term, logit masks, a features term, SAM,
gradient transforms, a frozen base, ragged clients — and a program it cannot stack must take the ``vmap`` route
with its reason recorded, never train differently.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from fedfuse.algorithms import ALGORITHMS
from fedfuse.algorithms.dispfl import MASK, masked_gradients
from fedfuse.algorithms.heterofl import masked_cross_entropy
from fedfuse.engine.client import TrainConfig
from fedfuse.engine.program import Batch, ClientProgram, LossTerm, batch_loss, cross_entropy
from fedfuse.executors.stacked import StackedExecutor, _StackedStep, stacked_cross_entropy, stacked_reason
from fedfuse.models import build_model
from fedfuse.runtime.precision import use_precision
from support import TinyMLP as SequentialMLP
from support import compare_with_reference as _compare
from support import conformance_close as _assert_close_history
from support import conformance_run as _run
from support import identity_finalize as _identity_finalize
from support import tiny_clients as _clients
from support import tiny_jobs as _jobs
from support import tiny_program as _program

PROX = LossTerm("prox", lambda b: sum((b.params[k] - b.refs[k]).pow(2).sum() for k in b.params))


def _mlp(widths=(12, 8)) -> nn.Module:
    return build_model("mlp", (1, 6, 6), 5, widths=list(widths))


def _anchor(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() + 0.1 for k, v in model.named_parameters()}


def test_hand_sized_stacked_step_equals_the_sequential_step():
    """Three clients of a 36-4-5 MLP, equal batches, four steps of SGD with momentum and a FedProx term, fp32:
    every trained tensor and the reported loss equal the sequential executor's."""
    clients = _clients([8, 8, 8])
    spec = TrainConfig(local_epochs=2, batch_size=4, lr=0.1, momentum=0.9)
    model = _mlp((4,))
    group = [(j, _program(model, spec, terms=(PROX,), refs=_anchor(model))) for j in _jobs(3)]
    ex = StackedExecutor(clients, seed=4)
    out = _compare(ex, group, atol=1e-6)
    assert ex.routes == {"stacked": 1}
    for state, stats in out.values():
        assert stats.steps == 4 and not torch.equal(state["fc.weight"], group[0][1].init["fc.weight"])


@pytest.mark.parametrize("optimizer,momentum,wd,clip,terms", [
    ("sgd", 0.0, 0.0, 0.0, False), ("sgd", 0.9, 1e-3, 0.5, True), ("sgd", 0.9, 1e-3, 0.5, False),
    ("adam", 0.0, 1e-3, 0.0, True)])
def test_ragged_stacked_group_equals_sequential(optimizer, momentum, wd, clip, terms):
    """Clients of different sizes (padded batches, finished clients frozen), with the default loss computed
    directly on the stacked logits or a term evaluated per client."""
    clients = _clients([23, 9, 16, 3])
    spec = TrainConfig(local_epochs=2, batch_size=5, lr=0.05 if optimizer == "sgd" else 0.01, momentum=momentum,
                       weight_decay=wd, optimizer=optimizer, grad_clip=clip)
    model = _mlp()
    kw = dict(terms=(PROX,), refs=_anchor(model)) if terms else {}
    group = [(j, _program(model, spec, **kw)) for j in _jobs(4)]
    ex = StackedExecutor(clients, seed=2)
    _compare(ex, group)
    assert ex.routes == {"stacked": 1} and ex.fallbacks == {}


@pytest.mark.parametrize("kind", ["sam", "asam"])
def test_stacked_two_pass_sam_equals_sequential(kind):
    clients = _clients([23, 9, 16, 3])
    spec = TrainConfig(local_epochs=2, batch_size=5, lr=0.05, momentum=0.5, grad_clip=1.0).with_two_pass(kind, 0.2)
    model = _mlp()
    group = [(j, _program(model, spec, terms=(PROX,), refs=_anchor(model))) for j in _jobs(4)]
    ex = StackedExecutor(clients, seed=5)
    _compare(ex, group)
    assert ex.routes == {"stacked": 1}


def test_stacked_logit_masks_features_transform_and_frozen_base_equal_sequential():
    """HeteroFL's per-client class masks, a term on the penultimate features (MSfusion's input), Dis-PFL's
    gradient masks, and a program whose ``init`` is the head only (the body a frozen base shared by all)."""
    clients = _clients([14, 9, 14])
    spec = TrainConfig(local_epochs=2, batch_size=4, lr=0.1, momentum=0.5, weight_decay=1e-3)
    model = _mlp()
    masks = [torch.tensor([c % 2 == 0, True, c % 3 == 0, True, False]) for c in range(3)]

    def feature_norm(b: Batch) -> torch.Tensor:
        return b.mean(0.1 * b.features.pow(2).sum(-1))

    g = torch.Generator().manual_seed(1)
    grad_masks = [{k: (torch.rand(p.shape, generator=g) < 0.5).float() for k, p in model.named_parameters()}
                  for _ in range(3)]
    head = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("fc.")}
    cases = {
        "logit masks": lambda j: _program(model, spec, loss=masked_cross_entropy,
                                          refs={"logit_mask": masks[j.cid]}),
        "features": lambda j: _program(model, spec, terms=(LossTerm("f", feature_norm),), features=True),
        "transform": lambda j: _program(model, spec, refs={MASK + k: m for k, m in grad_masks[j.cid].items()},
                                        transform=masked_gradients),
        "frozen base": lambda j: dataclasses.replace(_program(model, spec, trainable=frozenset(head)),
                                                     init=dict(head)),
    }
    for name, make in cases.items():
        ex = StackedExecutor(clients, seed=3)
        _compare(ex, [(j, make(j)) for j in _jobs(3)])
        assert ex.routes == {"stacked": 1}, name


def test_direct_cross_entropy_is_the_per_client_batch_loss():
    """The default loss computed on the stacked logits equals ``batch_loss`` per client (with padding)."""
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(3, 6, 5, generator=g), torch.randint(0, 5, (3, 6), generator=g)
    mask = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2, [1.0] + [0.0] * 5])
    prog = ClientProgram(model=_mlp(), init={}, spec=TrainConfig(), finalize=_identity_finalize)
    for m in (None, mask):
        per = [batch_loss(prog, Batch(torch.zeros(6, 1), y[c], logits[c], None, {}, {}, {}, 0,
                                      None if m is None else m[c]))[0] for c in range(3)]
        torch.testing.assert_close(stacked_cross_entropy(logits, y, m), torch.stack(per))
    assert prog.loss is cross_entropy


def test_programs_it_cannot_stack_take_the_vmap_route_with_a_reason():
    """A model class without a stacked forward, a model with a forward hook: the batched executor's ``vmap``
    step, its reason recorded, results equal to the sequential run."""
    clients = _clients([10, 7])
    spec = TrainConfig(local_epochs=2, batch_size=4, lr=0.1, momentum=0.5)
    other = SequentialMLP()
    assert stacked_reason(_program(other, spec)) == "TinyMLP: no stacked forward pass"  # the tests' own MLP class
    hooked = _mlp()
    hooked.hidden[0].register_forward_hook(lambda m, i, o: o * 0.5)
    assert stacked_reason(_program(hooked, spec)) == "hidden.0: module hooks"
    for model in (other, hooked):
        ex = StackedExecutor(clients, seed=1)
        _compare(ex, [(j, _program(model, spec)) for j in _jobs(2)])
        assert list(ex.routes) == [f"vmap: {stacked_reason(_program(model, spec))}"]
    assert isinstance(StackedExecutor(clients, 0).group_step(_program(_mlp(), spec), {}, True), _StackedStep)


def test_bf16_autocast_reaches_the_stacked_step():
    """At bf16 the stacked products run in bf16 (the result moves from fp32) and stay within bf16 rounding of
    the sequential bf16 run."""
    clients = _clients([20, 20, 20])
    spec = TrainConfig(local_epochs=1, batch_size=5, lr=0.05, momentum=0.9)
    model = _mlp((32, 16))
    group = [(j, _program(model, spec, terms=(PROX,), refs=_anchor(model))) for j in _jobs(3)]
    ex = StackedExecutor(clients, seed=6)
    fp32 = ex.train_group(group)
    with use_precision("bf16"):
        bf16 = ex.train_group(group)
        ref = {j.cid: ex._run_program(p, j) for j, p in group}
    for c, (state, stats) in bf16.items():
        assert any(not torch.equal(state[k], fp32[c][0][k]) for k in state)
        assert stats.loss_sum == pytest.approx(ref[c][1].loss_sum, rel=2e-2)
        for k in state:
            torch.testing.assert_close(state[k], ref[c][0][k], rtol=0, atol=2e-2, msg=k)


STACKED_ALGORITHMS = ("fedavg", "fedprox", "fedmr", "fedmerge", "heterofl", "msfusion", "fedsam", "dispfl")


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_runs_the_same_stacked(algorithm):
    """Every registered algorithm (the conformance run: digits, a 64-16-10 MLP, 2 rounds) under ``stacked``
    agrees with ``sequential`` within the batched executor's tolerance; the MLP programs of the algorithms the
    issue names are stacked, not vmapped."""
    seq = _run(algorithm, "sequential")
    st = _run(algorithm, "stacked")
    _assert_close_history(seq.history, st.history, f"{algorithm} stacked vs sequential")
    if algorithm in STACKED_ALGORITHMS:
        assert set(st.executor.routes) == {"stacked"}, (algorithm, st.executor.routes)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "heterofl", "msfusion"])
def test_bf16_runs_stacked(algorithm):
    """``precision=bf16`` reaches the stacked step of whole runs: one round agrees with the sequential bf16 run
    within the conformance suite's bf16 tolerances, and differs from the stacked fp32 run."""
    from support import BF16_ACC_ATOL, BF16_LOSS_RTOL

    seq = _run(algorithm, "sequential", precision="bf16", rounds=1)
    st = _run(algorithm, "stacked", precision="bf16", rounds=1)
    fp32 = _run(algorithm, "stacked", rounds=1)
    assert st.summary()["precision"] == "bf16" and set(st.executor.routes) == {"stacked"}
    a, b, f = seq.history[-1], st.history[-1], fp32.history[-1]
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=BF16_LOSS_RTOL)
    assert b["train_loss"] != f["train_loss"]
    for k in a:
        if "accuracy" in k and isinstance(a[k], float):
            assert abs(a[k] - b[k]) <= BF16_ACC_ATOL, k
