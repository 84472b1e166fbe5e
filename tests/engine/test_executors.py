"""Executors and declared client programs: the batched math against the reference, ragged clients, BatchNorm
buffers, frozen parameters, fallbacks, the auto probe, resume bit-identity and configuration."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from fedfuse.algorithms.dispfl import MASK, masked_gradients
from fedfuse.algorithms.heterofl import masked_cross_entropy
from fedfuse.config import ConfigError, RunConfig, apply, load_yaml, validate
from fedfuse.engine.client import TrainConfig, train_local
from fedfuse.engine.executor import SequentialExecutor, job_generator
from fedfuse.engine.executors import make_executor
from fedfuse.engine.loop import strip_timing
from fedfuse.engine.program import Batch, ClientProgram, LossTerm, cross_entropy, run_program
from fedfuse.executors.auto import AutoExecutor
from fedfuse.executors.batched import BatchedExecutor, batch_coupled, unbatchable_reason
from fedfuse.runner import experiment
from fedfuse.types import ClientData, Message, Split
from support import TinyMLP as MLP
from support import compare_with_reference as _compare
from support import identity_finalize as _identity_finalize
from support import tiny_clients as _clients
from support import tiny_jobs as _jobs
from support import tiny_program as _program


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))



def test_schedule_is_train_locals_batch_sequence():
    assert TrainConfig(local_epochs=2, batch_size=4).schedule(10) == [4, 4, 2, 4, 4, 2]
    assert TrainConfig(local_epochs=1, batch_size=32).schedule(5) == [5]  # batch capped at the client's size
    assert TrainConfig(local_epochs=3, batch_size=4, max_steps=4).schedule(10) == [4, 4, 2, 4]
    assert TrainConfig().schedule(0) == []


def test_batched_indices_are_the_sequential_permutations():
    clients = _clients([10, 7])
    ex = BatchedExecutor(clients, seed=11)
    spec = TrainConfig(local_epochs=2, batch_size=4)
    group = [(j, _program(MLP(), spec)) for j in _jobs(2)]
    scheds = [spec.schedule(10), spec.schedule(7)]
    idx, mask, gens = ex._batches(group, scheds, max(map(len, scheds)))
    for i, (job, _) in enumerate(group):
        gen = job_generator(11, job)
        n = len(clients[i].train)
        expected = [torch.randperm(n, generator=gen) for _ in range(2)]
        assert torch.equal(gens[i].get_state(), gen.get_state())  # left where training leaves it
        got = [idx[i, t][mask[i, t] > 0] - (10 if i else 0) for t in range(len(scheds[i]))]
        assert torch.equal(torch.cat(got), torch.cat(expected))
    assert mask[1, len(scheds[1]):].sum() == 0  # the shorter client is padded with masked steps


@pytest.mark.parametrize("optimizer,momentum,wd,clip", [("sgd", 0.0, 0.0, 0.0), ("sgd", 0.9, 1e-3, 0.5),
                                                        ("adam", 0.0, 1e-3, 0.0)])
def test_ragged_masked_group_equals_sequential(optimizer, momentum, wd, clip):
    clients = _clients([23, 9, 16, 3])  # different sizes: padded batches and frozen finished clients
    spec = TrainConfig(local_epochs=2, batch_size=5, lr=0.05 if optimizer == "sgd" else 0.01, momentum=momentum,
                     weight_decay=wd, optimizer=optimizer, grad_clip=clip)
    model = MLP()
    prox = LossTerm("prox", lambda b: sum((b.params[k] - b.refs[k]).pow(2).sum() for k in b.params))
    anchor = {k: v.detach() + 0.1 for k, v in model.named_parameters()}
    group = [(j, _program(model, spec, terms=(prox,), refs=anchor)) for j in _jobs(4)]
    ex = BatchedExecutor(clients, seed=2)
    assert not batch_coupled(group[0][1])
    assert len(ex.groups(group)) >= 1
    _compare(ex, group)


@pytest.mark.parametrize("kind,model_cls,sizes", [("sam", MLP, [23, 9, 16, 3]), ("asam", MLP, [23, 9, 16, 3]),
                                                   ("sam", BNNet, [12, 12, 12]), ("asam", BNNet, [12, 12, 12])])
def test_two_pass_sam_group_equals_sequential(kind, model_cls, sizes):
    """SAM/ASAM two-pass steps: per-client ε (one norm per client), the step at w + ε, BN statistics from the
    first pass only; ragged MLP clients (padded, with a proximal term in both passes) and a BN bucket."""
    clients = _clients(sizes)
    spec = TrainConfig(local_epochs=2, batch_size=5, lr=0.05, momentum=0.5,
                       grad_clip=1.0).with_two_pass(kind, 0.2, 0.01)
    model = model_cls()
    prox = LossTerm("prox", lambda b: sum((b.params[k] - b.refs[k]).pow(2).sum() for k in b.params))
    anchor = {k: v.detach() + 0.1 for k, v in model.named_parameters()}
    group = [(j, _program(model, spec, terms=(prox,), refs=anchor)) for j in _jobs(len(sizes))]
    ex = BatchedExecutor(clients, seed=5)
    out = _compare(ex, group)
    plain = _program(model, dataclasses.replace(spec, two_pass=""), terms=(prox,), refs=anchor)
    ref_plain, _ = ex._run_program(plain, group[0][0])
    assert any(not torch.allclose(out[0][0][k], ref_plain[k]) for k in ref_plain)  # the second pass matters


@pytest.mark.parametrize("model_cls,sizes", [(MLP, [23, 9, 16, 3]), (BNNet, [12, 12, 12])])
def test_logit_masks_are_per_client_and_batched_equals_sequential(model_cls, sizes):
    """HeteroFL's masked cross-entropy as data: each client's own class mask (ragged MLP clients, padded; a BN
    bucket), batched = sequential; the mask changes training, and an all-True mask changes nothing."""
    clients = _clients(sizes)
    spec = TrainConfig(local_epochs=2, batch_size=5, lr=0.1, momentum=0.5)
    model = model_cls()
    masks = [torch.tensor([c % 2 == 0, True, c % 3 == 0, True, False]) for c in range(len(sizes))]
    group = [(j, _program(model, spec, loss=masked_cross_entropy, refs={"logit_mask": masks[j.cid]}))
             for j in _jobs(len(sizes))]
    ex = BatchedExecutor(clients, seed=7)
    out = _compare(ex, group)
    first = group[0][1]  # the template's own values change as programs run: reuse the first program's init
    unmasked, _ = ex._run_program(dataclasses.replace(first, loss=cross_entropy, refs={}), group[0][0])
    assert any(not torch.allclose(out[0][0][k], unmasked[k]) for k in unmasked)
    full, _ = ex._run_program(dataclasses.replace(first, refs={"logit_mask": torch.ones(5, dtype=torch.bool)}),
                              group[0][0])
    for k in unmasked:
        assert torch.equal(full[k], unmasked[k]), k


def test_masked_cross_entropy_zeroes_the_masked_logits_of_the_loss_only():
    """The loss sees the masked logits (hand case); padded samples (mask 0) do not count."""
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(4, 5, generator=g), torch.tensor([0, 2, 2, 0])
    keep = torch.tensor([1, 0, 1, 0, 0]).bool()
    batch = Batch(torch.zeros(4, 1), y, logits, None, {}, {}, {"logit_mask": keep}, 0)
    hand = logits.clone()
    hand[:, [1, 3, 4]] = 0.0
    torch.testing.assert_close(masked_cross_entropy(batch), torch.nn.functional.cross_entropy(hand, y))
    padded = dataclasses.replace(batch, mask=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(masked_cross_entropy(padded), torch.nn.functional.cross_entropy(hand[:2], y[:2]))


def test_a_loss_reads_the_models_features_as_a_declared_input():
    """``features=True``: ``batch.features`` is the head's input of the same forward pass (no hook), and a term
    reading it trains alike in the sequential and the batched executor."""
    from fedfuse.engine.program import forward
    from fedfuse.models import build_model

    clients = _clients([10, 7, 10])
    model = build_model("mlp", (1, 6, 6), 5, widths=[8])
    x = clients[0].train.x
    z, logits = forward(model, dict(model.state_dict()), x, features=True)
    assert torch.equal(z, model.features(x)) and torch.equal(logits, model(x))

    def feature_norm(b: Batch) -> torch.Tensor:
        return b.mean(0.1 * b.features.pow(2).sum(-1))

    spec = TrainConfig(local_epochs=2, batch_size=4, lr=0.1)
    group = [(j, _program(model, spec, terms=(LossTerm("features", feature_norm),), features=True))
             for j in _jobs(3)]
    ex = BatchedExecutor(clients, seed=1)
    out = _compare(ex, group)
    assert ex.fallbacks == {}
    plain, _ = ex._run_program(dataclasses.replace(group[0][1], terms=(), features=False), group[0][0])
    assert any(not torch.allclose(out[0][0][k], plain[k]) for k in plain)  # the term acted


def test_batchnorm_group_updates_running_stats_per_client():
    clients = _clients([12, 12, 12])  # equal sizes: one exact bucket
    spec = TrainConfig(local_epochs=2, batch_size=5, lr=0.1)
    model = BNNet()
    group = [(j, _program(model, spec)) for j in _jobs(3)]
    ex = BatchedExecutor(clients, seed=4)
    assert batch_coupled(group[0][1])
    out = _compare(ex, group)
    steps = len(spec.schedule(12))
    for state, _ in out.values():
        assert int(state["bn.num_batches_tracked"]) == steps
    means = [out[c][0]["bn.running_mean"] for c in range(3)]
    assert not torch.allclose(means[0], means[1])  # each client keeps its own statistics


def test_batchnorm_clients_of_different_sizes_are_bucketed_not_padded():
    clients = _clients([12, 12, 9])
    model = BNNet()
    progs = [(j, _program(model, TrainConfig(batch_size=5))) for j in _jobs(3)]
    ex = BatchedExecutor(clients, seed=0)
    groups = ex.groups(progs)
    assert sorted(len(g) for g in groups) == [1, 2]


def test_frozen_parameters_stay_untouched():
    clients = _clients([15, 15])
    model = MLP()
    spec = TrainConfig(local_epochs=1, batch_size=4, lr=0.1)
    group = [(j, _program(model, spec, trainable=frozenset({"body.4.weight", "body.4.bias"}))) for j in _jobs(2)]
    ex = BatchedExecutor(clients, seed=0)
    out = _compare(ex, group)
    for state, _ in out.values():
        torch.testing.assert_close(state["body.1.weight"], group[0][1].init["body.1.weight"], rtol=0, atol=0)
        assert not torch.equal(state["body.4.weight"], group[0][1].init["body.4.weight"])


def test_run_program_is_train_local():
    clients = _clients([14])
    model = MLP()
    prog = _program(model, TrainConfig(local_epochs=2, batch_size=4, lr=0.1))
    state, stats = run_program(prog, clients[0], torch.Generator().manual_seed(3))
    ref = MLP()
    ref.load_state_dict(prog.init)
    rstats = train_local(ref, clients[0].train, TrainConfig(local_epochs=2, batch_size=4, lr=0.1),
                         torch.Generator().manual_seed(3))
    assert stats == rstats
    for k, v in ref.state_dict().items():
        assert torch.equal(state[k], v)


def test_dropout_falls_back_to_the_sequential_program():
    assert unbatchable_reason(MLP(dropout=0.5)) is not None and unbatchable_reason(MLP()) is None

    torch.manual_seed(5)
    model = MLP(dropout=0.5)
    init = {k: v.clone() for k, v in model.state_dict().items()}

    class Algo:  # a declared program whose model draws dropout masks from the global RNG
        def client_program(self, payload, state, data):
            return ClientProgram(model=model, init=init, spec=TrainConfig(batch_size=4), finalize=_identity_finalize)

        def fit(self, payload, state, data, gen):  # pragma: no cover - not called: the program is declared
            raise AssertionError

    clients = _clients([8, 8])
    ex = BatchedExecutor(clients, seed=0)
    out = ex.fit(Algo(), _jobs(2))
    ref = SequentialExecutor(clients, 0)
    for job in _jobs(2):
        expected = ref.run_one(lambda p, s, d, g: run_program(Algo().client_program(p, s, d), d, g), job)
        for k in expected[0]:
            assert torch.equal(out[job.cid][0][k], expected[0][k])
    assert any("dropout" in r for r in ex.fallbacks)


def _cfg(tmp_path, **kw) -> RunConfig:
    base = dict(dataset="digits", partition="dirichlet", model="mlp", clients=6, clients_per_round=3, rounds=4,
                batch_size=32, lr=0.05, seed=3, out=str(tmp_path / "run"), plots=False,
                model_options={"widths": [16]}, partition_options={"alpha": 0.5, "min_size": 20})
    base.update(kw)
    return apply(RunConfig(), base)


class Killed(Exception):
    pass


@pytest.mark.parametrize("executor,algorithm", [("batched", "fedprox"), ("stacked", "fedprox"), ("auto", "fedavg"),
                                                ("processes", "local")])
def test_resume_is_bit_identical_within_an_executor(tmp_path, executor, algorithm):
    def kill(rec):
        if rec["round"] == 2:
            raise Killed

    killed = experiment(_cfg(tmp_path / "b", executor=executor, algorithm=algorithm), on_round=kill)
    with pytest.raises(Killed):
        killed.run()
    chosen = killed.executor.describe()
    cfg = apply(RunConfig(), load_yaml(tmp_path / "b" / "run" / "config.yaml"))
    resumed = experiment(cfg, fed=killed.fed)
    sb = resumed.run(resume=True)
    assert sb["executor"]["detail"] == chosen  # auto keeps the executor its probe chose before the kill
    # the uninterrupted reference runs the executor that was actually used
    concrete = chosen.replace("auto→", "").split("(")[0]
    full = experiment(_cfg(tmp_path / "a", executor=concrete, algorithm=algorithm), fed=killed.fed)
    full.run()
    read = lambda d: [strip_timing(json.loads(x)) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert read(tmp_path / "a") == read(tmp_path / "b")
    assert _same(full.state, resumed.state) and _same(full.client_states, resumed.client_states)


def _same(a, b) -> bool:
    """Bit-identical nested containers of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_spawned_workers_train_private_copies_of_the_algorithm(tmp_path):
    """Under ``spawn`` (a GPU, macOS) the algorithm reaches the workers through torch's shared-memory pickling;
    each worker must train its own copy of the algorithm's cached modules, or workers running at once train the
    same tensors.  Two spawned workers equal the sequential reference bit for bit."""
    from fedfuse.executors.processes import ProcessExecutor

    cfg = _cfg(tmp_path, rounds=1, clients_per_round=6, out=None, threads=1)
    seq = experiment(cfg)
    seq.run()
    exp = experiment(cfg, fed=seq.fed)
    exp.executor = ProcessExecutor(exp.fed.blinded().clients, cfg.seed, workers=2, start_method="spawn")
    try:
        exp.run()
    finally:
        exp.executor.close()
    assert _same(seq.state, exp.state)


