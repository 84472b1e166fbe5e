"""MSfusion (2024): collaborative training of a large model by peers that each train a *slice* of it.

Paper: "MSfusion: A Dynamic Model Splitting Approach for Resource-Constrained Machines to Collaboratively
Train Larger Models" (§4.1 DSS Eq. 3-4, §4.2 overlap aggregation Eq. 5 and dynamic overlap Eq. 6, §4.3
contrastive objective Eq. 7-8, Algorithm 1, App. A.2).  No public code exists; this is a reading of the paper.

Per round r, participant n (all N participants active, no central server):

1. **DSS** (Eq. 3-4): in every hidden unit group i of size K_i it holds the ⌊μ_n K_i⌋ consecutive units from
   G_{n,i,r} = ⌊n·K_i·c/N⌋ + r·ζ (mod K_i, wrapping).  ``c`` follows Eq. 6, updated when r mod 10 = 0:
   c = c0·(1 − (r/R)·p).  Input and output layers are never split (see :mod:`fedfuse.fusion.slicing`).
   **R defaults to the paper's 500 rounds** (``schedule_rounds``), so c follows the paper's schedule round by
   round whatever the run's length; ``schedule_rounds=0`` compresses the whole schedule into the run instead.
   Compressed into a short run, c falls early, the windows jump and coverage and accuracy drop (measured in
   ``docs/msfusion.md``); on the paper's time scale c has fallen only to 0.97 by round 20.
2. **Overlap aggregation** (Eq. 5): every element of its round-r sub-model becomes the average over itself and
   the *connected* peers (``topology`` full | ring) holding it.  Interpretation: "holding" = having a trained
   value for it, i.e. having held it in round r−1.  So each peer m sends n exactly the elements of its trained
   round-(r−1) sub-model that lie in n's round-r sub-model — the overlap *and* the round-gap parameters ζ brings
   in (Algorithm 1's "receive round gap model parameter") travel in one message.  An element no connected peer
   and not n itself held in round r−1 takes the last value n knows for it: n keeps a full-size memory of its
   latest trained values (W⁰, the common initial model, where it never trained the element), so nothing
   trained is lost when the window moves on and comes back.
3. **Local training** of the aggregated sub-model w*_n (a real smaller ``nn.Module``) for one epoch with
   L = CE + λ·ℓ_con (Eq. 8).  Interpretation of Algorithm 1 (MOON-style): the model being trained starts from
   w*_n; z* comes from w*_n frozen; z^{r−1} from n's trained sub-model of the previous round (frozen), both
   restricted to the penultimate units common to the current and previous sub-model (LMs: the unsplit
   d_model representation of every token).  When Eq. 6 changes c the window can jump past the previous one;
   with no common unit the term is skipped for that round (counted as ``contrastive_skipped``).
   Similarity: ``"cosine"`` (default) is the form of MOON's code, which Eq. 7 cites; ``"dot"`` is Eq. 7 as
   printed.  With the raw dot product the term is unbounded, the features grow and the training loss rises
   (measured in ``docs/msfusion.md``), so cosine is the default and dot an option.
   ℓ_con = softplus((s(ẑ, z^{r−1}) − s(ẑ, z*))/τ), the stable form of Eq. 7.
4. Learning rate: a triangular CyclicLR with one cycle over all rounds (App. A.2.2) whose *peak* is the run's
   ``--lr`` and whose floor is ``lr_min_ratio · lr`` (paper: 0.001 → 0.0012, ratio 1/1.2);
   ``lr_schedule="constant"`` uses ``--lr`` every round.  No option replaces the run's learning rate.

Simulation mapping onto the engine's hooks: ``fit`` returns ``sim/peer/{m}/...`` (what n sends to peer m for the
next round) and ``sim/own/...`` (its whole trained sub-model, collected by the *simulation* only to assemble the
global full model for evaluation — the paper's "Global Model Combination", not needed for training).  The
``exchange`` hook routes the peer tensors and counts them as ``bytes_peer`` (the protocol's traffic, each
transmission once); the next round's ``configure_fit`` hands each participant its mailbox as ``sim/`` tensors.
``sim/`` tensors are simulation bookkeeping and are not counted (see :data:`fedfuse.types.SIM_PREFIX`), so
``bytes_down`` = ``bytes_up`` = 0 and ``bytes_peer`` is MSfusion's whole communication.
The assembled global model (evaluated, and what ``global_model`` hands out) follows Algorithm 1's Global Model
Combination: **from the current round's sub-models only**, each element averaged over the participants holding it
this round; elements nobody holds this round are 0 (BN running variance 1).  ``num_batches_tracked`` takes the
max.  ``assembly=last`` (keep every element's last combined value, the earlier default) and ``zero_stale`` (zero
only elements trained in an earlier round, keep W⁰ for never-held ones) stay as options; ``docs/msfusion.md``
measures all three on the same training runs (``compare_assemblies``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState, evaluate_splits
from fedfuse.engine.client import (
    CYCLIC_MIN_RATIO,
    LR_SCHEDULES,
    TrainStats,
    cyclic_lr,
    evaluate_model,
    forward_flops_per_sample,
    scheduled_lr,
)
from fedfuse.engine.context import seeded_state
from fedfuse.engine.peers import deliver, mail_of, own_tensors, route_peers, unpack_mail
from fedfuse.engine.program import Batch, ClientProgram, LossTerm
from fedfuse.engine.representation import FeatureView, contrastive_loss, frozen_features
from fedfuse.errors import UserError
from fedfuse.fusion.slice_stats import adjacent_overlap, coverage, holder_churn
from fedfuse.fusion.slicing import (
    Selection,
    SliceSpec,
    build_submodel,
    combine,
    dim_indices,
    dss_indices,
    fill_unheld,
    intersect_selection,
    overlap_part,
    slice_spec,
    slice_state,
    state_bytes,
    unheld_value,
    widths_of,
    write_back,
)
from fedfuse.options import opt
from fedfuse.types import ClientData, Message, Privacy, ServerView, TensorDict, no, not_built


def _padded(v: torch.Tensor, width: int) -> torch.Tensor:
    """``v`` zero-padded to ``width`` entries (positions: index 0, masked out by the caller)."""
    out = torch.zeros(width, dtype=v.dtype)
    out[: v.numel()] = v
    return out


ASSEMBLIES = ("current", "zero_stale", "last")


def assemble(latest: TensorDict, counts: TensorDict, ever: TensorDict, w0: TensorDict, mode: str) -> TensorDict:
    """The full model of one round from its sub-models (Algorithm 1's Global Model Combination).

    ``latest`` is :func:`~fedfuse.fusion.slicing.combine` of the round's sub-models onto the previous latest
    state (each element held this round = the average over its holders, the others their last combined value),
    ``counts`` its holder counts, ``ever`` whether any participant has held an element in this or an earlier
    round, ``w0`` the common initial model.  ``current``: elements nobody holds this round are 0 (BN running
    variance 1); ``zero_stale``: only those held in an earlier round are, never-held ones keep W⁰; ``last``:
    ``latest`` itself."""
    if mode == "last":
        return latest
    if mode == "current":
        return fill_unheld(latest, counts)
    if mode == "zero_stale":
        fill = {k: torch.where(ever[k], unheld_value(k, v), w0[k].to(v.dtype)) for k, v in latest.items()}
        return fill_unheld(latest, counts, fill)
    raise UserError(f"assembly={mode!r}; choose one of {', '.join(ASSEMBLIES)}")


def neighbours(n: int, num: int, topology: str) -> list[int]:
    """Connected participants of ``n``: everyone (``full``) or index neighbours n±1 mod N (``ring``)."""
    if topology == "full":
        return [m for m in range(num) if m != n]
    if topology == "ring":
        return sorted({(n - 1) % num, (n + 1) % num} - {n})
    raise UserError(f"topology={topology!r}; choose full or ring")


class MSfusion(Algorithm):
    name = "msfusion"
    description = "MSfusion: double-shifting width splits, peer overlap aggregation, dynamic overlap, contrastive"
    privacy = (
        Privacy(ServerView.MODELS,
                ("global_model=assembled: each participant's trained sub-model goes to the simulation to "
                 'assemble the evaluated model'),
                central_dp=no("peers average each other's slices directly: there is no single server sum to "
                               'noise'),
                local_dp=not_built('DP-SGD on the sub-model step would make every shared slice DP'),
                secagg=no("each slice is placed by its owner's window; peers must read their neighbours' "
                           'slices in the clear')),
        Privacy(ServerView.PEER_TO_PEER,
                ('global_model=none: only peer envelopes leave a participant; the relay holds no model, but '
                 "each peer sees its neighbours' trained slices"),
                central_dp=no('no server step exists to noise'),
                local_dp=not_built('DP-SGD on the sub-model step would make every shared slice DP'),
                secagg=no('peers average the plain slices they receive; envelopes are not encrypted in the '
                           'simulation'),
                when=(("global_model", "none"),)),
    )

    @dataclass
    class Options:
        mu: float = opt(0.25, "split ratio μ: fraction of every hidden layer's units a participant trains",
                        gt=0.0, le=1.0)
        mu_list: list[float] = opt([], "per-participant ratios μ_n, cycled over ids (App. A.2.4; empty: mu)")
        topology: str = opt("full", "peer graph of the overlap aggregation", choices=("full", "ring"))
        c0: float = opt(1.0, "initial overlap control c0 of Eq. 3/6", gt=0.0)
        p: float = opt(0.75, "final-stage parameter p of Eq. 6 (c = c0·(1 − (r/R)·p))", ge=0.0, lt=1.0)
        dynamic: bool = opt(True, "dynamic overlap (Eq. 6); false keeps c = c0")
        update_every: int = opt(10, "c is updated when r mod update_every = 0 (paper: 10)", ge=1)
        schedule_rounds: int = opt(500, "R of Eq. 6, the round count over which c falls from c0 to c0·(1 − p): "
                                   "500 = the paper's CIFAR-10 run, so c follows the paper's schedule round by "
                                   "round (a 20-round run ends at c = 0.97); 0 = the run's own rounds (the whole "
                                   "schedule compressed into the run; measured worse in short runs, "
                                   "docs/msfusion.md)", ge=0)
        zeta: int = opt(1, "inter-round shift ζ of the double-shifting window", ge=0)
        contrastive: bool = opt(True, "contrastive term of Eq. 7-8")
        tau: float = opt(0.5, "temperature τ of Eq. 7", gt=0.0)
        lam: float = opt(1.0, "weight λ of the contrastive term (Eq. 8)", ge=0.0)
        similarity: str = opt("cosine", "similarity in Eq. 7: cosine (MOON's code, which Eq. 7 cites; default, "
                              "measured) | dot (Eq. 7 as printed; the logits grow with the features and training "
                              "diverges)", choices=("cosine", "dot"))
        lr_schedule: str = opt("cyclic", "local learning-rate schedule: cyclic (triangular, one cycle over all "
                               "rounds, App. A.2.2; peak = the run's --lr) | constant (--lr every round)",
                               choices=LR_SCHEDULES)
        lr_min_ratio: float = opt(CYCLIC_MIN_RATIO, "floor of the cyclic schedule as a fraction of --lr (paper: "
                                  "0.001/0.0012)", gt=0.0, le=1.0)
        assembly: str = opt("current", "the assembled (evaluated and fetched) full model: current = Algorithm 1's "
                            "Global Model Combination, every element averaged over the participants holding it this "
                            "round, elements nobody holds now 0 (BN running variance 1) | zero_stale = the same, but "
                            "elements nobody has ever held keep W⁰ | last = every element keeps its last combined "
                            "value (earlier default; stale off-block weights make long runs decline, "
                            "docs/msfusion.md)", choices=ASSEMBLIES)
        fallback: str = opt("memory", "an element of n's new sub-model that neither n nor a connected peer held last "
                            "round takes: memory = n's own latest trained value, else W⁰ | combined = its latest "
                            "combined value (the last average over the participants that held it; Algorithm 1's "
                            "'split w_n from W^r'), counted as peer traffic", choices=("memory", "combined"))
        compare_assemblies: bool = opt(False, "diagnostic: at every evaluation also score the other assemblies on "
                                       "the global test set (global_accuracy_<assembly>; same training run)")
        global_model: str = opt("assembled", "assembled: every participant also hands its trained sub-model "
                                "(sim/own/) to the simulation, which assembles the full model to evaluate on the "
                                "global test set (the paper's Global Model Combination) | none: serverless — only "
                                "peer envelopes leave a participant, the relay holds no model and averages "
                                "nothing, and each participant is evaluated with its own full-size memory",
                                choices=("assembled", "none"))

    def __init__(self, ctx, options=None) -> None:
        super().__init__(ctx, options)
        self.serverless = self.opt.global_model == "none"
        if self.serverless and self.opt.fallback == "combined":
            raise UserError("msfusion: fallback=combined needs the combined model, which global_model=none does "
                            "not assemble; use fallback=memory")
        self._full = ctx.model({})
        self.spec: SliceSpec = slice_spec(self._full)
        self.shapes = {k: tuple(v.shape) for k, v in self._full.state_dict().items()}
        self._w0: TensorDict | None = None
        self._selections: dict[tuple[int, int, int], Selection] = {}

    # ---- consensus quantities (every participant can compute them) ---------------------------------
    def mu_of(self, n: int) -> float:
        mus = list(self.opt.mu_list or [])
        return float(mus[n % len(mus)]) if mus else float(self.opt.mu)

    def overlap_control(self, r: int, total: int) -> float:
        """c of Eq. 6, updated every ``update_every`` rounds (held constant in between).

        Eq. 6's R is ``schedule_rounds`` (the paper's 500 by default), or the run's ``total`` when that is 0;
        past R, c stays at its final value c0·(1 − p)."""
        if not self.opt.dynamic:
            return float(self.opt.c0)
        ru = (r // self.opt.update_every) * self.opt.update_every
        horizon = int(self.opt.schedule_rounds) or total
        return float(self.opt.c0) * (1.0 - min(ru / max(horizon, 1), 1.0) * float(self.opt.p))

    def selection(self, n: int, r: int, total: int) -> Selection:
        """φ_n of round r (Eq. 4) for every unit group; a pure function of (n, r, total), computed once."""
        key = (n, r, total)
        if key not in self._selections:
            if len(self._selections) > 8 * max(self.ctx.num_clients, 1):  # keep about the last few rounds
                self._selections.clear()
            c, num = self.overlap_control(r, total), self.ctx.num_clients
            self._selections[key] = {g: dss_indices(k, self.mu_of(n), n, num, c, r, self.opt.zeta)
                                     for g, k in self.spec.groups.items()}
        return self._selections[key]

    def initial_state(self) -> TensorDict:
        """W⁰: the common initial full model (same seed as :meth:`init_state`)."""
        if self._w0 is None:
            self._w0 = seeded_state(self.ctx, self.ctx.seed)
        return self._w0

    # ---- server-side bookkeeping -----------------------------------------------------------------
    @property
    def node_private(self) -> tuple[str, ...]:
        """Serverless: a participant's sub-model and full-size memory stay on its Flower node."""
        return ("sub", "known") if self.serverless else ()

    @property
    def server_data(self) -> str | None:
        """``compare_assemblies`` scores every assembly on the server's test set."""
        return "compare_assemblies=true scores every assembly on the server's test set" \
            if self.opt.compare_assemblies else None

    def init_state(self) -> ServerState:
        if self.serverless:  # the relay's state: undelivered envelopes and diagnostics, no model
            return {"mailbox": {}, "diag": {}}
        w0 = self.initial_state()
        return {"global": {k: v.clone() for k, v in w0.items()}, "latest": {k: v.clone() for k, v in w0.items()},
                "ever": {k: torch.zeros(v.shape, dtype=torch.bool) for k, v in w0.items()},
                "mailbox": {}, "diag": {}}

    def global_model(self, state: ServerState) -> tuple[TensorDict, dict[str, Any]] | None:
        return None if self.serverless else (state["global"], {})

    def select_clients(self, info: RoundInfo, rng: np.random.Generator) -> list[int]:
        return list(range(self.ctx.num_clients))  # every participant is active every round

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        out = {}
        for c in clients:
            box = state.get("mailbox", {}).get(c, {})
            senders = sorted({int(k.split("/", 1)[0]) for k in box})
            meta = {"round": info.index, "total": info.total, "senders": senders}
            tensors = deliver(state.get("mailbox", {}), c)
            if self.opt.fallback == "combined" and info.index > 0:  # W^r's values of n's window ("split w_n")
                sel = self.selection(c, info.index, info.total)
                latest = slice_state(self.latest(state), self.spec, sel)
                tensors.update({f"sim/latest/{k}": v for k, v in latest.items()})
            out[c] = Message(tensors, meta)
        return out

    @staticmethod
    def latest(state: ServerState) -> TensorDict:
        """Every element's latest combined value (checkpoints of earlier versions kept it as ``global``)."""
        return state.get("latest", state["global"])

    def exchange(self, info: RoundInfo, results: dict[int, Message]) -> tuple[dict[int, Message], int]:
        """Route every ``sim/peer/{m}/key`` tensor of sender n to m's mailbox as ``sim/mail/{n}/key``.

        The transmission is counted once, here, as peer bytes; the ``sim/`` relay is not counted again.  With
        ``fallback=combined`` the elements a participant took from the combined model this round (fetched from
        the peers that last held them) are counted here too."""
        routed, moved = route_peers(results)
        return routed, moved + int(sum(m.meta.get("fallback_bytes", 0) for m in results.values()))

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        subs, sels = [], {}
        mailbox: dict[int, TensorDict] = {}
        for c, msg in results.items():
            sel = {g: torch.tensor(v, dtype=torch.long) for g, v in msg.meta["sel"].items()}
            if not self.serverless:
                subs.append((own_tensors(msg), sel))
            sels[c] = sel
            mailbox[c] = mail_of(msg)
        glob, extra = (None, {}) if self.serverless else self._assembled(state, subs)
        diag = self.round_diagnostics(info, results, sels)
        if self.serverless:  # the relay only keeps the envelopes for their next delivery
            return {"mailbox": mailbox, "diag": diag}
        return {**state, "global": glob, **extra, "mailbox": mailbox, "diag": diag}

    def _assembled(self, state: ServerState, subs: list[tuple[TensorDict, Selection]]
                   ) -> tuple[TensorDict, dict[str, Any]]:
        """The round's assembled full model (``assembly``) from the participants' sub-models, and the state it
        carries to the next round (latest combined values, ever-held masks, this round's holders)."""
        latest, counts = combine(self.latest(state), self.spec.full_selection(), self.spec, self.shapes, subs)
        ever = {k: state.get("ever", {}).get(k, torch.zeros(v.shape, dtype=torch.bool)) | (counts[k] > 0)
                for k, v in latest.items()}
        glob = assemble(latest, counts, ever, self.initial_state(), self.opt.assembly)
        extra: dict[str, Any] = {"latest": latest, "ever": ever}
        if self.opt.compare_assemblies:
            extra["held"] = {k: v > 0 for k, v in counts.items()}
        return glob, extra

    # ---- diagnostics ---------------------------------------------------------------------------------
    def round_diagnostics(self, info: RoundInfo, results: dict[int, Message],
                          sels: dict[int, Selection]) -> dict[str, Any]:
        """The round's protocol diagnostics: overlap control, coverage, adjacent overlap, holder churn, traffic,
        compute and trained parameters per participant, fallbacks and skipped contrastive terms."""
        order = sorted(results)
        ordered = [sels[c] for c in order]
        metas = [results[c].meta for c in order]
        fits = [results[c].stats for c in order if results[c].stats is not None]
        return {
            "overlap_c": self.overlap_control(info.index, info.total),
            "coverage": coverage(ordered, self.spec.groups),
            "adjacent_overlap": adjacent_overlap(ordered, self.spec.groups),
            "holder_churn": self.holder_churn(info.index, info.total, order) if info.index > 0 else 0.0,
            "peer_bytes_per_participant": float(np.mean([m["peer_bytes"] for m in metas])),
            "full_submodel_bytes_per_participant": float(np.mean([m["submodel_bytes"] for m in metas])),
            "flops_per_participant": float(np.mean([f.flops for f in fits])),
            "trained_params_per_participant": float(np.mean([f.trained_params for f in fits])),
            "split_ratio_params": float(np.mean([f.trained_params for f in fits]))
            / max(sum(p.numel() for p in self._full.parameters()), 1),
            "fallback_elements": int(sum(m["fallback_elements"] for m in metas)),
            "fallback_bytes_per_participant": float(np.mean([m.get("fallback_bytes", 0) for m in metas])),
            "contrastive_skipped": int(sum(m.get("contrastive_skipped", 0) for m in metas)),
        }

    def holder_churn(self, r: int, total: int, participants: list[int]) -> float:
        """The fraction of hidden units whose set of holders differs between rounds r − 1 and r (mean over the
        unit groups): how many units change hands this round.  Equal μ and c: every window gains ζ units and
        drops ζ; a unit counts once.  When the window length is not a multiple of the gap G (N = 10, K = 200,
        μ = 0.125: windows of 25, 20 apart) no unit is both gained and dropped, 2·N·ζ/K (0.1); when it is,
        the unit one window drops is the one another gains, N·ζ/K.  0 with ζ = 0 and a constant c.
        ``docs/msfusion.md`` ties it to the accuracy dips on MNIST shards."""
        now = [self.selection(c, r, total) for c in participants]
        before = [self.selection(c, r - 1, total) for c in participants]
        return holder_churn(now, before, self.spec.groups)

    def reply_shapes(self, cid: int, reply: Message) -> dict[str, tuple[int, ...]]:
        """The shapes of a participant's ``sim/own/`` sub-model implied by the selection in its metadata (for the
        engine's reply check: with heterogeneous μ_n, sub-model shapes differ between participants)."""
        sel = reply.meta.get("sel")
        if self.serverless or not isinstance(sel, dict) or set(sel) != set(self.spec.groups):
            return {}
        sel_t = {g: torch.as_tensor(v, dtype=torch.long) for g, v in sel.items()}
        return {f"sim/own/{k}": tuple(int(p.numel()) for p in dim_indices(self.spec, sel_t, k, shape))
                for k, shape in self.shapes.items()}

    def server_parameters(self, state: ServerState) -> int:
        return 0  # no central server: the full model is assembled only for evaluation

    def diagnostics(self, state: ServerState, fed: Any, info: RoundInfo) -> dict[str, Any]:
        """The round's protocol diagnostics; with ``compare_assemblies`` also the global test accuracy and loss
        of every assembly (``global_accuracy_<mode>``) of the same round's sub-models."""
        out = dict(state.get("diag", {}))
        if self.opt.compare_assemblies and "held" in state and fed is not None:
            counts = {k: v.long() for k, v in state["held"].items()}
            for mode in ASSEMBLIES:
                model = self.ctx.load(assemble(state["latest"], counts, state["ever"], self.initial_state(), mode))
                st = evaluate_model(model, fed.test, self.ctx.eval_batch_size)
                out[f"global_accuracy_{mode}"], out[f"global_loss_{mode}"] = st.accuracy, st.loss
        return out

    # ---- participant side --------------------------------------------------------------------------
    def aggregate_local(
        self, n: int, r: int, total: int, client_state: ClientState, payload: Message
    ) -> tuple[TensorDict, Selection, int]:
        """Eq. 5 at participant n: its round-r sub-model w*_n from its own previous values and the peers'.

        An element that neither n nor a connected peer held in round r−1 takes, with ``fallback=memory``, the
        last value n knows for it (``client_state["known"]``: n's latest trained value, else the common initial
        model W⁰); with ``fallback=combined``, its latest combined value (``sim/latest/`` in the payload).
        Returns (w*_n, its selection, the number of fallback elements, their bytes when fetched)."""
        sel = self.selection(n, r, total)
        fetched = {k[len("sim/latest/"):]: v for k, v in payload.tensors.items() if k.startswith("sim/latest/")}
        if fetched:
            base = fetched
        else:
            known = self.initial_state() if client_state is None else client_state.get("known", self.initial_state())
            base = slice_state(known, self.spec, sel)
        sources = []
        if client_state is not None:
            sources.append((client_state["sub"], client_state["sel"]))
        mail = unpack_mail({k: v for k, v in payload.tensors.items() if not k.startswith("sim/latest/")})
        for s in payload.meta.get("senders", []):
            sources.append((mail.get(s, {}), intersect_selection(self.selection(s, r - 1, total), sel)))
        w_star, counts = combine(base, sel, self.spec, self.shapes, sources)
        if client_state is None:
            return w_star, sel, 0, 0
        fallback = int(sum(int((c == 0).sum()) for c in counts.values()))
        fetched_bytes = int(sum(int((counts[k] == 0).sum()) * v.element_size() for k, v in fetched.items()))
        return w_star, sel, fallback, fetched_bytes

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """Participant n's round as a declared program: Eq. 5 (its sub-model w*_n from its own and its peers'
        values) happens here, training is the run's local spec on the sub-model template with the scheduled
        learning rate and, from the second round on, the contrastive term of Eq. 7-8 as a per-sample
        :class:`LossTerm`; the finalize publishes the peer envelopes (:meth:`publish`).

        The term reads the trained model's penultimate features (the program declares ``features=True``: they
        are ``batch.features``) and computes the frozen w*_n's and previous sub-model's features functionally
        from ``refs`` (``agg/…``, ``prev/…``).  Their common units are gathered with positions padded to the
        feature width and a validity mask, so participants of one width have equal shapes and train in one
        batched group; the masked similarities equal those over the common units alone."""
        r, total, n = int(payload.meta["round"]), int(payload.meta["total"]), data.cid
        w_star, sel, fallback, fallback_bytes = self.aggregate_local(n, r, total, client_state, payload)
        model = self.train_template(sel)
        lr = scheduled_lr(self.ctx.train.lr, r, total, self.opt.lr_schedule, self.opt.lr_min_ratio)
        pos_cur, pos_prev = (self.common_positions(sel, client_state["sel"]) if client_state is not None
                             else (torch.zeros(0, dtype=torch.long),) * 2)
        # the window may jump past the previous one when Eq. 6 changes c: no common unit, no contrastive term
        skipped = bool(self.opt.contrastive and client_state is not None and pos_cur.numel() == 0)
        terms: tuple[LossTerm, ...] = ()
        refs: TensorDict = {}
        frozen: list[nn.Module] = []
        if self.opt.contrastive and client_state is not None and not skipped:
            agg = build_submodel(self._full, self.spec, widths_of(sel), "aggregated")
            prev = build_submodel(self._full, self.spec, widths_of(client_state["sel"]), "prev")
            frozen = [agg, prev]
            width = self.feature_width(sel)
            refs = {**{f"agg/{k}": v for k, v in w_star.items()},
                    **{f"prev/{k}": v for k, v in client_state["sub"].items()},
                    "pos_cur": _padded(pos_cur, width), "pos_prev": _padded(pos_prev, width),
                    "pos_mask": _padded(torch.ones(pos_cur.numel()), width)}
            terms = (self.contrastive_term(FeatureView(agg).eval(), FeatureView(prev).eval()),)

        def finalize(state: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            fit = self.fit_stats(model, data, stats)
            if frozen and stats.samples:
                fit.flops += sum(forward_flops_per_sample(f, data.train.x) for f in frozen) * stats.samples
            tensors, peer, new_state = self.publish(n, r, total, state, sel, client_state)
            meta = {
                "sel": {g: v.tolist() for g, v in sel.items()},
                "peer_bytes": peer,
                "submodel_bytes": state_bytes(new_state["sub"]),
                "fallback_elements": fallback,
                "fallback_bytes": fallback_bytes,
                "contrastive_skipped": int(skipped),
                "lr": lr,
            }
            return Message(tensors, meta, fit), new_state

        return ClientProgram(model=model, init=w_star, spec=self.ctx.train.replace(lr=lr),
                             finalize=finalize, terms=terms, features=bool(terms), refs=refs)

    def train_template(self, sel: Selection) -> nn.Module:
        """The (cached) sub-model template for ``sel``'s widths."""
        return build_submodel(self._full, self.spec, widths_of(sel), "train")

    def feature_width(self, sel: Selection) -> int:
        g = self.spec.feature_group
        return int(self._full.head.in_features) if g is None else int(sel[g].numel())

    def contrastive_term(self, agg: FeatureView, prev: FeatureView) -> LossTerm:
        """λ·ℓ_con (Eq. 7-8), averaged over the batch's samples, over the common units (``refs["pos_*"]``);
        ``agg``/``prev`` compute the frozen models' features functionally."""
        tau, lam, sim = float(self.opt.tau), float(self.opt.lam), self.opt.similarity

        def con(b: Batch) -> torch.Tensor:
            z, x, refs = b.features, b.x, b.refs
            assert z is not None  # the program declares features=True
            z_agg, z_prev = frozen_features(agg, refs, "agg/", x), frozen_features(prev, refs, "prev/", x)
            m = refs["pos_mask"].to(z.dtype)
            cur, old = refs["pos_cur"], refs["pos_prev"]
            per = contrastive_loss(z[..., cur] * m, z_agg[..., cur] * m, z_prev[..., old] * m, tau, sim,
                                   reduction="none")
            return b.mean(lam * per.reshape(z.shape[0], -1).mean(1))

        return LossTerm("msfusion-contrastive", con)

    def evaluate(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> dict[str, float]:
        """Assembled: the full model the simulation assembled, on the participant's splits.  Serverless: the
        participant's own full-size memory (its latest trained value of every element, W⁰ where it never trained
        one) — what it would deploy without a server."""
        if not self.serverless:
            return super().evaluate(payload, client_state, data, gen)
        known = self.initial_state() if not client_state else client_state.get("known", self.initial_state())
        return evaluate_splits(self.ctx.load(known), data, self.ctx.eval_batch_size)

    def publish(
        self, n: int, r: int, total: int, new: TensorDict, sel: Selection, client_state: ClientState
    ) -> tuple[TensorDict, int, dict[str, Any]]:
        """After local training: n's outgoing tensors (``sim/own/...`` and, per connected peer m, the elements
        of its trained sub-model that lie in m's round-(r+1) sub-model), their bytes, and n's new state
        (trained sub-model, its selection, and the full-size memory of n's latest trained values)."""
        tensors = {} if self.serverless else {f"sim/own/{k}": v for k, v in new.items()}
        peer = 0
        if r + 1 < total:
            for m in neighbours(n, self.ctx.num_clients, self.opt.topology):
                part = overlap_part(new, sel, self.selection(m, r + 1, total), self.spec, self.shapes)
                peer += state_bytes(part)
                tensors.update({f"sim/peer/{m}/{k}": v for k, v in part.items()})
        known = self.initial_state() if client_state is None else client_state.get("known", self.initial_state())
        return tensors, peer, {"sub": new, "sel": sel, "known": write_back(known, new, self.spec, sel)}

    def common_positions(self, cur: Selection, prev: Selection) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions, in the current and in the previous sub-model's representation, of their common units."""
        g = self.spec.feature_group
        if g is None:  # unsplit representation (transformer LM: d_model)
            d = self._full.head.in_features
            return torch.arange(d), torch.arange(d)
        common = cur[g][torch.isin(cur[g], prev[g])]
        where_prev = {int(v): i for i, v in enumerate(prev[g].tolist())}
        where_cur = {int(v): i for i, v in enumerate(cur[g].tolist())}
        pc = torch.tensor([where_cur[int(v)] for v in common], dtype=torch.long)
        pp = torch.tensor([where_prev[int(v)] for v in common], dtype=torch.long)
        return pc, pp


def expected_overlap(mu: float, num: int, c: float) -> float:
    """δ = 1 − c/(μN) (§4.2), the overlap fraction of adjacent participants (0 when c ≥ μN)."""
    return max(0.0, 1.0 - c / (mu * num)) if mu * num > 0 else 0.0


__all__ = ["MSfusion", "contrastive_loss", "cyclic_lr", "expected_overlap", "neighbours"]
