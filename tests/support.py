"""Helpers shared by several test files (``tests/`` is on ``sys.path`` through ``conftest.py``): the repository's
paths, the tiny runs several files share (conformance, FedMR, the HeteroFL and mixture families, matching), the
executors' tiny clients and programs, checks one algorithm family runs for each member, and the data tests'
synthetic dataset.  A helper lives here once instead of in each file that needs it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedfuse.algorithms import ALGORITHMS
from fedfuse.config import RunConfig, apply
from fedfuse.data.dataset import Dataset
from fedfuse.engine.executor import Job
from fedfuse.engine.loop import Experiment, strip_timing
from fedfuse.engine.program import ClientProgram
from fedfuse.extras import has_extra
from fedfuse.fusion.slicing import slice_state
from fedfuse.runner import experiment
from fedfuse.types import ClientData, Federation, FitStats, Message, Split
from golden.make_golden import lora_base, tiny_model, token_federation

ROOT = Path(__file__).resolve().parent.parent
"""The repository (worktree) root."""
SHARED_DATA = ROOT.parent / "shared" / "data"
"""Shared datasets beside the repository (``../shared/data``)."""


def skip_reason(extra: str) -> str:
    """The one-line reason of a test skipped for a missing extra (the README quotes it)."""
    return f"needs the {extra} extra: pip install -e '.[{extra}]'"


def needs_extra(extra: str) -> None:
    """Skip the calling test (or, at module level, the whole file) when ``extra`` (:mod:`fedfuse.extras`) is not
    installed, with :func:`skip_reason`.  Every test that needs an extra calls this (or ``pytest.importorskip``
    with that reason): ``.ci/run`` runs the files that do in an environment with only the README's install."""
    if not has_extra(extra):
        pytest.skip(skip_reason(extra), allow_module_level=True)


LORA = {name for name, cls in ALGORITHMS.items() if "lora" in cls.extras}
_BASE: dict[str, str] = {}


def _lora_base() -> str:
    """A tiny frozen base (fedfuse transformer, vocabulary 30) for the LoRA algorithms, written once."""
    if "path" not in _BASE:
        _BASE["path"] = lora_base()
    return _BASE["path"]


def conformance_cfg(algorithm: str, executor: str) -> RunConfig:
    """A tiny run of ``algorithm`` under ``executor``: digits on the first tiny model that has what the algorithm
    ``requires`` (:func:`golden.make_golden.tiny_model`: the MLP, or a BatchNorm ResNet), or generated token
    sequences + a transformer for Simple-FedMA and the LoRA algorithms (the conformance, options-act and Flower
    suites share it)."""
    if algorithm in LORA:  # LoRA adapters on a frozen base LM: generated token sequences
        return apply(RunConfig(), dict(
            algorithm=algorithm, dataset="tiny-shakespeare", model="transformer", clients=3, clients_per_round=3,
            rounds=2, batch_size=8, lr=0.01, optimizer="adam", seed=2, plots=False, executor=executor,
            local_epochs=1, eval_every=2, partition="iid",
            algorithm_options=dict(base=_lora_base(), rank=2, rouge_samples=2, prompt_len=4, gen_tokens=3)))
    if algorithm == "simple-fedma":
        return apply(RunConfig(), dict(
            algorithm=algorithm, dataset="tiny-shakespeare", model="transformer", clients=3, clients_per_round=3,
            rounds=2, batch_size=8, lr=0.1, seed=2, plots=False, executor=executor, local_epochs=1,
            eval_every=2, partition="iid",
            model_options=dict(d_model=8, n_heads=2, n_layers=1, d_ff=12, dropout=0.0, persistent_pe=True),
        ))
    return apply(RunConfig(), dict(
        algorithm=algorithm, dataset="digits", clients=4, clients_per_round=3, rounds=2, batch_size=32, seed=1,
        plots=False, executor=executor, local_epochs=1, eval_every=2, **tiny_model(algorithm),
        partition_options={"alpha": 1.0, "min_size": 20},
    ))


def fedmr_cfg(tmp_path=None, **kw) -> RunConfig:
    """FedMR on digits (6 clients, 3 per round, 3 rounds, MLP 64-16-16-10); ``kw`` overrides any key."""
    base = dict(
        algorithm="fedmr", dataset="digits", partition="dirichlet", model="mlp", clients=6, clients_per_round=3,
        rounds=3, local_epochs=1, batch_size=32, lr=0.05, seed=5, plots=False,
        out=str(tmp_path / "run") if tmp_path is not None else None,
        model_options={"widths": [16, 16]}, partition_options={"alpha": 0.5, "min_size": 20},
    )
    base.update(kw)
    return apply(RunConfig(), base)


