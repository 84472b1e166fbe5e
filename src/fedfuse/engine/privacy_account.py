"""The run's privacy accounting: what differential privacy has cost so far, and what the outputs may say.

:class:`PrivacyAccount` keeps the central-DP rounds the run has released (one accountant event per round, stored
in the checkpoint so a resume composes every round) and every client's DP-SGD steps under local DP, and turns
them into ε at δ (dp-accounting for central DP, Opacus's RDP accountant for local DP: ``fedfuse.privacy.dp`` and
``engine/local_dp.py``).  It also decides what the outputs publish: under central DP a round record and the
summary's totals withhold what touches individual clients (:data:`DP_WITHHELD`) unless ``dp_debug_metrics``, and
a run that cannot claim its guarantee says why (:meth:`PrivacyAccount.summary`).

The adversary of the withholding is a reader of the run's outputs (``metrics.jsonl``, ``summary.json``, records):
who took part in a round, how many replied and what each client measured would reveal membership that the
noised aggregate hides (``tests/privacy/test_dp_attacks.py`` reads them as that reader would).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedfuse.config import ConfigError
from fedfuse.engine.context import RunContext
from fedfuse.engine.local_dp import local_epsilon, sample_rate
from fedfuse.privacy.dp import DP_SAMPLINGS, events_epsilon, round_event
from fedfuse.types import Message

#: what a central-DP round record withholds unless ``dp_debug_metrics``: who took part and how many (the count of a
#: Poisson sample, dropouts, late and quarantined replies, SecAgg's survivors, the traffic and work that scale with
#: it), the training loss over the participants, the exact clipped count and per-client test metrics
DP_WITHHELD = ("clients", "replied", "dropped", "late", "delivered_late", "quarantined", "train_loss", "bytes_down",
               "bytes_up", "bytes_peer", "client_flops", "total_bytes_down", "total_bytes_up", "total_bytes_peer",
               "total_client_flops", "total_dropped", "total_late", "total_quarantined", "dp_clipped",
               "client_test_accuracy", "communicated_parameters_per_client", "optimised_parameters_per_client",
               "clients_without_test", "global_eval_clients")
DP_WITHHELD_PREFIXES = ("secagg_",)  # SecAgg's counts of clients, nodes and survivors, and its abort message
NO_GUARANTEE = "no privacy guarantee"
log = logging.getLogger("fedfuse")


class PrivacyAccount:
    """The privacy spent by the run of ``ctx`` whose sampler is ``sampling`` (its name)."""

    def __init__(self, ctx: RunContext, sampling: str, algorithm: str) -> None:
        """Raises :class:`ConfigError` when central DP cannot be accounted for the sampling ``algorithm`` uses;
        warns when the run cannot claim a guarantee."""
        self.ctx = ctx
        self.sampling = sampling
        self.local_steps: dict[int, int] = {}  # dp=local: DP-SGD steps each client has taken so far
        self.events: list[dict[str, Any]] = []  # dp=central: the accountant's event of every round run
        dp = ctx.dp
        if dp.central and not dp.guarantee:
            why = ("dp_reproducible=true (noise and sampling from the run seed)" if dp.reproducible else
                   "dp_debug_metrics=true" if dp.debug_metrics else "dp_noise=0")
            log.warning("dp=central with %s: %s (the outputs say so)", why, NO_GUARANTEE)
        if dp.central and sampling not in DP_SAMPLINGS:
            raise ConfigError(f"sampling: central DP is accounted for sampling {' or '.join(DP_SAMPLINGS)}; "
                              f"{algorithm!r} samples {sampling!r} (set --set sampling=poisson)")

    # ---- spending --------------------------------------------------------------------------------------------
    def count_steps(self, outs: Mapping[int, tuple[Message, Any]]) -> None:
        """Local DP: every model a client sends costs its examples privacy, used or not (``outs``: an executor's
        ``{cid: (reply, client_state)}``)."""
        if not self.ctx.dp.local:
            return
        for c, (res, _) in outs.items():
            if res.stats is not None:
                self.local_steps[c] = self.local_steps.get(c, 0) + int(res.stats.steps)

    def spend_round(self) -> None:
        """Central DP: the round released a noised aggregate (even an empty one); account it."""
        dp = self.ctx.dp
        if dp.central:
            self.events.append(round_event(dp.noise, self.ctx.num_clients, self.ctx.clients_per_round,
                                           self.sampling, dp.accountant))

    # ---- what the outputs say --------------------------------------------------------------------------------
    def record(self, server_dp: Mapping[str, Any] | None) -> dict[str, Any]:
        """The round record's privacy entries: central DP's ε at δ of every round run so far (the stored events,
        composed; every round counts) and the mechanism's own record ``server_dp`` (the server state's ``dp``
        entry: the clip, the clipped clients); local DP's per-client ε (:meth:`local_record`)."""
        dp = self.ctx.dp
        if dp.local:
            return self.local_record()
        if not dp.central:
            return {}
        eps = events_epsilon(self.events, dp.delta)
        out: dict[str, Any] = {"dp_epsilon": eps if math.isfinite(eps) else None, "dp_delta": dp.delta}
        out.update({f"dp_{k}": v for k, v in (server_dp or {}).items()})
        return out

    def local_record(self) -> dict[str, Any]:
        """Local DP: every client's ε_i at δ over all its DP-SGD steps so far (Opacus's RDP accountant); the
        largest (the run's guarantee for every example) and the median over the clients that trained."""
        dp, bs = self.ctx.dp, self.ctx.train.batch_size
        eps = []
        for c, steps in sorted(self.local_steps.items()):
            n = int(self.ctx.client_sizes[c])
            eps.append(local_epsilon(dp.noise, sample_rate(n, min(bs, max(n, 1))), steps, dp.delta))
        if not eps:
            return {"dp_epsilon": 0.0, "dp_delta": dp.delta}
        finite = all(math.isfinite(e) for e in eps)
        return {"dp_epsilon": max(eps) if finite else None, "dp_epsilon_median": float(np.median(eps)),
                "dp_delta": dp.delta, "dp_clients": len(eps)}

    def withhold(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Central DP: the record without what touches individual clients (:data:`DP_WITHHELD`) — unless
        ``dp_debug_metrics``, and then the record says the run has no guarantee."""
        dp = self.ctx.dp
        if not dp.central:
            return rec
        if not dp.debug_metrics:
            rec = {k: v for k, v in rec.items() if k not in DP_WITHHELD and not k.startswith(DP_WITHHELD_PREFIXES)}
        rec["dp_guarantee"] = dp.guarantee
        return rec

    def summary(self, timing: dict[str, float]) -> dict[str, Any]:
        """Central DP: whether the run may claim its (ε, δ) and, when it may not, why; the run totals that count
        clients are withheld like the round records' (only the ``timing`` totals, wall and CPU seconds, stay)."""
        dp = self.ctx.dp
        if not dp.central:
            return {}
        out: dict[str, Any] = {"dp_guarantee": dp.guarantee}
        if dp.reproducible:
            out["dp_warning"] = (f"{NO_GUARANTEE}: dp_reproducible=true draws the DP noise and sampling from the run "
                                 "seed, which anyone holding config.yaml or a record can regenerate")
        elif dp.debug_metrics:
            out["dp_warning"] = f"{NO_GUARANTEE}: dp_debug_metrics=true publishes un-noised per-client metrics"
        elif dp.noise <= 0:
            out["dp_warning"] = f"{NO_GUARANTEE}: dp_noise=0 clips the updates but adds no noise (ε = ∞)"
        if not dp.debug_metrics:
            out["totals"] = dict(timing)
        return out

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's entries of the account."""
        return {"local_dp_steps": dict(self.local_steps), "dp_events": [dict(e) for e in self.events]}

    def load_checkpoint(self, ck: Mapping[str, Any]) -> None:
        """Restore the account from a checkpoint ``ck``: its stored events (a checkpoint written before they
        were stored: one event per completed round from its own config, which resume keeps fixed)."""
        self.local_steps = dict(ck.get("local_dp_steps", {}))
        if "dp_events" in ck:
            self.events = [dict(e) for e in ck["dp_events"]]
            return
        saved = ck.get("config") or {}
        if saved.get("dp") != "central":
            self.events = []
            return
        one = round_event(float(saved["dp_noise"]), self.ctx.num_clients, int(saved["clients_per_round"]),
                          self.sampling, str(saved.get("dp_accountant", "rdp")))
        self.events = [dict(one) for _ in range(int(ck["round"]))]