def test_auto_probe_picks_and_records_an_executor(tmp_path):
    exp = experiment(_cfg(tmp_path, executor="auto", rounds=1, out=None))
    summary = exp.run()
    assert isinstance(exp.executor, AutoExecutor)
    assert summary["executor"]["detail"].startswith("auto→")
    assert {"sequential", "batched", "stacked"} <= set(exp.executor.timings)  # the MLP can be stacked
    assert all(t > 0 for t in exp.executor.timings.values())
    chosen = min(exp.executor.timings, key=exp.executor.timings.get)
    assert summary["executor"]["detail"].split("(")[0].replace("auto→", "") == chosen
    assert summary["executor"]["used"] == chosen and summary["executor"]["requested"] == "auto"
    assert summary["executor"]["reason"].startswith(f"the probe's fastest per client-step of {chosen} ")


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_language_model_batched_equals_sequential(tmp_path):
    g = torch.Generator().manual_seed(1)

    def split(n):
        x = torch.randint(0, 20, (n, 8), generator=g)
        return Split(x, torch.roll(x, -1, 1))

    from fedfuse.types import Federation

    fed = Federation([ClientData(c, split(n), split(3), split(3)) for c, n in enumerate((11, 7, 9))], split(6), 20,
                     (8,), task="lm", dataset="tiny-shakespeare", partition="iid")
    runs = {}
    for ex in ("sequential", "batched"):
        cfg = apply(RunConfig(), dict(algorithm="fedprox", dataset="tiny-shakespeare", model="transformer", clients=3,
                                      clients_per_round=3, rounds=2, batch_size=4, lr=0.1, seed=0, plots=False,
                                      executor=ex, partition="iid",
                                      model_options=dict(d_model=8, n_heads=2, n_layers=1, d_ff=12, dropout=0.0)))
        runs[ex] = experiment(cfg, fed=fed)
        runs[ex].run()
    assert runs["batched"].executor.fallbacks == {}
    for k, v in runs["sequential"].state["global"].items():
        torch.testing.assert_close(runs["batched"].state["global"][k], v, rtol=1e-4, atol=1e-5)


