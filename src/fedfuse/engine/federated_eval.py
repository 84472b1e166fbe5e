"""Federated evaluation of the global model (``global_eval=federated``).

Every client evaluates the server's global model on its own test split and the run reports the size-weighted
mean of their results — Σ_i n_i·acc_i / Σ_i n_i over the clients with n_i > 0 test examples (tokens for a
language model), i.e. the accuracy and mean loss over the union of the clients' test splits — as
``global_accuracy`` / ``global_loss``.  This is what a server that holds no data (a Flower deployment, see
``docs/deploy.md``) can report, and the in-process run evaluates the same way, so the two agree round for round.

The global model travels with the evaluation payload every client receives anyway (its tensors under
:data:`PREFIX` unless the payload's tensors are the global model already, its architecture in the payload's
:data:`GLOBAL_META` entry), so an evaluation stays one message per client and sends no model twice;
:class:`GlobalEvaluation` wraps the client side that executors (and Flower nodes) run and splits it off again.
What the server learns is what personal evaluation already tells it: each client's test loss, accuracy and count.

A run whose federation holds no data (:attr:`fedfuse.types.Federation.holds_data` false) is checked by
:func:`check_server_data`: no server test set to evaluate on, no algorithm whose server rule needs data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fedfuse.engine.client import EvalStats, evaluate_model
from fedfuse.errors import ConfigError
from fedfuse.types import ClientData, Federation, Message, TensorDict

PREFIX = "fedfuse.global/"  # the global model's tensors inside an evaluation payload
GLOBAL_META = "fedfuse:global-eval"  # the payload's meta entry with the global model's meta (its architecture)
#: what a client's evaluation adds for the global model (beside the algorithm's own ``val_*``/``test_*``)
KEYS = ("global_test_loss", "global_test_accuracy", "global_test_count")


def _is_model(tensors: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor]) -> bool:
    """True when ``tensors`` are exactly the global ``model``'s (the same entries, the same values)."""
    return tensors.keys() == model.keys() and all(
        a is b or (a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b)))
        for a, b in ((tensors[k], model[k]) for k in model))


def with_global_model(payloads: Mapping[int, Message], model: tuple[TensorDict, Mapping[str, Any]]
                      ) -> dict[int, Message]:
    """Every evaluation payload with the global ``model`` (tensors, meta) attached: its tensors under
    :data:`PREFIX`, or none when the payload's tensors are the global model already (the default evaluation
    payload: nothing is sent twice).  A payload shared by several clients stays shared (it is encoded once on the
    Flower wire)."""
    tensors, meta = model
    glob = {PREFIX + k: v for k, v in tensors.items()}
    done: dict[int, Message] = {}
    out: dict[int, Message] = {}
    for c, msg in payloads.items():
        if id(msg) not in done:
            if any(k.startswith(PREFIX) for k in msg.tensors) or GLOBAL_META in msg.meta:
                raise ValueError(f"client {c}'s evaluation payload already uses {PREFIX!r}/{GLOBAL_META!r}")
            inside = _is_model(msg.tensors, tensors)
            done[id(msg)] = Message(dict(msg.tensors) if inside else {**msg.tensors, **glob},
                                    {**msg.meta, GLOBAL_META: {"meta": dict(meta), "in_payload": inside}}, msg.stats)
        out[c] = done[id(msg)]
    return out


def split_global(payload: Message) -> tuple[Message, tuple[TensorDict, dict[str, Any]] | None]:
    """The algorithm's own part of an evaluation payload and the global model it carries (None: it carries
    none; the payload is then returned as it is)."""
    if GLOBAL_META not in payload.meta:
        return payload, None
    about = payload.meta[GLOBAL_META]
    meta = {k: v for k, v in payload.meta.items() if k != GLOBAL_META}
    if about["in_payload"]:  # the payload's tensors are the global model
        return Message(dict(payload.tensors), meta, payload.stats), (dict(payload.tensors), dict(about["meta"]))
    own = {k: v for k, v in payload.tensors.items() if not k.startswith(PREFIX)}
    glob = {k[len(PREFIX):]: v for k, v in payload.tensors.items() if k.startswith(PREFIX)}
    return Message(own, meta, payload.stats), (glob, dict(about["meta"]))


