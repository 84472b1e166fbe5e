"""What the algorithms whose server update is a mean of client deltas share: the privacy mechanisms they wear.

An algorithm that subclasses :class:`DeltaMean` and declares ``server_update = MeanOfDeltas(...)``
(:mod:`fedfuse.privacy.mean`) writes its plain server rule (:meth:`DeltaMean.fuse`) and four small hooks:

* :meth:`~DeltaMean.delta_base` / :meth:`~DeltaMean.server_base` — the base b the deltas are taken from, read by
  a client from its payload and by the server from its state (the same tensors: the model, or SCAFFOLD's model
  and zeros for its Δc entries);
* :meth:`~DeltaMean.delta_weight` — a client's weight w_i in the plain mean (n_i, or 1);
* :meth:`~DeltaMean.step_on_mean` — its server step from ``mean = b + Σ w_i·Δ_i / D`` and the denominator D.

It then admits central DP and secure aggregation without code of its own: under ``dp=central``
:meth:`~DeltaMean.aggregate_fit` forms the mean with :class:`~fedfuse.privacy.central.CentralDP` (clip → noised
sum → fixed denominator m; every round releases one, an empty one included), under ``secagg=true``
:meth:`~DeltaMean.secure_contribution` and :meth:`~DeltaMean.aggregate_sum` compute the same sum with
:class:`~fedfuse.privacy.mean.SecureSum`, and both together noise the decoded sum; the step that follows is the
algorithm's own.  Its privacy declaration is derived from the same facts (:func:`derived_privacy`): the server
sees nothing individual, central DP and SecAgg are admitted, and local DP is admitted exactly when the client step
is plain SGD on the task loss (the engine's DP-SGD wrapper, :class:`fedfuse.engine.local_dp.LocalDPClient`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from fedfuse.algorithms.base import Algorithm, RoundInfo, RunContext, ServerState
from fedfuse.errors import UserError
from fedfuse.privacy.central import CentralDP
from fedfuse.privacy.mean import MeanOfDeltas, SecureSum
from fedfuse.types import Message, Privacy, ServerView, TensorDict, not_built, yes

__all__ = ["DeltaMean", "MeanOfDeltas", "derived_privacy", "plain_client_step"]

#: hooks that change what the server update reads or does: a subclass overriding one without declaring
#: ``server_update`` or ``privacy`` again has no privacy entry (its parent's no longer describes it)
RULE_HOOKS = ("fuse", "aggregate_fit", "step_on_mean", "delta_base", "server_base", "delta_weight", "configure_fit",
              "secure_contribution", "aggregate_sum", "stays_local")
#: hooks of the client step: a subclass overriding one gets its entry derived again (local DP follows the step)
STEP_HOOKS = ("fit", "client_program", "loss_terms")


def plain_client_step(cls: type[Algorithm]) -> str | None:
    """None when ``cls``'s client step is the standard program (plain SGD on the task loss: no loss term, no own
    program, no own ``fit``), else what makes it more (for the derived local-DP reason)."""
    for hook, what in (("fit", "is its own fit"), ("client_program", "is its own program"),
                       ("loss_terms", "adds loss terms to the task loss")):
        if getattr(cls, hook) is not getattr(Algorithm, hook):
            return what
    return None


def derived_privacy(cls: type[DeltaMean]) -> Privacy:
    """The privacy entry of a :class:`DeltaMean` class from its declaration ``server_update`` and its client step:
    the server needs only sums; central DP and SecAgg are the shared mechanisms; local DP wraps a plain client
    step (``local_dp_why`` is the algorithm's own reason when its step is not plain)."""
    rule = cls.server_update
    if rule is None:
        raise TypeError(f"{cls.__name__} declares no server_update to derive its privacy entry from")
    ones = f" (the {', '.join(p + '*' for p in rule.unweighted)} entries with weight 1)" if rule.unweighted else ""
    note = f"; {rule.note}" if rule.note else ""
    why = f"a mean of client deltas ({rule.releases}): the sums Σ w_i·Δ_i and Σ w_i suffice{note}"
    central = yes(f"derived (mean of deltas): the shared mechanism clips each {rule.releases} as one vector, adds "
                  "Gaussian noise to the sum, divides by m; the server step on the noised mean is post-processing")
    secagg = yes(f"derived (mean of deltas): each client masks w_i·Δ_i{ones} and w_i; the server decodes only the "
                 "sums (SecAgg/SecAgg+)")
    step = plain_client_step(cls)
    local = (yes("derived: the client step is plain SGD on the task loss, which DP-SGD through Opacus wraps "
                 "(BN-free models)") if step is None else
             not_built(cls.local_dp_why or f"derived: the client step {step}; DP-SGD through Opacus wraps plain SGD "
                                           "on the task loss only"))
    return Privacy(ServerView.NOTHING_INDIVIDUAL, why, central_dp=central, local_dp=local, secagg=secagg)


class DeltaMean(Algorithm):
    """An algorithm whose server update is a (weighted) mean of client deltas followed by its own step; see the
    module docstring.  A subclass that declares ``server_update`` and no ``privacy`` of its own gets the derived
    entry; one that declares ``privacy`` itself states in prose what it admits (its own ``fuse`` may not be a
    mean, e.g. FedExP's step size), and the mechanisms here refuse to run where that entry does not admit them."""

    #: the form of the server update (:class:`~fedfuse.privacy.mean.MeanOfDeltas`); a subclass re-declares it
    server_update: ClassVar[MeanOfDeltas | None] = None
    #: the reason local DP is not built when the client step is not plain (None: the derived reason)
    local_dp_why: ClassVar[str | None] = None

    def __init__(self, ctx: RunContext, options: Any | None = None) -> None:
        super().__init__(ctx, options)
        why = self.reads_each_update()
        if why and ctx.dp.central:
            raise UserError(f"dp=central replaces the mean with DP-FedAvg's clipped, noised mean, but {why}; drop "
                            "them (use dp_clip)")
        if why and ctx.secagg:
            raise UserError(f"secagg=true hands the server only the sum of the updates, but {why}; drop them (or "
                            "secagg)")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Derive the entry of a class that declares ``server_update``; a subclass that declares neither it nor
        ``privacy`` keeps its parent's entry only while it changes neither the server rule (then it has none, so
        every mechanism is refused until it declares one: the inherited entry would describe another rule) nor the
        client step (then the entry is derived again)."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if "privacy" in own:
            return
        if "server_update" in own:
            cls.privacy = (derived_privacy(cls),)
        elif any(h in own for h in RULE_HOOKS):
            cls.privacy = ()
        elif any(h in own for h in STEP_HOOKS) and cls.server_update is not None and cls.privacy:
            cls.privacy = (derived_privacy(cls),)

    # ---- the algorithm's hooks ------------------------------------------------------------------------------
    def fuse(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        """The plain server rule (no privacy mechanism) on the round's replies."""
        raise NotImplementedError

    def delta_base(self, payload: Message) -> TensorDict:
        """**Client side**: the base the deltas are taken from, as the payload carries it (default: the payload)."""
        return dict(payload.tensors)

    def server_base(self, state: ServerState) -> TensorDict:
        """**Server side**: the same base, from the server state (default: the global model)."""
        return state["global"]

    def delta_weight(self, reply: Message) -> float:
        """A client's weight w_i in the plain mean (default 1)."""
        return 1.0

    def reads_each_update(self) -> str | None:
        """Why this run's options make the plain rule read each update (then no mechanism applies), or None."""
        return None

    def step_on_mean(self, state: ServerState, info: RoundInfo, mean: TensorDict, denominator: float,
                     replies: int | None) -> ServerState:
        """The server step from ``mean`` = b + Σ w_i·Δ_i / ``denominator`` (``replies``: how many clients' deltas
        it holds, when the server knows it)."""
        raise NotImplementedError

    # ---- the mechanisms it wears ----------------------------------------------------------------------------
    def _admitted(self, mechanism: str) -> MeanOfDeltas:
        rule = type(self).server_update
        entry = self.privacy_for(self.opt)
        if rule is None or entry is None or not entry.admits(mechanism).ok:
            raise UserError(f"{self.name} does not admit {mechanism} (see its privacy entry)")
        why = self.reads_each_update()
        if why:
            raise UserError(f"{mechanism}: {why}, which the mechanism hides")
        return rule

    @property
    def central_dp(self) -> CentralDP:
        """The run's central-DP step (clip → noised sum → fixed denominator m), one per algorithm instance."""
        mech = self.__dict__.get("_central_dp")
        if mech is None:
            mech = self.__dict__["_central_dp"] = CentralDP(self.ctx.dp, self.ctx.clients_per_round, self.ctx.seed)
        return mech

    @property
    def secure_sum(self) -> SecureSum:
        """Secure aggregation of this update's sum (with central DP's clipping and centred count under
        ``dp=central``)."""
        mech = self.__dict__.get("_secure_sum")
        if mech is None:
            central = self.central_dp if self.ctx.dp.central else None
            mech = self.__dict__["_secure_sum"] = SecureSum(self._admitted("secagg"), central)
        return mech

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        """The broadcast; under central DP it carries the clip (clients clip themselves under SecAgg)."""
        payloads = super().configure_fit(state, info, clients)
        if not self.ctx.dp.central:
            return payloads
        meta = self.central_dp.meta(state)
        shared: dict[int, Message] = {}
        return {c: shared.setdefault(id(m), Message(m.tensors, {**m.meta, **meta}, m.stats))
                for c, m in payloads.items()}

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        """The plain rule, or under central DP the mechanism's noised mean of the replies (noise around the base
        when there is none: every round releases a noised aggregate) and the algorithm's step on it."""
        if not self.ctx.dp.central:
            return self.fuse(state, info, results)
        self._admitted("central_dp")
        mean, record = self.central_dp.mean(state, self.server_base(state), [r.tensors for r in results.values()],
                                            info.index, info.stage)
        out = self.step_on_mean(state, info, mean, float(self.central_dp.per_round), len(results))
        return {**out, "dp": record}

    def secure_contribution(self, sent: Message, reply: Message) -> TensorDict:
        """**Client side** of secure aggregation: :meth:`SecureSum.contribution` of this client's delta."""
        return self.secure_sum.contribution(self.delta_base(sent), reply.tensors, self.delta_weight(reply), sent.meta)

    def aggregate_sum(self, state: ServerState, info: RoundInfo, total: TensorDict) -> ServerState:
        """**Server side** of secure aggregation: the mean from the decoded sum alone, then the algorithm's step
        (a sum of zero weight without DP leaves the state as it is)."""
        mean, denominator, record = self.secure_sum.mean(state, self.server_base(state), total, info.index,
                                                         info.stage)
        if mean is None:
            return state
        out = self.step_on_mean(state, info, mean, denominator, None)
        return out if record is None else {**out, "dp": record}
