"""The algorithm contract: everything an algorithm may do, declared on :class:`Algorithm`.

An algorithm is a subclass of :class:`Algorithm` with a ``name``, a ``description``, an ``Options`` dataclass
and the hooks it overrides.  The engine owns the round loop and never names an algorithm; it calls every hook
below unconditionally (each has a working default here), so this file is the whole contract.  The engine sees
an algorithm through the protocol :class:`fedfuse.engine.contract.Algorithm`, which lists the same members.

Class attributes (declarations the engine reads):
    ``name``, ``description`` — registry name and one-line description (``fedfuse list``);
    ``Options`` — a dataclass of the options ``--set key=value`` may change (``fedfuse.options.opt``);
    ``accepts_late`` — a reply from an earlier round can join a later fusion (``late_replies=next-round``);
    ``default_sampling`` — the client sampler ``sampling: auto`` uses;
    ``echo_meta`` — payload meta keys copied into the reply's meta before fusion (what the server sent);
    ``reply_kind`` — ``"state"`` / ``"delta"`` / ``"other"`` / ``None``: what a reply is, for the update checks;
    ``node_private`` — client-state entries that never leave a Flower node;
    ``stays_local`` — the model entries that are every client's own (:class:`StaysLocal`; personalisation):
    the engine takes them out of payloads and replies, keeps them in the client's state and merges them back
    for its step and its evaluation (:mod:`fedfuse.engine.personal`), under every executor;
    ``requires`` — what the algorithm needs of a model (``"batchnorm"``, ``"head"``, ``"features"``; checked
    when it is built, and the conformance suite picks a model that has it);
    ``privacy`` — what the server must see and which of central DP, local DP and SecAgg apply (config checks).

Hooks in round order (server side may read and return server state; client side is pure: a function of the
payload, the client's own persistent state, its data and a generator, never of server state):
    once:       ``setup(fed)`` → ``init_state()`` → ``init_client_state(cid)`` for every client
    each round: ``select_clients(info, rng)`` → for each of ``num_stages(state, info)`` stages:
                ``configure_fit`` → [clients: ``client_program`` (declared step), else ``fit``] →
                ``reply_shapes`` (update checks) → ``exchange`` → ``aggregate_fit``
    evaluation: ``global_model`` → ``configure_evaluate`` → [clients: ``evaluate``] → ``diagnostics``;
                ``server_parameters`` for the accounting
    at the end: ``finish(state, fed, out_dir)``

The client step is best *declared*: ``client_program`` returns a :class:`~fedfuse.engine.program.ClientProgram`
(model, initial state, the local settings ``ctx.train``, a ``loss(batch)`` plus ``terms`` — the batch may carry
the model's features —, constant ``refs``, an optional gradient ``transform``, and ``finalize``), and every
executor (sequential, batched, worker processes, Flower) trains it.  The default is the standard step: the
payload model, cross-entropy plus :meth:`Algorithm.loss_terms`, the full trained state as the reply.  An
algorithm that overrides ``fit`` instead has an opaque client step (executors call it as is).

A round may have several *stages* (FedMA matches one layer per stage); ``RoundInfo.stage`` says which.
Only ``diagnostics`` and ``finish`` see the partition's ground truth (``fed.groups()``); every other hook gets
the blinded federation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from fedfuse.engine.client import EvalStats, TrainConfig, TrainStats, evaluate_model, train_flops_per_sample
from fedfuse.engine.context import ClientState, RoundInfo, RunContext, ServerState, state_of
from fedfuse.engine.local_dp import check_local_dp
from fedfuse.engine.personal import StaysLocal, check_requirements
from fedfuse.engine.program import ClientProgram, LossTerm, run_program
from fedfuse.types import ClientData, Federation, FitStats, Message, Privacy, TensorDict, privacy_entry

__all__ = ["Algorithm", "ClientState", "RoundInfo", "RunContext", "ServerState", "StaysLocal", "evaluate_splits",
           "state_of"]


class Algorithm:
    """Base class of every algorithm; subclasses set ``name``, ``description`` and optionally ``Options``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    accepts_late: ClassVar[bool] = False
    default_sampling: ClassVar[str] = "uniform"
    echo_meta: ClassVar[tuple[str, ...]] = ()
    reply_kind: ClassVar[str | None] = None  # None: the round's replies vote (keys a subset of the payload's)
    node_private: tuple[str, ...] = ()  # may be a property when it depends on the options
    #: Why the server rule needs a dataset on the server (None: it needs none).  A server that holds no data (a
    #: deployed one, ``global_eval`` federated or none) refuses such a run with this reason.  May be a property
    #: when it depends on the options.
    server_data: str | None = None
    #: the optional extras a run needs (``pip install 'fedfuse[EXTRA]'``, :mod:`fedfuse.extras`), checked before
    #: the run loads any data
    extras: ClassVar[tuple[str, ...]] = ()
    #: What the server must see and which of central DP, local DP and SecAgg apply, with a reason each
    #: (:class:`fedfuse.types.Privacy`; the default entry first, option-dependent variants after it).  Every
    #: registered algorithm declares its own (tests/system/test_privacy_table.py); docs/privacy.md is generated
    #: from them.
    privacy: ClassVar[tuple[Privacy, ...]] = ()
    #: The model entries that stay on the client (each client's own: never sent, never returned, merged from its
    #: state for its step and its evaluation); ``None``: the whole model is shared.  May be a property when it
    #: depends on the options.  An algorithm with entries of its own has no single model to test globally:
    #: :meth:`global_model` is ``None`` by default and clients evaluate the shared entries with their own.
    stays_local: ClassVar[StaysLocal | None] = None
    #: What the algorithm needs of a model (``fedfuse.engine.personal.REQUIREMENTS``: ``"batchnorm"``,
    #: ``"head"``, ``"features"``); a model without it is refused when the algorithm is built.
    requires: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def privacy_for(cls, options: Any = None) -> Privacy | None:
        """The declared :class:`Privacy` entry for ``options`` (the algorithm's defaults when ``None``)."""
        return privacy_entry(cls.privacy, options if options is not None else cls.Options())

    @dataclass
    class Options:
        pass

    def __init__(self, ctx: RunContext, options: Any | None = None) -> None:
        self.ctx = ctx
        self.opt = options if options is not None else self.Options()
        if self.requires:
            check_requirements(self.name or type(self).__name__, ctx.model(), self.requires)
        if ctx is not None and ctx.dp.local:  # dp=local: Opacus must clip per-sample grads
            check_local_dp(ctx.model())

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that overrides ``fit`` without declaring its own ``client_program`` has a custom client step:
        it must not inherit a parent's program (Dis-PFL's masked step is not D-PSGD's), so it declares none."""
        super().__init_subclass__(**kwargs)
        if "fit" in cls.__dict__ and "client_program" not in cls.__dict__:
            cls.client_program = Algorithm._no_program  # type: ignore[method-assign]

    def _no_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram | None:
        return None

    # ---- options -------------------------------------------------------------------------------
    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
                for f in dataclasses.fields(cls.Options)}

    # ---- once, before the first round -----------------------------------------------------------
    def setup(self, fed: Federation) -> Federation:
        """The federation the run uses, given the blinded one (no ground truth).  Return another federation to
        hold data aside for the server (Fed-ET keeps a public set); the default returns ``fed`` itself."""
        return fed

    # ---- server hooks --------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        """Initial server state: named tensors and plain data (checkpointed as is)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.ctx.seed)
            return {"global": state_of(self.ctx.build())}

    def init_client_state(self, cid: int) -> ClientState:
        """Persistent per-client state (kept by the engine, or by the client process under Flower)."""
        return None

    def num_stages(self, state: ServerState, info: RoundInfo) -> int:
        """How many configure → fit → aggregate stages this round has (FedMA: one per layer)."""
        return 1

    @property
    def selects_own_clients(self) -> bool:
        """Whether this algorithm overrides :meth:`select_clients` with its own participation rule (the engine's
        samplers then stand aside; read by :func:`fedfuse.engine.sampling.make_sampler`)."""
        return type(self).select_clients is not Algorithm.select_clients

    def select_clients(self, info: RoundInfo, rng: np.random.Generator) -> list[int]:
        """Uniform sampling without replacement of ``clients_per_round`` clients (sorted)."""
        n, k = self.ctx.num_clients, min(self.ctx.clients_per_round, self.ctx.num_clients)
        return sorted(int(c) for c in rng.choice(n, size=k, replace=False))

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        """The payload of every client taking part in this stage (default: the global model)."""
        msg = Message(state["global"])
        return {c: msg for c in clients}

    def reply_shapes(self, cid: int, reply: Message) -> dict[str, tuple[int, ...]]:
        """Shapes a reply's tensors must have, known from its meta (MSfusion: a sub-model's shape follows its
        selection); the update checks compare these keys with it instead of a majority vote.  Default: none."""
        return {}

    def exchange(self, info: RoundInfo, results: dict[int, Message]) -> tuple[dict[int, Message], int]:
        """Client-to-client messages after local work (peer protocols); returns results and bytes moved."""
        return results, 0

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        """The new server state from the stage's replies (sorted by client id, screened).  Every algorithm
        defines it."""
        raise NotImplementedError

    # ---- secure aggregation (secagg=true; fedfuse.privacy.secure) -----------------------------------------------
    def secure_contribution(self, sent: Message, reply: Message) -> TensorDict:
        """**Client side** of secure aggregation: what this client adds to the round's masked sum, from the payload
        it was sent and its own reply (one layout for every client).  An algorithm whose update is a mean of deltas
        gets it from :class:`fedfuse.algorithms.mean_base.DeltaMean` (``server_update``); the engine then calls
        :meth:`aggregate_sum` instead of :meth:`aggregate_fit`."""
        raise NotImplementedError(f"{self.name} does not admit secure aggregation (see its privacy entry)")

    def aggregate_sum(self, state: ServerState, info: RoundInfo, total: TensorDict) -> ServerState:
        """**Server side** of secure aggregation: the new state from the decoded sum of the contributions alone."""
        raise NotImplementedError(f"{self.name} does not admit secure aggregation (see its privacy entry)")

    def global_model(self, state: ServerState) -> tuple[TensorDict, dict[str, Any]] | None:
        """The model evaluated on the global test set (tensors, meta), or None if there is none (the default
        when entries stay local: no one model is the run's)."""
        return None if self.stays_local is not None else (state["global"], {})

    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]:
        """What every client evaluates (default: the global model, or an empty message without one; with entries
        that stay local, ``state["global"]``, whose shared entries each client completes with its own)."""
        g = self.global_model(state)
        if g is None and self.stays_local is not None:
            g = state["global"], {}
        msg = Message() if g is None else Message(g[0], dict(g[1]))
        return {c: msg for c in clients}

    def server_parameters(self, state: ServerState) -> int:
        """Model parameters the server holds (buffers excluded; with entries that stay local, the shared ones)."""
        g = self.global_model(state)
        if g is None and self.stays_local is not None:
            own = self.stays_local.keys(self.ctx.model())
            g = {k: v for k, v in state["global"].items() if k not in own}, {}
        if g is None:
            return 0
        keys = self.ctx.param_keys(g[1])
        return int(sum(v.numel() for k, v in g[0].items() if k in keys))

    # ---- client hooks --------------------------------------------------------------------------
    def fit(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> tuple[Message, ClientState]:
        """Default client step: run the declared :meth:`client_program` (train the received model locally
        and send back its full state).  Executors that own the training loop call ``client_program``
        directly; this is the reference (sequential) execution of the same program."""
        program = self.client_program(payload, client_state, data)
        if program is None:
            raise NotImplementedError(f"{type(self).__name__} declares no client program and no fit")
        return run_program(program, data, gen)

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram | None:
        """The client step as a declared program, or ``None`` when ``fit`` is custom (then executors call it).

        The base program is the standard step: start from the payload, minimise the task loss plus
        :meth:`loss_terms` with the run's local spec, reply with the full trained state and the standard
        metadata.  Subclasses that override ``fit`` get ``None`` unless they also override this method.
        """
        return self.standard_program(payload, client_state, data)

    def loss_terms(self, payload: Message) -> tuple[tuple[LossTerm, ...], TensorDict]:
        """Declared additions to the task loss of the standard step and the reference tensors they read."""
        return (), {}

    def standard_program(
        self, payload: Message, client_state: ClientState, data: ClientData, *, spec: TrainConfig | None = None
    ) -> ClientProgram:
        """Train the payload model with the task loss (plus :meth:`loss_terms`) and send its full state."""
        model = self.ctx.model(payload.meta)
        terms, refs = self.loss_terms(payload)

        def finalize(state: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            return Message(state, stats=self.fit_stats(model, data, stats)), client_state

        return ClientProgram(model=model, init=dict(payload.tensors), spec=spec or self.ctx.train,
                             finalize=finalize, terms=terms, refs=refs)

    def evaluate(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> dict[str, float]:
        """Default personalised evaluation: the received model on the client's val and test splits."""
        model = self.ctx.load(payload.tensors, payload.meta)
        return evaluate_splits(model, data, self.ctx.eval_batch_size)

    # ---- evaluation rounds and the end of the run -------------------------------------------------
    def diagnostics(self, state: ServerState, fed: Federation, info: RoundInfo) -> dict[str, Any]:
        """Extra metrics merged into an evaluation round's record (FedMerge's ARI, FedMR's model similarity).
        Gets the full federation, ground truth included; may write plots to ``ctx.out_dir``.  Default: none."""
        return {}

    def finish(self, state: ServerState, fed: Federation, out_dir: Path | None) -> None:
        """End-of-run artefacts written to ``out_dir`` (heat-maps, tables); ``None`` when the run writes
        nothing.  Default: nothing."""

    # ---- shared client helpers -----------------------------------------------------------------
    def fit_stats(self, model: nn.Module, data: ClientData, stats: TrainStats) -> FitStats:
        """The standard record of one local training of ``model`` on ``data.train``: FLOPs from a profiled
        step times the samples processed, and every parameter that requires grad as trained."""
        flops = 0.0
        if stats.samples and len(data.train):
            flops = train_flops_per_sample(model, data.train.x, data.train.y, key=(self.ctx.model_name,))
        return FitStats(
            num_examples=len(data.train),
            samples=int(stats.samples),
            steps=int(stats.steps),
            train_loss=float(stats.mean_loss),
            flops=float(flops * stats.samples),
            trained_params=int(sum(p.numel() for p in model.parameters() if p.requires_grad)),
        )


def evaluate_splits(model: nn.Module, data: ClientData, batch_size: int = 512, predict=None) -> dict[str, float]:
    """``val_*`` and ``test_*`` loss/accuracy/count of ``model`` on a client's own splits."""
    out: dict[str, float] = {}
    for name, split in (("val", data.val), ("test", data.test)):
        st = evaluate_model(model, split, batch_size, predict) if len(split) else EvalStats()
        out.update(st.as_dict(name))
    return out