def evaluate_global(ctx: Any, model: tuple[TensorDict, Mapping[str, Any]], data: ClientData) -> dict[str, float]:
    """:data:`KEYS` of the global ``model`` on the client's test split (count 0 and NaN metrics when it has none)."""
    tensors, meta = model
    st = EvalStats()
    if len(data.test):
        st = evaluate_model(ctx.load(tensors, meta), data.test, ctx.eval_batch_size)
    return {f"global_{k}": v for k, v in st.as_dict("test").items()}


class GlobalEvaluation:
    """The client side of an algorithm (the algorithm, or its :class:`~fedfuse.engine.personal.ClientSide`) that
    also evaluates the global model an evaluation payload carries (:func:`with_global_model`).  Everything else
    — ``fit``, ``client_program``, ``node_private`` ... — is the wrapped client side's."""

    def __init__(self, client: Any) -> None:
        self.inner = client

    def __getattr__(self, name: str) -> Any:
        if name == "inner" or name.startswith("__"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    # the client step, as the wrapped client side's own methods (a process pool keyed by the methods' owner keeps
    # one pool for training and evaluation)
    def client_program(self, payload: Message, client_state: Any, data: ClientData) -> Any:
        return self.inner.client_program(payload, client_state, data)

    def fit(self, payload: Message, client_state: Any, data: ClientData, gen: torch.Generator) -> Any:
        return self.inner.fit(payload, client_state, data, gen)

    def evaluate(self, payload: Message, client_state: Any, data: ClientData,
                 gen: torch.Generator) -> dict[str, float]:
        """The algorithm's evaluation of its own payload, plus :data:`KEYS` when the payload carries the global
        model (evaluated after it: the algorithm's evaluation sees exactly the payload it would without)."""
        own, model = split_global(payload)
        out = dict(self.inner.evaluate(own, client_state, data, gen))
        if model is not None:
            out.update(evaluate_global(self.inner.ctx, model, data))
        return out


def global_client_side(client: Any) -> Any:
    """``client`` wrapped in :class:`GlobalEvaluation` (once)."""
    return client if isinstance(client, GlobalEvaluation) else GlobalEvaluation(client)


def aggregate_global(res: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """``global_accuracy`` / ``global_loss``: the means of the clients' :data:`KEYS` weighted by their test counts
    (clients without test examples or without the keys do not count), and ``global_eval_clients``: how many
    clients' results they average (None metrics when no client had any)."""
    rows = [(float(v["global_test_accuracy"]), float(v["global_test_loss"]), int(v["global_test_count"]))
            for _, v in sorted(res.items()) if v.get("global_test_count")]
    n = sum(c for _, _, c in rows)
    if not n:
        return {"global_accuracy": None, "global_loss": None, "global_eval_clients": 0}
    return {"global_accuracy": math.fsum(a * c for a, _, c in rows) / n,
            "global_loss": math.fsum(lo * c for _, lo, c in rows) / n,
            "global_eval_clients": len(rows)}


def check_server_data(cfg: Any, fed: Federation, algo: Any, *, has_executor: bool = True) -> None:
    """Raise :class:`ConfigError` when run ``cfg`` cannot run on a federation without data (``fed.holds_data``
    false: a server that knows only the clients' sizes): evaluation on a server test set, an algorithm whose
    server rule needs data (its ``server_data`` says why), or clients that would have to run in this process
    (``has_executor`` false: no executor whose clients hold their own data, e.g. Flower's, was given)."""
    if fed.holds_data:
        return
    if cfg.global_eval == "server":
        raise ConfigError("global_eval=server: the server holds no data, so it has no test set; set "
                          "global_eval=federated (the clients evaluate the global model) or none")
    why = algo.server_data
    if why:
        raise ConfigError(f"algorithm {cfg.algorithm!r} cannot run on a server without data: {why}")
    if not has_executor:
        raise ConfigError("a federation without data (only the clients' sizes) runs only on clients that hold their "
                          "own data: pass an executor such as Flower's")


__all__ = ["GLOBAL_META", "KEYS", "PREFIX", "GlobalEvaluation", "aggregate_global", "check_server_data",
           "evaluate_global", "global_client_side", "split_global", "with_global_model"]