def test_executor_is_a_validated_config_key():
    assert validate(apply(RunConfig(), {"executor": "batched"})).executor == "batched"
    with pytest.raises(ConfigError, match="executor"):
        validate(apply(RunConfig(), {"executor": "gpu-magic"}))
    with pytest.raises(ValueError, match="unknown executor"):
        make_executor("nope", [], 0)


def test_the_engine_registers_only_the_reference_and_fedfuse_executors_adds_the_rest():
    """In a fresh interpreter the engine's registry holds ``sequential`` alone and names who registers
    ``batched``; importing :mod:`fedfuse.executors` (as the runner does) registers batched, stacked, processes
    and auto."""
    import subprocess
    import sys

    code = ("from fedfuse.engine import executors as e\n"
            "from fedfuse.errors import UserError\n"
            "print(e.executor_names())\n"
            "try:\n    e.make_executor('batched', [], 0)\nexcept UserError as err:\n    print(err)\n"
            "import fedfuse.executors\n"
            "print(e.executor_names())\n"
            "print(type(e.make_executor('batched', [], 0)).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "('sequential',)"
    assert "registered by fedfuse.runner" in out[1] and "importing fedfuse.executors" in out[1]
    assert out[2] == "('sequential', 'batched', 'stacked', 'processes', 'auto')"
    assert out[3] == "BatchedExecutor"


def test_a_subclass_with_a_custom_fit_does_not_inherit_its_parents_program():
    """A subclass that replaces its parent's ``fit`` (say, a masked variant of D-PSGD) runs that ``fit``, not the
    parent's program, unless it declares its own program (as Dis-PFL does)."""
    from fedfuse.algorithms import ALGORITHMS
    from fedfuse.algorithms.base import Algorithm

    dpsgd = ALGORITHMS["dpsgd"]

    class Custom(dpsgd):
        def fit(self, payload, client_state, data, gen):
            raise AssertionError("not called here")

    assert "client_program" in vars(dpsgd) and Custom.client_program is Algorithm._no_program
    assert Custom.client_program(None, Message(), None, None) is None
    assert "client_program" in vars(ALGORITHMS["dispfl"])  # declares its own


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.5, 1e-3)])
def test_gradient_masks_freeze_entries_per_client_and_batched_equals_sequential(momentum, wd):
    """Dis-PFL's sparse step as a gradient transform: each client's 0/1 masks multiply its gradients before the
    step; masked
    entries never move under plain SGD (with weight decay they only decay, as under ``torch.optim``)."""
    clients = _clients([14, 9, 14])
    spec = TrainConfig(local_epochs=2, batch_size=4, lr=0.1, momentum=momentum, weight_decay=wd, grad_clip=1.0)
    model = MLP()
    g = torch.Generator().manual_seed(1)
    masks = [{k: (torch.rand(p.shape, generator=g) < 0.5).float() for k, p in model.named_parameters()}
             for _ in range(3)]
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    group = [(j, ClientProgram(model=model, init=init, spec=spec, finalize=_identity_finalize,
                               refs={MASK + k: m for k, m in masks[j.cid].items()}, transform=masked_gradients))
             for j in _jobs(3)]
    ex = BatchedExecutor(clients, seed=3)
    out = _compare(ex, group)
    if not wd:
        for c, (state, _) in out.items():
            for k, mk in masks[c].items():
                assert torch.equal(state[k][mk == 0], init[k][mk == 0]), k
                assert not torch.equal(state[k][mk == 1], init[k][mk == 1]), k


