"""The one round loop: select → configure → client work → exchange → fuse → evaluate → account → log →
checkpoint.  It never names an algorithm.

:class:`Experiment` runs the rounds and owns the run's state; each other job is a module of its own: building
the run (``engine/assemble.py``), one round's bookkeeping and the run totals (``engine/round.py``), evaluation
(``engine/evaluation.py``), privacy accounting (``engine/privacy_account.py``), ``summary.json`` and the records
(``engine/summary.py``) and every file the run writes (``engine/store.py``).  The names those modules took from
here (``build_federation``, ``strip_timing``, ``DP_WITHHELD``, ...) stay importable from here.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.config import RunConfig, resolve_device, validate
from fedfuse.engine.assemble import assemble
from fedfuse.engine.assemble import build_algorithm as build_algorithm
from fedfuse.engine.assemble import build_context as build_context
from fedfuse.engine.assemble import build_federation as build_federation
from fedfuse.engine.callbacks import Callback, CallbackList
from fedfuse.engine.context import ClientState, RoundInfo, ServerState
from fedfuse.engine.contract import Executor, Job
from fedfuse.engine.evaluation import aggregate_client_metrics as aggregate_client_metrics
from fedfuse.engine.evaluation import evaluate
from fedfuse.engine.executors import make_executor
from fedfuse.engine.faults import DROPOUT, LATE, FaultPlan
from fedfuse.engine.federated_eval import check_server_data, global_client_side
from fedfuse.engine.personal import client_side, outgoing
from fedfuse.engine.privacy_account import DP_WITHHELD as DP_WITHHELD
from fedfuse.engine.privacy_account import DP_WITHHELD_PREFIXES as DP_WITHHELD_PREFIXES
from fedfuse.engine.privacy_account import PrivacyAccount
from fedfuse.engine.round import Collected, RoundLedger, Totals
from fedfuse.engine.routing import executor_summary
from fedfuse.engine.sampling import make_sampler
from fedfuse.engine.store import RunStore
from fedfuse.engine.summary import TIMING_KEYS as TIMING_KEYS
from fedfuse.engine.summary import clean, improves_val_loss, run_summary
from fedfuse.engine.summary import final_block as final_block
from fedfuse.engine.summary import strip_timing as strip_timing
from fedfuse.engine.validate import check_replies, is_state_like
from fedfuse.errors import DivergenceError
from fedfuse.privacy.secure import SecAggAbort, SecAggSettings, secure_round
from fedfuse.rng import numpy_rng, secure_numpy_rng
from fedfuse.rundir import check_resume
from fedfuse.runfiles import CHECKPOINT
from fedfuse.runtime.precision import resolve_precision, use_precision
from fedfuse.runtime.threads import apply_threads, worker_threads
from fedfuse.types import Federation, Message

MAX_ROLLBACKS = 8  # on_divergence=rollback halves the lr at most this many times in one round
log = logging.getLogger("fedfuse")


def among_present(clients: list[int], present: set[int] | None, num_clients: int,
                  rng: np.random.Generator) -> list[int]:
    """The sampled ``clients`` with each absent one (no connected node holds its data) replaced by a present
    client not sampled yet, drawn uniformly with ``rng``; unchanged when all are present (``present`` None means
    everyone is).  Fewer come back when fewer are present."""
    if present is None or all(c in present for c in clients):
        return clients
    kept = [c for c in clients if c in present]
    pool = sorted(c for c in present if c not in kept and 0 <= c < num_clients)
    need = min(len(clients) - len(kept), len(pool))
    extra = [pool[i] for i in rng.choice(len(pool), size=need, replace=False)] if need else []
    return sorted(kept + extra)


class Experiment:
    """One run: owns the federation, the algorithm, the executor, the outputs and the loop."""

    def __init__(
        self,
        cfg: RunConfig,
        algorithm: type,
        *,
        fed: Federation | None = None,
        executor: Executor | None = None,
        progress: bool = False,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        """Run ``cfg`` with the algorithm class ``algorithm`` (built with ``cfg.algorithm_options``; ``cfg.algorithm``
        names it in the outputs).  ``fed`` replaces the federation the config describes, ``executor`` the one it
        names.  ``on_round(record)`` is called after every round; ``callbacks`` get the run's whole lifecycle
        (:class:`~fedfuse.engine.callbacks.Callback`: start, every round, end)."""
        if not isinstance(algorithm, type):
            raise TypeError(f"Experiment takes the algorithm's class (e.g. fedfuse.algorithms.get_algorithm(name)), "
                            f"not {type(algorithm).__name__}")
        self.cfg = validate(cfg)
        # the run config's sections (fedfuse.sections): what the loop reads of the configuration besides the run's
        # identity (algorithm, data, rounds, seed, cadence)
        self.runtime, self.defences, self.mechanisms = self.cfg.runtime, self.cfg.faults, self.cfg.privacy
        self.device = resolve_device(self.runtime.device)
        self.threads = apply_threads(self.runtime.threads)
        self.precision = resolve_precision(self.runtime.precision, self.device)  # fp32 | bf16 (runtime/precision.py)
        self.fed, self.ctx, self.algo = assemble(self.cfg, self.device, algorithm, fed=fed)
        self.client = client_side(self.algo)  # what executors run: with entries that stay local, engine/personal.py
        self.store = RunStore(self.cfg.out)  # every file the run writes (engine/store.py)
        if self.cfg.global_eval == "federated":  # the clients also evaluate the global model (engine/federated_eval)
            self.client = global_client_side(self.client)
        check_server_data(self.cfg, self.fed, self.algo, has_executor=executor is not None)
        self.ctx.out_dir = self.store.dir  # where an algorithm's own diagnostic files go
        self.sampler = make_sampler(self.cfg.sampling, self.algo)
        # central DP's client sampling: from the OS unless the research mode (the run seed) is asked for
        self.dp_select_rng = secure_numpy_rng() if self.ctx.dp.central and not self.ctx.dp.reproducible else None
        self.privacy = PrivacyAccount(self.ctx, self.sampler.name, self.cfg.algorithm)  # engine/privacy_account.py
        self.secagg = SecAggSettings.from_config(self.cfg)
        # fit/evaluate get the clients' data without the ground truth; only diagnostics/finish see self.fed
        self.executor = executor or make_executor(self.runtime.executor, self.fed.blinded().clients, self.cfg.seed,
                                                  threads=worker_threads(self.runtime.threads), config=self.cfg)
        self.executor.bind(self.ctx)  # executors that send the local-training settings along
        self.progress = progress
        self.on_round = on_round
        self.callbacks = CallbackList(callbacks)
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.totals = Totals()
        self.start_round = 0
        self.state: ServerState = {}
        self.client_states: dict[int, ClientState] = {}
        self.faults = FaultPlan.from_settings(self.cfg.seed, self.defences)
        self.late_box: dict[int, tuple[Message, Message]] = {}  # late_replies=next-round: cid -> (reply, sent)

    @property
    def local_dp_steps(self) -> dict[int, int]:
        """dp=local: the DP-SGD steps each client has taken so far (:attr:`privacy`)."""
        return self.privacy.local_steps

    @property
    def out(self) -> Path | None:
        """The run directory (None when the run writes nothing)."""
        return self.store.dir

    def attach(self, *callbacks: Callback) -> None:
        """Add callbacks after construction (e.g. ones that need :attr:`fed`)."""
        self.callbacks.callbacks.extend(callbacks)

    # ---- setup / resume ------------------------------------------------------------------------
    def _fresh(self) -> None:
        self.state = self.algo.init_state()
        self.client_states = {c: self.algo.init_client_state(c) for c in range(self.fed.num_clients)}
        self.store.start(self.cfg)

    def _resume(self) -> None:
        ck = self.store.load_checkpoint(self.device)
        check_resume(ck.get("config") or {}, self.cfg, int(ck["round"]), str(self.store.path(CHECKPOINT)))
        self.store.clear_diverged()
        self.state = ck["state"]
        self.client_states = ck["client_states"]
        self.start_round = int(ck["round"])
        self.totals = Totals(**{"cpu_seconds": math.nan, **ck["totals"]})  # a checkpoint from before cpu_seconds
        self.best = ck["best"]
        self.history = ck["history"]
        if ck.get("lr") is not None:  # halved by on_divergence=rollback
            self.ctx.train = dataclasses.replace(self.ctx.train, lr=float(ck["lr"]))
        if ck["config"].get("rounds") != self.cfg.rounds:  # a resume that extends the run
            self.store.write_config(self.cfg)
        self.executor.restore(ck.get("executor"))  # auto: keep the executor the probe chose
        self.executor.routing().load_state_dict(ck.get("routes"))  # the summary counts the earlier rounds too
        self.sampler.load_state_dict(ck.get("sampler", {}))
        self.privacy.load_checkpoint(ck)
        self.late_box = ck.get("late_box", {})
        # metrics written after the checkpoint (a kill between the two) are dropped and recomputed
        self.store.rewrite_metrics(self.history)

    def _checkpoint(self, next_round: int) -> None:
        ck = {
            "round": next_round,
            "state": self.state,
            "client_states": self.client_states,
            "totals": dataclasses.asdict(self.totals),
            "best": self.best,
            "history": self.history,
            "sampler": self.sampler.state_dict(),
            **self.privacy.state_dict(),  # local_dp_steps, dp_events
            "late_box": self.late_box,
            "config": self.cfg.to_dict(),
            "lr": self.ctx.train.lr,
            "executor": self.executor.describe(),
            "routes": self.executor.routing().state_dict(),
        }
        self.store.save_checkpoint(ck)

    # ---- the loop ------------------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict[str, Any]:
        """Run (or, with ``resume``, continue from ``checkpoint.pt``) every round; returns the summary.  The
        callbacks' ``on_run_end`` is called also when the run fails (with the summary so far, ``{}`` before the
        first round)."""
        if resume:
            self._resume()
        else:
            self._fresh()
        self.callbacks.on_run_start(self.cfg)
        summary: dict[str, Any] = {}
        try:
            summary = self._rounds()
        finally:
            self.callbacks.on_run_end(summary or (self.summary() if self.history else {}))
        return summary

    def _rounds(self) -> dict[str, Any]:
        R = self.cfg.rounds
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=R, initial=self.start_round, desc=f"{self.cfg.algorithm}", unit="round")
        for r in range(self.start_round, R):
            t0, c0 = time.perf_counter(), time.process_time()
            with use_precision(self.precision, self.runtime.memory_format, self.runtime.fp32_matmul):
                rec = self._guarded_round(r)
            self.totals.wall_seconds += time.perf_counter() - t0
            self.totals.cpu_seconds += time.process_time() - c0
            rec["seconds"] = time.perf_counter() - t0
            rec["wall_seconds"] = self.totals.wall_seconds
            rec["cpu_seconds"] = self.totals.cpu_seconds
            rec = clean(rec)
            self.history.append(rec)
            if "val_loss" in rec:
                self._track_best(rec)
            self.store.append_metrics(rec)
            if self.store.enabled and ((r + 1) % self.cfg.checkpoint_every == 0 or r + 1 == R):
                self._checkpoint(r + 1)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(_postfix(rec))
            if self.on_round:
                self.on_round(rec)
            self.callbacks.on_round(rec)
        if bar is not None:
            bar.close()
        self.executor.close()
        summary = self.summary()
        self._finish(summary)
        return summary

    def _guarded_round(self, r: int) -> dict[str, Any]:
        """One round; a non-finite outcome stops the run (or, with on_divergence=rollback, redoes the round from
        the state before it with half the learning rate)."""
        rollback = self.defences.on_divergence == "rollback"
        for attempt in range(MAX_ROLLBACKS + 1):
            saved = copy.deepcopy((self.state, self.client_states, self.totals, self.sampler.state_dict(),
                                   self.late_box)) if rollback else None
            rec = self._round(r)
            why = rec.pop("_diverged", None)
            if why is None:
                if attempt:
                    rec["rollbacks"] = attempt
                return rec
            lr = self.ctx.train.lr
            if saved is None or attempt == MAX_ROLLBACKS:
                self.store.mark_diverged(r + 1, why, lr)
                raise DivergenceError(self._divergence_message(r, why, lr))
            self.state, self.client_states, self.totals, sampler_state, self.late_box = saved
            self.sampler.load_state_dict(sampler_state)
            self.ctx.train = dataclasses.replace(self.ctx.train, lr=lr / 2)
            log.warning("round %d diverged (%s); rolled back, lr %.4g -> %.4g", r + 1, why, lr, lr / 2)
        raise AssertionError("unreachable")

    def _divergence_message(self, r: int, why: str, lr: float) -> str:
        msg = f"the run diverged in round {r + 1}: {why}."
        done = self.store.checkpoint_round()
        if done is not None:
            msg += f" The last good checkpoint ({self.store.path(CHECKPOINT)}, after round {done}) is kept."
        if self.defences.on_divergence == "rollback":
            msg += f" Rolling back and halving the lr {MAX_ROLLBACKS} times (to {lr:.3g}) did not help."
        else:
            msg += f" Lower --lr (now {lr:g}) or use --set on_divergence=rollback."
        return msg

    def _round(self, r: int) -> dict[str, Any]:
        """One round: select, then every stage collect → screen → account → fuse; then the record (and the
        evaluation, on evaluation rounds)."""
        info = RoundInfo(index=r, total=self.cfg.rounds)
        clients = self._select(info)
        weights = self.sampler.weights()  # of this round's selection (sample-weighted fusion reads them)
        fates = self.faults.fates(r, clients)
        ledger = RoundLedger(clients, dropped=[c for c in clients if fates[c] == DROPOUT], active=list(clients))
        start_state = self.state
        self.secure_record: dict[str, Any] = {}  # what secure aggregation did this round (secagg=true)
        new_late: dict[int, tuple[Message, Message]] = {}
        for stage in range(self.algo.num_stages(self.state, info)):
            info = RoundInfo(index=r, total=self.cfg.rounds, stage=stage)
            got = self._collect(info, fates, weights, ledger, new_late)
            results = self._screen(info, got, ledger)
            self._account(info, got.payloads, results, ledger)
            if not self._fuse(info, results, ledger, start_state, got.sent):
                break
        self.late_box = new_late
        ledger.add_to(self.totals)
        rec = ledger.record(r, self.totals, self.algo.server_parameters(self.state))
        rec.update(self.secure_record)
        self.privacy.spend_round()  # central DP: the round released a noised aggregate (even an empty one)
        rec.update(self.privacy.record(self.state.get("dp")))
        why = self._diverged(ledger.honest_bad, ledger.honest_replies, ledger.train_loss)
        if why:
            rec["_diverged"] = why
            return self.privacy.withhold(rec)
        if (r + 1) % self.cfg.eval_every == 0 or r + 1 == self.cfg.rounds:
            rec.update(self.evaluate(r))
        return self.privacy.withhold(rec)

    def _select(self, info: RoundInfo) -> list[int]:
        """The round's participants: the sampler's choice, among the clients that are present (Flower)."""
        r, seed = info.index, self.cfg.seed
        rng = self.dp_select_rng if self.dp_select_rng is not None else numpy_rng(seed, "select", r)
        clients = self.sampler.select(self.algo, info, rng)
        present = self.executor.present()  # Flower: only clients whose node is connected can take part
        if present is not None and self.ctx.dp.central:  # DP: an absent client is absent (no substitute), or the
            chosen = [c for c in clients if c in present]  # inclusion probability the accountant assumes is wrong
            self.sampler.counts = {c: self.sampler.counts.get(c, 1) for c in chosen}
            clients = chosen
        elif present is not None:
            chosen = among_present(clients, present, self.ctx.num_clients, numpy_rng(seed, "select-present", r))
            if chosen != clients:
                self.sampler.counts = {c: self.sampler.counts.get(c, 1) for c in chosen}
            clients = chosen
        return clients

    def _collect(self, info: RoundInfo, fates: dict[int, str], sampling_weight: dict[int, float],
                 ledger: RoundLedger, new_late: dict[int, tuple[Message, Message]]) -> Collected:
        """Send the stage's payloads to the active clients, run them, and gather what arrives in time (see
        :meth:`_arrivals`) plus, in the first stage, the late replies of an earlier round.  Records dropouts and
        the traffic."""
        payloads = outgoing(self.client, self.algo.configure_fit(self.state, info, ledger.active))
        # a dropped-out client received its payload but never replies (and does no work)
        jobs = [Job(c, payloads[c], self.client_states.get(c), ("fit", info.index, info.stage))
                for c in payloads if fates.get(c) != DROPOUT]
        outs = self.executor.fit(self.client, jobs)  # the executor runs declared programs or calls fit
        self.privacy.count_steps(outs)  # local DP: every model a client sends costs its examples privacy
        for job in jobs:  # a job without a reply (a Flower node died, a reply timed out) is a dropout
            if job.cid not in outs and job.cid not in ledger.dropped:
                ledger.dropped.append(job.cid)
        results = self._arrivals(info, payloads, outs, fates, sampling_weight, ledger, new_late)
        sent = self._deliver_late(payloads, results, ledger) if info.stage == 0 and self.late_box else payloads
        got = Collected(payloads, results, sent)
        ledger.add_traffic(got)
        return got

    def _arrivals(self, info: RoundInfo, payloads: dict[int, Message], outs: dict[int, Any],
                  fates: dict[int, str], sampling_weight: dict[int, float], ledger: RoundLedger,
                  new_late: dict[int, tuple[Message, Message]]) -> dict[int, Message]:
        """The replies that arrive in time, in client-id order, after the fault plan: a late client's reply is
        kept for the next round (``late_replies=next-round``, first stage) or lost; the server-side echo of what
        was sent and the sampling weight are attached.  Every client's new state is kept."""
        results: dict[int, Message] = {}
        state_like = is_state_like(self.algo, payloads, outs_results(outs))
        for c, (res, cstate) in sorted(outs.items()):  # canonical order: fusion is order-independent
            self.client_states[c] = cstate
            if fates.get(c) == LATE:  # worked, but the reply missed the deadline
                ledger.late.append(c)
                if self.defences.late_replies == "next-round" and info.stage == 0:
                    stale = self.faults.corrupt(c, payloads[c], res, state_like)
                    if stale is not None:
                        new_late[c] = (stale, payloads[c])
                continue
            res = self.faults.corrupt(c, payloads[c], res, state_like)
            if res is None:
                continue
            results[c] = res
            for key in self.algo.echo_meta:  # server-side bookkeeping of what was sent
                if key in payloads[c].meta:
                    res.meta.setdefault(key, payloads[c].meta[key])
            if c in sampling_weight:
                res.meta["sampling_weight"] = sampling_weight[c]
        return results

    def _deliver_late(self, payloads: dict[int, Message], results: dict[int, Message],
                      ledger: RoundLedger) -> dict[int, Message]:
        """Add the replies that missed an earlier deadline to ``results`` (a fresh reply supersedes a stale one);
        returns, per reply, the payload it answers."""
        sent = dict(payloads)
        for c, (reply, was_sent) in sorted(self.late_box.items()):
            if c not in results:
                results[c] = Message(reply.tensors, {**reply.meta, "late": True}, reply.stats)
                sent[c] = was_sent
                ledger.delivered_late.append(c)
        self.late_box = {}
        return sent

    def _screen(self, info: RoundInfo, got: Collected, ledger: RoundLedger) -> dict[int, Message]:
        """The replies the update checks accept (``check_updates``); the others are quarantined, with the reason."""
        results = got.results
        ledger.honest_replies += sum(1 for c in results if not self.faults.corrupts(c))
        checks = self.defences
        if not (checks.check_updates and results) or self.mechanisms.secagg.enabled:  # SecAgg: it cannot see them
            return results
        bad = check_replies(self.algo, got.sent, results, self.ctx.client_sizes, checks.norm_bound, checks.norm_max)
        for c, reason in bad.items():
            ledger.quarantined[str(c)] = f"stage {info.stage}: {reason}" if info.stage else reason
            log.warning("round %d: quarantined the update of client %d: %s", info.index + 1, c, reason)
            if not self.faults.corrupts(c) and "non-finite" in reason:
                ledger.honest_bad += 1
            del results[c]
        return results

    def _account(self, info: RoundInfo, payloads: dict[int, Message], results: dict[int, Message],
                 ledger: RoundLedger) -> None:
        """The accepted replies' local work; the training stage also teaches the sampler (gradient-based
        sampling policies learn from it)."""
        if info.stage == 0:
            self.sampler.observe(payloads, results)
        ledger.add_work(results)
        ledger.active = sorted(results)

    def _fuse(self, info: RoundInfo, results: dict[int, Message], ledger: RoundLedger,
              start_state: ServerState, sent: dict[int, Message] | None = None) -> bool:
        """The algorithm's exchange and server update; with fewer replies than the quorum the round leaves the
        server as it was before its first stage (returns False: no further stage).  Under ``secagg`` the server
        update is :func:`~fedfuse.privacy.secure.secure_round` (the algorithm's ``aggregate_sum`` of a masked sum);
        a protocol abort leaves the server as it was, like a missed quorum.  Under central DP no round is skipped:
        whoever replied (possibly no one) makes the noised aggregate, and an aborted SecAgg round releases noise
        around the current model (:meth:`_dp_empty_release`)."""
        central = self.ctx.dp.central
        if not central and len(results) < max(self.defences.quorum, 1):
            self.state = start_state
            ledger.skipped = True
            return False
        results, moved = self.algo.exchange(info, results)
        ledger.peer += moved
        if not self.mechanisms.secagg.enabled:
            self.state = self.algo.aggregate_fit(self.state, info, results)
            return True
        if central and not results:
            return self._dp_empty_release(info)
        if sent is None:
            raise TypeError("secure aggregation needs the payloads the clients answered (sent)")
        try:
            self.state, record, _ = secure_round(self.algo, self.state, info, sent, results, self.secagg,
                                                 self.cfg.seed)
        except SecAggAbort as e:
            log.warning("round %d: secure aggregation aborted: %s", info.index + 1, e)
            self.secure_record["secagg_abort"] = str(e)
            if central:
                return self._dp_empty_release(info)
            self.state = start_state
            ledger.skipped = True
            return False
        self.secure_record.update(record)
        return True

    def _dp_empty_release(self, info: RoundInfo) -> bool:
        """Central DP with nothing to sum (no reply, or SecAgg aborted): the round still releases the noised
        aggregate of no client — noise around the current model — and is accounted like any other."""
        self.state = self.algo.aggregate_fit(self.state, info, {})
        return True

    def _diverged(self, bad: int, replies: int, loss: float | None) -> str | None:
        """Why this round counts as diverged (None if it does not): most honest replies non-finite, a
        non-finite mean training loss, or non-finite values in the server's global model."""
        if replies and bad * 2 > replies:
            return f"{bad} of {replies} client updates were non-finite"
        if loss is not None and not math.isfinite(loss):
            return f"the mean training loss is {loss}"
        g = self.algo.global_model(self.state)
        if g is not None:
            for k, v in g[0].items():
                if (v.is_floating_point() or v.is_complex()) and not bool(torch.isfinite(v).all()):
                    return f"the global model holds non-finite values (first in {k})"
        return None

    def evaluate(self, r: int) -> dict[str, Any]:
        """Round ``r``'s evaluation (:func:`fedfuse.engine.evaluation.evaluate`)."""
        return evaluate(self, r)

    def _track_best(self, rec: dict[str, Any]) -> None:
        """Keep the record (and, with ``out``, the global model: ``model_best_val_loss.pt``) of the round with the
        lowest validation loss (:func:`fedfuse.engine.summary.improves_val_loss`)."""
        if not improves_val_loss(self.best, rec):
            return
        self.best = dict(rec)
        g = self.algo.global_model(self.state) if self.store.enabled else None
        if g is not None:
            self.store.save_model("best_val_loss", g[0], g[1], rec["round"])

    def summary(self) -> dict[str, Any]:
        """``summary.json`` of the run so far (:func:`fedfuse.engine.summary.run_summary`)."""
        return run_summary(
            self.cfg, self.fed.task, self.fed.num_clients, self.history, self.best, self.totals,
            # what was asked for, what trained the clients and why a request was re-routed (engine/routing.py)
            executor=executor_summary(self.runtime.executor, self.executor.routing(), self.executor.describe()),
            precision=self.precision, threads=self.threads, **self.privacy.summary(
                clean({"wall_seconds": self.totals.wall_seconds, "cpu_seconds": self.totals.cpu_seconds})))

    def _finish(self, summary: dict[str, Any]) -> None:
        if not self.store.enabled:
            return
        self.store.write_summary(summary)
        g = self.algo.global_model(self.state)
        if g is not None:
            self.store.save_model("final", g[0], g[1], len(self.history))
        self.algo.finish(self.state, self.fed, self.store.dir)


def outs_results(outs: dict[int, Any]) -> dict[int, Message]:
    """The reply part of an executor's ``{cid: (reply, client_state)}`` output."""
    return {c: o[0] for c, o in outs.items()}


def _postfix(rec: dict[str, Any]) -> str:
    parts = []
    for k, short in (("global_accuracy", "glob"), ("personal_accuracy", "pers"), ("perplexity", "ppl")):
        v = rec.get(k)
        if v is not None:
            parts.append(f"{short}={v:.3f}" if k != "perplexity" else f"{short}={v:.1f}")
    return " ".join(parts)


def run(cfg: RunConfig, algorithm: type, *, resume: bool = False, progress: bool = False) -> dict[str, Any]:
    """Convenience wrapper: build an :class:`Experiment` of ``algorithm`` and run it; returns the summary."""
    return Experiment(cfg, algorithm, progress=progress).run(resume=resume)
