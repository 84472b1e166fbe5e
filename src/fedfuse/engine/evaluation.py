"""Evaluation: the global model on the global test set and every client's own model on its own splits, and the
means the round record reports (:func:`aggregate_client_metrics`).

The round loop calls :func:`evaluate` on evaluation rounds (every ``eval_every`` rounds and the last one).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from fedfuse.config import RunConfig
from fedfuse.engine.client import evaluate_model
from fedfuse.engine.context import ClientState, RoundInfo, RunContext, ServerState
from fedfuse.engine.contract import Algorithm, Executor, Job
from fedfuse.engine.federated_eval import aggregate_global, with_global_model
from fedfuse.engine.personal import outgoing
from fedfuse.types import Federation


class Evaluated(Protocol):
    """What :func:`evaluate` reads of a run (:class:`fedfuse.engine.loop.Experiment` has it)."""

    cfg: RunConfig
    fed: Federation
    ctx: RunContext
    algo: Algorithm
    client: Any  # the client side executors run (engine/personal.py)
    state: ServerState
    client_states: dict[int, ClientState]
    executor: Executor


def evaluate(run: Evaluated, r: int) -> dict[str, Any]:
    """Round ``r``'s evaluation of ``run``: the global model on the global test set (``global_eval=server``) or on
    every client's own test split (``federated``: the size-weighted mean of their results,
    engine/federated_eval.py); every client's personal model on its own splits (through the run's executor)."""
    out: dict[str, Any] = {"global_accuracy": None, "global_loss": None}
    g = run.algo.global_model(run.state)
    if g is not None and run.cfg.global_eval == "server":
        model = run.ctx.load(g[0], g[1])
        st = evaluate_model(model, run.fed.test, run.cfg.eval_batch_size)
        out["global_accuracy"], out["global_loss"] = st.accuracy, st.loss
    everyone = list(range(run.fed.num_clients))
    payloads = outgoing(run.client, run.algo.configure_evaluate(run.state, everyone))
    federated = g is not None and run.cfg.global_eval == "federated"
    if federated:  # the global model rides along each client's evaluation payload
        payloads = with_global_model(payloads, g)
    jobs = [Job(c, payloads[c], run.client_states.get(c), ("evaluate", r, 0)) for c in everyone]
    res = dict(sorted(run.executor.map(run.client.evaluate, jobs).items()))
    out.update(aggregate_client_metrics(res))
    if federated:
        out.update(aggregate_global(res))
    out["loss"] = out["global_loss"] if out["global_loss"] is not None else out["personal_loss"]
    if run.fed.task == "lm":
        out["perplexity"] = _exp(out["loss"])
        out["personal_perplexity"] = _exp(out["personal_loss"])
    out.update(run.algo.diagnostics(run.state, run.fed, RoundInfo(index=r, total=run.cfg.rounds)))
    return out


def aggregate_client_metrics(res: dict[int, dict[str, float]]) -> dict[str, Any]:
    """Unweighted and sample-weighted means of the clients' personal test metrics; weighted val loss."""
    if not res:
        return {}
    vals = list(res.values())

    def wmean(key: str, count: str) -> float | None:
        n = sum(v[count] for v in vals if v[count])
        return sum(v[key] * v[count] for v in vals if v[count]) / n if n else None

    def umean(key: str, count: str) -> float | None:
        xs = [v[key] for v in vals if v[count]]
        return float(np.mean(xs)) if xs else None

    out = {
        "personal_accuracy": umean("test_accuracy", "test_count"),
        "personal_accuracy_weighted": wmean("test_accuracy", "test_count"),
        "personal_loss": wmean("test_loss", "test_count"),
        "val_loss": wmean("val_loss", "val_count"),
        "val_accuracy": wmean("val_accuracy", "val_count"),
    }
    out["clients_without_test"] = sum(1 for v in vals if not v["test_count"])  # not in the personal means
    out["client_test_accuracy"] = {str(c): v["test_accuracy"] for c, v in res.items()}
    extra = sorted({k for v in vals for k in v if k.startswith("test_")} - {"test_loss", "test_accuracy", "test_count"})
    for key in extra:  # further per-client test metrics (e.g. ROUGE-1): unweighted mean over the clients reporting it
        xs = [float(v[key]) for v in vals if key in v and v[key] is not None and math.isfinite(float(v[key]))]
        out["personal_" + key[5:]] = float(np.mean(xs)) if xs else None
    return out


def _exp(x: float | None) -> float | None:
    return None if x is None else float(math.exp(min(x, 700.0)))