def test_a_finalize_may_continue_the_clients_generator():
    clients = _clients([10, 7])
    spec = TrainConfig(local_epochs=2, batch_size=4, lr=0.1)
    model = MLP()
    draws: dict[str, list] = {"seq": [], "bat": []}

    def program(tag):
        def finalize(state, stats):
            draws[tag].append(torch.randint(0, 10**6, (3,), generator=stats.generator))
            return state, stats
        return ClientProgram(model=model, init={k: v.detach().clone() for k, v in model.state_dict().items()},
                             spec=spec, finalize=finalize)

    ex = BatchedExecutor(clients, seed=8)
    jobs = _jobs(2)
    ex.train_group([(j, program("bat")) for j in jobs])
    for j in jobs:
        ex._run_program(program("seq"), j)
    for a, b in zip(draws["seq"], draws["bat"], strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(draws["seq"][0], draws["seq"][1])


def test_entries_left_out_of_init_are_a_frozen_shared_base():
    """A program whose ``init`` holds only the head trains the head on the template's body (read, never moved,
    not sent back) in both executors; an optimised parameter missing from ``init`` is refused."""
    clients = _clients([10, 7])
    model = MLP()
    body = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("body.1.")}
    head = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("body.4.")}
    spec = TrainConfig(local_epochs=2, batch_size=4, lr=0.1)
    group = [(j, _program(model, spec, trainable=frozenset(head))) for j in _jobs(2)]
    group = [(j, dataclasses.replace(p, init=dict(head))) for j, p in group]
    ex = BatchedExecutor(clients, seed=0)
    out = _compare(ex, group)
    for state, _ in out.values():
        assert set(state) == set(head) and not torch.equal(state["body.4.weight"], head["body.4.weight"])
    for k, v in body.items():
        assert torch.equal(model.state_dict()[k], v), k  # the base was read, never trained
    with pytest.raises(ValueError, match="missing from init"):
        run_program(dataclasses.replace(group[0][1], trainable=None), clients[0], torch.Generator().manual_seed(0))