def small_cfg(tmp_path, **kw) -> RunConfig:
    """FedAvg on digits (6 clients, 3 per round, 3 rounds, MLP 64-32-10) writing to ``tmp_path/run``."""
    base = dict(
        dataset="digits", partition="dirichlet", model="mlp", clients=6, clients_per_round=3, rounds=3,
        batch_size=32, lr=0.05, seed=3, out=str(tmp_path / "run"), plots=False,
        model_options={"widths": [32]}, partition_options={"alpha": 0.5, "min_size": 20},
    )
    base.update(kw)
    return apply(RunConfig(), base)


def server_steps(algorithm: str, options: dict, rounds: int = 2) -> list[tuple[dict, dict, dict]]:
    """``rounds`` server steps of ``algorithm`` (MLP 64-16-10 on digits) on made-up replies of two clients
    (10 and 30 examples, seeded noise around the current model): per round ``(x, mean of the replies, new x)``
    in float64, for checking a server optimiser's recurrence by hand."""
    import torch

    from fedfuse.algorithms.base import RoundInfo
    from fedfuse.runner import experiment
    from fedfuse.types import FitStats, Message

    cfg = apply(RunConfig(), dict(algorithm=algorithm, dataset="digits", model="mlp", clients=4, clients_per_round=2,
                                  rounds=rounds, plots=False, out=None, model_options={"widths": [16]},
                                  algorithm_options=options))
    algo = experiment(cfg).algo
    state = algo.init_state()
    g = torch.Generator().manual_seed(0)
    out = []
    for r in range(rounds):
        x = state["global"]
        replies = [{k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in x.items()} for _ in range(2)]
        msgs = {0: Message(replies[0], stats=FitStats(num_examples=10)),
                1: Message(replies[1], stats=FitStats(num_examples=30))}
        state = algo.aggregate_fit(state, RoundInfo(r, rounds), msgs)
        mean = {k: 0.25 * replies[0][k].double() + 0.75 * replies[1][k].double() for k in x}
        out.append(({k: v.double() for k, v in x.items()}, mean, {k: v.double() for k, v in state["global"].items()}))
    return out


LORA_TEXTS = [
    "the king is dead, long live the king. " * 12,
    "what light through yonder window breaks? " * 12,
    "to be or not to be, that is the question. " * 12,
]
"""Three clients' text for the LoRA tests (one role each)."""


def lora_tiny_base(directory: Path) -> str:
    """A tiny fedfuse transformer LM (character vocabulary, seed 0) saved in ``directory``, as a ``base`` option."""
    import torch

    from fedfuse.adapters.text import CharTokenizer
    from fedfuse.models.transformer import TransformerModel

    tok = CharTokenizer()
    torch.manual_seed(0)
    kw = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "dropout": 0.0, "norm_first": True, "max_len": 64}
    m = TransformerModel(len(tok), len(tok), task="lm", **kw)
    path = directory / "tiny.pt"
    torch.save({"kind": "fedfuse-lm", "model": kw, "vocab": tok.vocab, "state": m.state_dict(), "info": {}}, path)
    return f"fedfuse:{path}"


