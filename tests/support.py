"""Helpers shared by several test files (``tests/`` is on ``sys.path`` through ``conftest.py``): the repository's
paths, the conformance suite's tiny run per algorithm and FedMR's tiny run."""

from __future__ import annotations

from pathlib import Path

from fedfuse.algorithms import ALGORITHMS
from fedfuse.config import RunConfig, apply
from golden.make_golden import lora_base

ROOT = Path(__file__).resolve().parent.parent
"""The repository (worktree) root."""
SHARED_DATA = ROOT.parent / "shared" / "data"
"""Shared datasets beside the repository (``../shared/data``)."""


LORA = {name for name, cls in ALGORITHMS.items() if cls.__module__ in ("fedfuse.algorithms.fedit",
                                                                       "fedfuse.algorithms.fedmerge_lora")}
_BASE: dict[str, str] = {}


def _lora_base() -> str:
    """A tiny frozen base (fedfuse transformer, vocabulary 30) for the LoRA algorithms, written once."""
    if "path" not in _BASE:
        _BASE["path"] = lora_base()
    return _BASE["path"]


def conformance_cfg(algorithm: str, executor: str) -> RunConfig:
    """A tiny run of ``algorithm`` under ``executor``: digits + MLP, or generated token sequences + a transformer
    for Simple-FedMA and the LoRA algorithms (the conformance, options-act and Flower suites share it)."""
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
        algorithm=algorithm, dataset="digits", model="mlp", clients=4, clients_per_round=3, rounds=2,
        batch_size=32, lr=0.05, seed=1, plots=False, executor=executor, local_epochs=1, eval_every=2,
        model_options={"widths": [16]}, partition_options={"alpha": 1.0, "min_size": 20},
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