def test_step_loss_is_the_loss_plus_the_terms_and_ignores_padded_samples():
    """Hand case on a linear model: (minimised, reported) = (CE + λ·mean‖x‖² + ‖w‖², CE); padding the batch with
    masked garbage samples changes neither value."""
    from fedfuse.engine.program import step_loss

    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 3, 0])
    per_sample = LossTerm("sq", lambda b: b.mean(0.5 * b.x.pow(2).sum(1)))
    weight = LossTerm("w", lambda b: b.params["weight"].pow(2).sum())
    prog = ClientProgram(model=model, init=dict(params), spec=TrainConfig(), finalize=_identity_finalize,
                         terms=(per_sample, weight))
    total, reported = step_loss(prog, params, {}, {}, x, y)
    ce = torch.nn.functional.cross_entropy(x @ params["weight"].T + params["bias"], y)
    torch.testing.assert_close(reported, ce)
    torch.testing.assert_close(total, ce + 0.5 * x.pow(2).sum(1).mean() + params["weight"].pow(2).sum())
    xp, yp = torch.cat([x, 100 * torch.randn(3, 3)]), torch.cat([y, torch.tensor([3, 3, 3])])
    mask = torch.cat([torch.ones(5), torch.zeros(3)])
    padded = step_loss(prog, params, {}, {}, xp, yp, mask)
    torch.testing.assert_close(padded[0], total)
    torch.testing.assert_close(padded[1], reported)