def lora_toy_federation():
    """:data:`LORA_TEXTS` as a federation of three clients, windows of 16 characters (½ train, ¼ val, ¼ test)."""
    from fedfuse.adapters.text import CharTokenizer
    from fedfuse.data.lm_clients import make_federation, windows

    tok = CharTokenizer()
    rows = []
    for i, t in enumerate(LORA_TEXTS):
        ids = tok.encode(t)
        n = len(ids)
        rows.append((f"role{i}", windows(ids[: n // 2], 16), windows(ids[n // 2 : 3 * n // 4], 16),
                     windows(ids[3 * n // 4 :], 16)))
    return make_federation(rows, len(tok), dataset="toy", partition="role")


def lora_run(fed, algo: str, base: str, rounds: int = 2, seed: int = 0, **opts):
    """Run the LoRA algorithm ``algo`` (rank 2) on ``fed`` over the frozen ``base``: ``(experiment, summary)``."""
    from fedfuse.config import validate
    from fedfuse.runner import experiment

    cfg = validate(apply(RunConfig(), {
        "algorithm": algo, "dataset": "shakespeare", "partition": "natural", "model": "transformer",
        "clients": fed.num_clients, "clients_per_round": fed.num_clients, "rounds": rounds, "local_epochs": 1,
        "batch_size": 4, "lr": 0.01, "optimizer": "adam", "seed": seed, "plots": False,
        "algorithm_options": {"base": base, "rank": 2, "rouge_samples": 2, "gen_tokens": 4, **opts}}))
    exp = experiment(cfg, fed=fed)
    summary = exp.run()
    return exp, summary


def lora_fake_results(am, sizes, seed=0):
    """Seeded random adapters as the replies of clients with ``sizes`` examples."""
    import torch

    from fedfuse.types import FitStats, Message

    g = torch.Generator().manual_seed(seed)
    return {c: Message({k: torch.randn(v.shape, generator=g) for k, v in am.adapter().items()},
                       stats=FitStats(num_examples=n)) for c, n in enumerate(sizes)}


# ---- the conformance suite's run and comparison (system/test_conformance.py, executors/test_stacked.py) ----


LOSS_RTOL = 1e-4
ACC_ATOL = 0.02


_FEDS: dict[str, Federation] = {}


def conformance_fed(algorithm: str) -> Federation | None:
    """The federation an earlier :func:`conformance_run` built for ``algorithm``'s data kind, if any."""
    key = "lm" if algorithm == "simple-fedma" or algorithm in LORA else "digits"
    return _FEDS.get(key)


def conformance_run(algorithm: str, executor: str, executor_obj=None, **changes) -> Experiment:
    """Run :func:`conformance_cfg` of ``algorithm`` under ``executor`` (or ``executor_obj``), sharing one federation
    per data kind across calls."""
    lm = algorithm == "simple-fedma" or algorithm in LORA
    if algorithm in LORA:
        pytest.importorskip("peft", reason="needs the lora extra: pip install -e '.[lora]'")
    cfg = dataclasses.replace(conformance_cfg(algorithm, executor), **changes)
    exp = experiment(cfg, fed=conformance_fed(algorithm) or (
        token_federation() if lm else None), executor=executor_obj)
    _FEDS.setdefault("lm" if lm else "digits", exp.fed)
    exp.run()
    return exp


BF16_LOSS_RTOL = 2e-2  # bf16 products round to 8 bits of mantissa: the batched kernels round differently
BF16_ACC_ATOL = 0.05

# float metrics that must match bit for bit (lists and ints always do)
EXACT = ("bytes", "flops", "parameters", "round")


def conformance_close(ref: list[dict], other: list[dict], label: str) -> None:
    """Two runs' histories agree: counts exactly, accuracies within ACC_ATOL, losses within LOSS_RTOL."""
    assert len(ref) == len(other)
    for a, b in zip(ref, other, strict=True):
        a, b = strip_timing(a), strip_timing(b)
        assert a.keys() == b.keys(), label
        for k, va in a.items():
            vb = b[k]
            where = f"{label}: round {a['round']} {k}"
            if any(t in k for t in EXACT) or not isinstance(va, float) or not isinstance(vb, float):
                assert va == vb, f"{where}: {va} != {vb}"
            elif math.isnan(va):
                assert math.isnan(vb), where
            elif "accuracy" in k:
                assert abs(va - vb) <= ACC_ATOL, f"{where}: {va} vs {vb}"
            else:
                assert vb == pytest.approx(va, rel=LOSS_RTOL, abs=1e-6), f"{where}: {va} vs {vb}"


# ---- tiny clients and programs for the executors' tests (engine/test_executors.py, executors/test_stacked.py) ----
EMPTY = Split(torch.zeros(0, 1, 6, 6), torch.zeros(0, dtype=torch.long))


def tiny_clients(sizes, shape=(1, 6, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [ClientData(c, Split(torch.randn(n, *shape, generator=g), torch.randint(0, 5, (n,), generator=g)),
                       EMPTY, EMPTY) for c, n in enumerate(sizes)]


class TinyMLP(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(36, 12), nn.ReLU(), nn.Dropout(dropout), nn.Linear(12, 5))

    def forward(self, x):
        return self.body(x)


def identity_finalize(state, stats):
    return state, stats


def tiny_program(model, spec, **kw) -> ClientProgram:
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ClientProgram(model=model, init=init, spec=spec, finalize=identity_finalize, **kw)


def tiny_jobs(n):
    return [Job(c, Message(), None, ("fit", 3, 0)) for c in range(n)]


def compare_with_reference(ex, group, atol=2e-5):
    batched = ex.train_group(group)
    for job, prog in group:
        ref_state, ref_stats = ex._run_program(prog, job)
        state, stats = batched[job.cid]
        assert stats.steps == ref_stats.steps and stats.samples == ref_stats.samples
        assert stats.loss_sum == pytest.approx(ref_stats.loss_sum, rel=1e-5)
        assert list(state) == list(ref_state)
        for k in ref_state:
            if ref_state[k].dtype == torch.int64:
                assert torch.equal(state[k], ref_state[k]), k
            else:
                torch.testing.assert_close(state[k], ref_state[k], rtol=1e-4, atol=atol, msg=k)
    return batched


# ---- HeteroFL and FedRolex (algorithms/test_heterofl.py, algorithms/test_fedrolex.py) ----
def sliced_cfg(algorithm: str = "heterofl", **kw) -> RunConfig:
    """HeteroFL/FedRolex on digits: 3 shard clients, MLP 64-8-10, μ = 0.5, 2 rounds; ``kw`` overrides any key."""
    base = dict(
        dataset="digits", partition="shards", partition_options={"classes_per_client": 3}, model="mlp", clients=3,
        clients_per_round=3, rounds=2, eval_every=1, batch_size=64, local_epochs=1, lr=0.05, seed=2, plots=False,
        out=None, model_options={"widths": [8]}, algorithm=algorithm,
        dataset_options={"train_limit": 300, "test_limit": 100},
    )
    opts = {"mu": 0.5, "lr_schedule": "constant"}
    opts.update(kw.pop("algorithm_options", {}))
    base.update(kw)
    base["algorithm_options"] = opts
    return apply(RunConfig(), base)


def check_same_seed_identical_metrics(algorithm: str) -> None:
    runs = []
    for _ in range(2):
        e = experiment(sliced_cfg(algorithm))
        e.run()
        runs.append([strip_timing(r) for r in e.history])
    assert runs[0] == runs[1]
    assert runs[0][0]["bytes_up"] < runs[0][0]["bytes_down"] * 1.01  # sub-models both ways


def check_scaler_auto_only_with_normalisation_layers(algorithm: str) -> None:
    """The authors' Scaler always feeds a norm layer; on a norm-free MLP its ×1/μ per layer compounds and the
    default lr 0.1 diverged (MNIST, μ = 0.125: training loss 1e23, then NaN).  ``auto`` therefore applies it only
    to models with normalisation; ``always`` and ``never`` force it."""
    mlp = experiment(sliced_cfg(algorithm)).algo
    assert mlp.opt.scaler == "auto" and not mlp.use_scaler()
    assert experiment(sliced_cfg(algorithm, algorithm_options={"scaler": "always"})).algo.use_scaler()
    kw = dict(model="resnet18", model_options={"width_mult": 0.0625, "norm": "bn-static"})
    assert experiment(sliced_cfg(algorithm, **kw)).algo.use_scaler()
    assert not experiment(sliced_cfg(algorithm, **kw, algorithm_options={"scaler": "never"})).algo.use_scaler()
    # a client's training under auto equals training with the Scaler off on the MLP, and differs from always
    out = {}
    for mode in ("auto", "never", "always"):
        exp = experiment(sliced_cfg(algorithm, algorithm_options={"scaler": mode}))
        algo, data = exp.algo, exp.fed.clients[0]
        sel = algo.selection(0, 0)
        payload = Message(slice_state(algo.init_state()["global"], algo.spec, sel),
                          {"round": 0, "total": 2, "sel": {k: v.tolist() for k, v in sel.items()}})
        out[mode] = algo.fit(payload, None, data, torch.Generator().manual_seed(0))[0].tensors
    for k in out["auto"]:
        torch.testing.assert_close(out["auto"][k], out["never"][k], rtol=0, atol=0)
    assert any(not torch.equal(out["auto"][k], out["always"][k]) for k in out["auto"])


def check_batched_sub_models_equal_sequential(algorithm: str) -> None:
    """The declared training stage (a static-BN ResNet sub-model with the Scaler's hooks, each client's logit
    mask) runs vmapped and gives the sequential run; only HeteroFL's BN-statistics stage stays custom."""
    kw = dict(model="resnet18", model_options={"width_mult": 0.0625, "norm": "bn-static"}, rounds=2, clients=3,
              clients_per_round=3, algorithm_options={"stats_every": 2})
    runs = {}
    for executor in ("sequential", "batched"):
        exp = experiment(sliced_cfg(algorithm, executor=executor, **kw))
        assert exp.algo.use_scaler()
        exp.run()
        runs[executor] = exp
    fallbacks = runs["batched"].executor.fallbacks
    stats_clients = 3 if algorithm == "heterofl" else 0  # one BN pass per client at the last round
    assert fallbacks == ({"no declared client program": stats_clients} if stats_clients else {})
    for a, b in zip(runs["sequential"].history, runs["batched"].history, strict=True):
        a, b = strip_timing(a), strip_timing(b)
        assert a["bytes_up"] == b["bytes_up"] and a["client_flops"] == b["client_flops"]
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    ga, gb = (runs[e].algo.global_model(runs[e].state)[0] for e in ("sequential", "batched"))
    for k in ga:
        if ga[k].is_floating_point():
            torch.testing.assert_close(gb[k], ga[k], rtol=1e-3, atol=1e-4, msg=k)


# ---- FedMR's baselines: FedExP, FedMut, FedSAM (algorithms/test_fedexp.py, test_fedmut.py, test_fedsam.py) ----
def baseline_cfg(**kw) -> RunConfig:
    """A FedAvg-family run on digits (6 clients, 4 per round, 3 rounds, MLP 64-16-10); ``kw`` overrides any key."""
    base = dict(
        dataset="digits", partition="dirichlet", model="mlp", clients=6, clients_per_round=4, rounds=3,
        local_epochs=1, batch_size=32, lr=0.05, seed=7, plots=False, out=None,
        model_options={"widths": [16]}, partition_options={"alpha": 0.5, "min_size": 20},
    )
    base.update(kw)
    return apply(RunConfig(), base)


BN_MODEL = dict(model="resnet9", model_options={"width_mult": 0.25})
"""A small ResNet with BatchNorm for the BN-statistics cases."""


def fake_state_results(model, k, seed=0, nbt_step=3):
    """``k`` replies: the model's state plus seeded noise, integer buffers stepped by ``nbt_step·(i+1)``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(k):
        s = {}
        for key, v in model.state_dict().items():
            s[key] = v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v + nbt_step * (i + 1)
        out[i] = Message(s, stats=FitStats(num_examples=10 + i))
    return out


# ---- the data tests' synthetic dataset (data/test_partition.py, data/test_federation.py) ----


def synthetic(
    n_train: int = 1000,
    n_test: int = 300,
    num_classes: int = 10,
    seed: int = 0,
    users: int | None = None,
    domains: int | None = None,
) -> Dataset:
    """Random 1×4×4 images with random labels (and optional users / domains)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    ds = Dataset(
        name="synthetic",
        task="classification",
        train_x=torch.randn(n_train, 1, 4, 4, generator=g),
        train_y=torch.randint(0, num_classes, (n_train,), generator=g),
        test_x=torch.randn(n_test, 1, 4, 4, generator=g),
        test_y=torch.randint(0, num_classes, (n_test,), generator=g),
        num_classes=num_classes,
        input_shape=(1, 4, 4),
    )
    if users:
        ds.train_groups = rng.integers(0, users, n_train)
        ds.test_groups = rng.integers(0, users, n_test)
    if domains:
        ds.train_domains = rng.integers(0, domains, n_train)
        ds.test_domains = rng.integers(0, domains, n_test)
    return ds


# ---- FedMR and recombination (algorithms/test_fedmr.py, fusion/test_recombine.py) ----


def random_states(model, k: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """K distinct 'trained' states: every float tensor perturbed, num_batches_tracked distinct per model."""
    g = torch.Generator().manual_seed(seed)
    base = model.state_dict()
    out = []
    for i in range(k):
        s = {}
        for key, v in base.items():
            if v.is_floating_point():
                s[key] = v + torch.randn(v.shape, generator=g)
            else:
                s[key] = v + 10 * (i + 1)
        out.append(s)
    return out


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def source_of(unit, out_state, inputs) -> int:
    hits = [i for i, s in enumerate(inputs) if all(same_tensor(out_state[k], s[k]) for k in unit)]
    assert len(hits) == 1, f"unit {unit[0]} matches inputs {hits}"
    return hits[0]


# ---- IFCA, FedEM, pFedMoE (algorithms/test_ifca.py, test_fedem.py, test_pfedmoe.py) ----


def mixture_cfg(algorithm: str, **kw) -> RunConfig:
    base = dict(
        dataset="digits", partition="label-cluster", model="mlp", clients=6, clients_per_round=3, rounds=2,
        batch_size=32, lr=0.1, local_epochs=1, seed=7, out=None, plots=False, algorithm=algorithm,
        model_options={"widths": [16]}, partition_options={"clusters": 3},
    )
    base.update(kw)
    return apply(RunConfig(), base)


def nparams(exp: Experiment) -> int:
    return sum(p.numel() for p in exp.ctx.model().parameters())


def nbytes(exp: Experiment) -> int:
    return sum(t.numel() * t.element_size() for t in exp.ctx.model().state_dict().values())


# ---- FedMA and the one-shot baselines (algorithms/test_fedma.py, test_oneshot.py) ----


def matching_cfg(algorithm, clients=3, rounds=1, model="mlp", model_options=None, **kw):
    base = dict(
        algorithm=algorithm, dataset="digits", partition="dirichlet", model=model, clients=clients,
        clients_per_round=clients, rounds=rounds, local_epochs=1, batch_size=32, lr=0.1, momentum=0.5, seed=1,
        plots=False, model_options=model_options or {"widths": [16, 12]},
        partition_options={"alpha": 0.5, "min_size": 20},
    )
    base.update(kw)
    return apply(RunConfig(), base)


def run_experiment(c):
    exp = experiment(c)
    exp.run()
    return exp


# ---- determinism, as every algorithm's file checks it ----
def check_same_seed_same_run(cfg: RunConfig, metric: str = "global_accuracy") -> None:
    """Two runs of ``cfg`` on one federation write the same metrics (all but wall-clock time), and ``metric`` is
    reported."""
    a = experiment(cfg)
    a.run()
    b = experiment(cfg, fed=a.fed)
    b.run()
    assert [strip_timing(h) for h in a.history] == [strip_timing(h) for h in b.history]
    assert a.history[-1][metric] is not None


def peer_cfg(**kw) -> RunConfig:
    """The serverless baselines' tiny run (D-PSGD, Dis-PFL): digits, 5 clients all active, 3 rounds, MLP 64-16-10."""
    base = dict(
        dataset="digits", partition="dirichlet", model="mlp", clients=5, clients_per_round=5, rounds=3,
        batch_size=32, lr=0.05, seed=2, plots=False, local_epochs=1, model_options={"widths": [16]},
        partition_options={"alpha": 0.5, "min_size": 20},
    )
    base.update(kw)
    return apply(RunConfig(), base)


def sampling_cfg(tmp_path, **kw) -> RunConfig:
    """The client-sampling tests' tiny run: digits, 8 clients, 3 per round, 3 rounds, MLP 64-16-10."""
    base = dict(
        dataset="digits", partition="dirichlet", model="mlp", clients=8, clients_per_round=3, rounds=3,
        batch_size=32, lr=0.05, seed=1, out=str(tmp_path / "run"), plots=False, local_epochs=1,
        model_options={"widths": [16]}, partition_options={"alpha": 0.3, "min_size": 15},
    )
    base.update(kw)
    return apply(RunConfig(), base)


def randomise_bn(model: nn.Module, gen: torch.Generator, tracked: int) -> None:
    """Non-trivial BN affine parameters and running statistics (and ``num_batches_tracked = tracked``), so a wrong
    permutation or average of them would show."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen))
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
                m.num_batches_tracked.fill_(tracked)


def check_disjoint(part, n: int, cover: bool) -> None:
    """A partition's clients hold disjoint, sorted int64 sample indices in [0, n) (all n of them with ``cover``)."""
    allidx = np.concatenate(part.train_indices)
    assert len(np.unique(allidx)) == len(allidx), "clients share samples"
    assert allidx.min() >= 0 and allidx.max() < n
    for idx in part.train_indices:
        assert idx.dtype == np.int64 and np.all(np.diff(idx) > 0)
    if cover:
        assert len(allidx) == n
