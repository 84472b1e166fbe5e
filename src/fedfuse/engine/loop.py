"""The one round loop: select → configure → client work → exchange → fuse → evaluate → account → log →
checkpoint.  It never names an algorithm.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.config import ConfigError, RunConfig, dump_yaml, resolve_device, validate
from fedfuse.engine.callbacks import Callback, CallbackList
from fedfuse.engine.checkpoint import CHECKPOINT, checkpoint_round, load_checkpoint, save_checkpoint
from fedfuse.engine.client import TrainConfig, evaluate_model
from fedfuse.engine.context import ClientState, RoundInfo, RunContext, ServerState
from fedfuse.engine.contract import Algorithm, Executor, Job
from fedfuse.engine.executors import make_executor
from fedfuse.engine.faults import DROPOUT, LATE, FaultPlan
from fedfuse.engine.local_dp import local_epsilon, sample_rate
from fedfuse.engine.personal import client_side, outgoing
from fedfuse.engine.round import Collected, RoundLedger
from fedfuse.engine.routing import executor_summary
from fedfuse.engine.sampling import make_sampler
from fedfuse.engine.validate import check_replies, is_state_like
from fedfuse.errors import DivergenceError, UserError
from fedfuse.privacy.dp import DP_SAMPLINGS, DPSettings, events_epsilon, round_event
from fedfuse.privacy.secure import SecAggAbort, SecAggSettings, secure_round
from fedfuse.rng import numpy_rng, secure_numpy_rng
from fedfuse.rundir import BEST_VAL_LOSS_MODEL, check_resume
from fedfuse.runtime.precision import resolve_precision, use_precision
from fedfuse.runtime.threads import apply_threads, worker_threads
from fedfuse.stats import best_round, final_mean, final_window, is_evaluation_metric, primary_metric
from fedfuse.types import Federation, Message

TIMING_KEYS = ("seconds", "wall_seconds")
#: what a central-DP round record withholds unless ``dp_debug_metrics``: who took part and how many (the count of a
#: Poisson sample, dropouts, late and quarantined replies, SecAgg's survivors, the traffic and work that scale with
#: it), the training loss over the participants, the exact clipped count and per-client test metrics
DP_WITHHELD = ("clients", "replied", "dropped", "late", "delivered_late", "quarantined", "train_loss", "bytes_down",
               "bytes_up", "bytes_peer", "client_flops", "total_bytes_down", "total_bytes_up", "total_bytes_peer",
               "total_client_flops", "total_dropped", "total_late", "total_quarantined", "dp_clipped",
               "client_test_accuracy", "communicated_parameters_per_client", "optimised_parameters_per_client",
               "clients_without_test")
DP_WITHHELD_PREFIXES = ("secagg_",)  # SecAgg's counts of clients, nodes and survivors, and its abort message
NO_GUARANTEE = "no privacy guarantee"
MAX_ROLLBACKS = 8  # on_divergence=rollback halves the lr at most this many times in one round
log = logging.getLogger("fedfuse")


def build_federation(cfg: RunConfig, device: torch.device | str = "cpu") -> Federation:
    """Load the dataset, partition it, and give every client its train/val/test splits."""
    from fedfuse.data.datasets import load_dataset
    from fedfuse.data.federation import build_federation as _build
    from fedfuse.data.partition import make_partition

    ds = load_dataset(cfg.dataset, cfg.data_dir, **cfg.dataset_options)
    part = make_partition(cfg.partition, ds, cfg.clients, cfg.seed, **cfg.partition_options)
    return _build(ds, part, seed=cfg.seed, val_fraction=cfg.val_fraction, device=device)


def build_context(cfg: RunConfig, fed: Federation, device: torch.device) -> RunContext:
    train = TrainConfig(
        local_epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        optimizer=cfg.optimizer,
        grad_clip=cfg.grad_clip,
    )
    return RunContext(
        model_name=cfg.model,
        model_options=dict(cfg.model_options),
        input_shape=tuple(fed.input_shape),
        num_classes=fed.num_classes,
        task=fed.task,
        train=train,
        num_clients=fed.num_clients,
        clients_per_round=cfg.clients_per_round,
        client_sizes=fed.client_sizes(),
        seed=cfg.seed,
        device=device,
        eval_batch_size=cfg.eval_batch_size,
        eval_every=cfg.eval_every,
        dp=DPSettings(mode=cfg.dp, noise=cfg.dp_noise, clip=cfg.dp_clip, quantile=cfg.dp_quantile,
                      clip_lr=cfg.dp_clip_lr, count_noise=cfg.dp_count_noise, delta=cfg.dp_delta,
                      accountant=cfg.dp_accountant, reproducible=cfg.dp_reproducible,
                      debug_metrics=cfg.dp_debug_metrics),
        secagg=bool(cfg.secagg),
    )


def build_algorithm(cfg: RunConfig, ctx: RunContext, algorithm: type) -> Algorithm:
    """An instance of the algorithm class ``algorithm`` with the options of ``cfg`` (the engine never imports
    ``fedfuse.algorithms``: the caller hands it the class, e.g. ``fedfuse.algorithms.get_algorithm(name)``).

    The algorithm is constructed and initialised once as a dry run (algorithms inspect the model's structure
    there).  An option or model it cannot work with is a user error it raises (:class:`~fedfuse.errors.UserError`),
    reported as a :class:`ConfigError` naming the algorithm and the model; any other exception is a bug and
    propagates as it is."""
    cls: Any = algorithm
    try:
        algo = cls(ctx, cls.Options(**cfg.algorithm_options))
        with torch.random.fork_rng(devices=[]):
            algo.init_state()
    except UserError as e:
        raise ConfigError(f"algorithm {cfg.algorithm!r} (model {cfg.model!r}): {e}") from e
    return algo


def assemble(cfg: RunConfig, device: torch.device, algorithm: type, *,
             fed: Federation | None = None) -> tuple[Federation, RunContext, Algorithm]:
    """The federation, run context and algorithm of a validated config, exactly as every engine builds them
    (the in-process loop, and a Flower node rebuilding the run from the config it is sent)."""
    if fed is not None and fed.source is not None:  # another run's prepared federation: start from its data
        fed = fed.source
    fed = fed if fed is not None else build_federation(cfg, device)
    ctx = build_context(cfg, fed, device)
    algo = build_algorithm(cfg, ctx, algorithm)
    blinded = fed.blinded()
    prepared = algo.setup(blinded)  # an algorithm may hold data aside for the server (Fed-ET's public set)
    if prepared is not blinded:
        fed = dataclasses.replace(prepared.with_truth_of(fed), source=fed)  # it never saw the ground truth
        ctx.client_sizes = fed.client_sizes()
    return fed, ctx, algo


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


@dataclass
class Totals:
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_peer: int = 0
    client_flops: float = 0.0
    wall_seconds: float = 0.0
    dropped: int = 0  # sampled clients that never replied
    late: int = 0  # replies that missed the deadline
    quarantined: int = 0  # replies rejected by the update checks
    skipped_rounds: int = 0  # rounds with fewer replies than the quorum


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
        self.device = resolve_device(self.cfg.device)
        self.threads = apply_threads(self.cfg.threads)
        self.precision = resolve_precision(self.cfg.precision, self.device)  # fp32 | bf16 (runtime/precision.py)
        self.fed, self.ctx, self.algo = assemble(self.cfg, self.device, algorithm, fed=fed)
        self.client = client_side(self.algo)  # what executors run: with entries that stay local, engine/personal.py
        self.ctx.out_dir = Path(self.cfg.out) if self.cfg.out else None
        self.sampler = make_sampler(self.cfg.sampling, self.algo)
        self.local_dp_steps: dict[int, int] = {}  # dp=local: DP-SGD steps each client has taken so far
        self.dp_events: list[dict[str, Any]] = []  # dp=central: the accountant's event of every round run
        # central DP's client sampling: from the OS unless the research mode (the run seed) is asked for
        self.dp_select_rng = secure_numpy_rng() if self.ctx.dp.central and not self.ctx.dp.reproducible else None
        if self.ctx.dp.central and not self.ctx.dp.guarantee:
            why = ("dp_reproducible=true (noise and sampling from the run seed)" if self.ctx.dp.reproducible else
                   "dp_debug_metrics=true" if self.ctx.dp.debug_metrics else "dp_noise=0")
            log.warning("dp=central with %s: %s (the outputs say so)", why, NO_GUARANTEE)
        self.secagg = SecAggSettings.from_config(self.cfg)
        if self.ctx.dp.central and self.sampler.name not in DP_SAMPLINGS:
            raise ConfigError(f"sampling: central DP is accounted for sampling {' or '.join(DP_SAMPLINGS)}; "
                              f"{self.cfg.algorithm!r} samples {self.sampler.name!r} (set --set sampling=poisson)")
        # fit/evaluate get the clients' data without the ground truth; only diagnostics/finish see self.fed
        self.executor = executor or make_executor(self.cfg.executor, self.fed.blinded().clients, self.cfg.seed,
                                                  threads=worker_threads(self.cfg.threads), config=self.cfg)
        self.executor.bind(self.ctx)  # executors that send the local-training settings along
        self.progress = progress
        self.on_round = on_round
        self.callbacks = CallbackList(callbacks)
        self.out = Path(self.cfg.out) if self.cfg.out else None
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.totals = Totals()
        self.start_round = 0
        self.state: ServerState = {}
        self.client_states: dict[int, ClientState] = {}
        self.faults = FaultPlan.from_config(self.cfg)
        self.late_box: dict[int, tuple[Message, Message]] = {}  # late_replies=next-round: cid -> (reply, sent)

    def attach(self, *callbacks: Callback) -> None:
        """Add callbacks after construction (e.g. ones that need :attr:`fed`)."""
        self.callbacks.callbacks.extend(callbacks)

    # ---- setup / resume ------------------------------------------------------------------------
    def _fresh(self) -> None:
        self.state = self.algo.init_state()
        self.client_states = {c: self.algo.init_client_state(c) for c in range(self.fed.num_clients)}
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            dump_yaml(self.cfg, self.out / "config.yaml")
            (self.out / "metrics.jsonl").write_text("")

    def _resume(self) -> None:
        assert self.out is not None
        path = self.out / CHECKPOINT
        ck = load_checkpoint(path, self.device)
        check_resume(ck.get("config") or {}, self.cfg, int(ck["round"]), str(path))
        self.state = ck["state"]
        self.client_states = ck["client_states"]
        self.start_round = int(ck["round"])
        self.totals = Totals(**ck["totals"])
        self.best = ck["best"]
        self.history = ck["history"]
        if ck.get("lr") is not None:  # halved by on_divergence=rollback
            self.ctx.train = dataclasses.replace(self.ctx.train, lr=float(ck["lr"]))
        if ck["config"].get("rounds") != self.cfg.rounds:  # a resume that extends the run
            dump_yaml(self.cfg, self.out / "config.yaml")
        self.executor.restore(ck.get("executor"))  # auto: keep the executor the probe chose
        self.executor.routing().load_state_dict(ck.get("routes"))  # the summary counts the earlier rounds too
        self.sampler.load_state_dict(ck.get("sampler", {}))
        self.local_dp_steps = dict(ck.get("local_dp_steps", {}))
        self.dp_events = self._stored_dp_events(ck)
        self.late_box = ck.get("late_box", {})
        # metrics written after the checkpoint (a kill between the two) are dropped and recomputed
        lines = [json.dumps(rec) for rec in self.history]
        (self.out / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))

    def _stored_dp_events(self, ck: dict[str, Any]) -> list[dict[str, Any]]:
        """The central-DP rounds the checkpoint has spent: its stored events (a checkpoint written before they
        were stored: one event per completed round from its own config, which resume keeps fixed)."""
        if "dp_events" in ck:
            return [dict(e) for e in ck["dp_events"]]
        saved = ck.get("config") or {}
        if saved.get("dp") != "central":
            return []
        one = round_event(float(saved["dp_noise"]), self.ctx.num_clients, int(saved["clients_per_round"]),
                          self.sampler.name, str(saved.get("dp_accountant", "rdp")))
        return [dict(one) for _ in range(int(ck["round"]))]

    def _checkpoint(self, next_round: int) -> None:
        assert self.out is not None
        ck = {
            "round": next_round,
            "state": self.state,
            "client_states": self.client_states,
            "totals": dataclasses.asdict(self.totals),
            "best": self.best,
            "history": self.history,
            "sampler": self.sampler.state_dict(),
            "local_dp_steps": dict(self.local_dp_steps),
            "dp_events": [dict(e) for e in self.dp_events],
            "late_box": self.late_box,
            "config": self.cfg.to_dict(),
            "lr": self.ctx.train.lr,
            "executor": self.executor.describe(),
            "routes": self.executor.routing().state_dict(),
        }
        save_checkpoint(self.out / CHECKPOINT, ck)

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
            t0 = time.perf_counter()
            with use_precision(self.precision, self.cfg.memory_format, self.cfg.fp32_matmul):
                rec = self._guarded_round(r)
            self.totals.wall_seconds += time.perf_counter() - t0
            rec["seconds"] = time.perf_counter() - t0
            rec["wall_seconds"] = self.totals.wall_seconds
            rec = _clean(rec)
            self.history.append(rec)
            if "val_loss" in rec:
                self._track_best(rec)
            if self.out:
                with open(self.out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(rec) + "\n")
                if (r + 1) % self.cfg.checkpoint_every == 0 or r + 1 == R:
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
        if self.out:
            self._finish(summary)
        return summary

    def _guarded_round(self, r: int) -> dict[str, Any]:
        """One round; a non-finite outcome stops the run (or, with on_divergence=rollback, redoes the round from
        the state before it with half the learning rate)."""
        rollback = self.cfg.on_divergence == "rollback"
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
                raise DivergenceError(self._divergence_message(r, why, lr))
            self.state, self.client_states, self.totals, sampler_state, self.late_box = saved
            self.sampler.load_state_dict(sampler_state)
            self.ctx.train = dataclasses.replace(self.ctx.train, lr=lr / 2)
            log.warning("round %d diverged (%s); rolled back, lr %.4g -> %.4g", r + 1, why, lr, lr / 2)
        raise AssertionError("unreachable")

    def _divergence_message(self, r: int, why: str, lr: float) -> str:
        msg = f"the run diverged in round {r + 1}: {why}."
        ck = self.out / CHECKPOINT if self.out else None
        done = checkpoint_round(ck) if ck is not None else None
        if done is not None:
            msg += f" The last good checkpoint ({ck}, after round {done}) is kept."
        if self.cfg.on_divergence == "rollback":
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
        if self.ctx.dp.central:  # the round released a noised aggregate (even an empty one): account it
            self.dp_events.append(round_event(self.ctx.dp.noise, self.ctx.num_clients, self.ctx.clients_per_round,
                                              self.sampler.name, self.ctx.dp.accountant))
        rec.update(self._privacy_record(r))
        why = self._diverged(ledger.honest_bad, ledger.honest_replies, ledger.train_loss)
        if why:
            rec["_diverged"] = why
            return self._withhold(rec)
        if (r + 1) % self.cfg.eval_every == 0 or r + 1 == self.cfg.rounds:
            rec.update(self.evaluate(r))
        return self._withhold(rec)

    def _withhold(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Central DP: the record without what touches individual clients (:data:`DP_WITHHELD`) — unless
        ``dp_debug_metrics``, and then the record says the run has no guarantee."""
        dp = self.ctx.dp
        if not dp.central:
            return rec
        if not dp.debug_metrics:
            rec = {k: v for k, v in rec.items() if k not in DP_WITHHELD and not k.startswith(DP_WITHHELD_PREFIXES)}
        rec["dp_guarantee"] = dp.guarantee
        return rec

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
        if self.ctx.dp.local:  # every model a client sends costs its examples privacy, used or not
            for c, (res, _) in outs.items():
                if res.stats is not None:
                    self.local_dp_steps[c] = self.local_dp_steps.get(c, 0) + int(res.stats.steps)
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
                if self.cfg.late_replies == "next-round" and info.stage == 0:
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
        if not (self.cfg.check_updates and results) or self.cfg.secagg:  # under SecAgg it cannot inspect them
            return results
        bad = check_replies(self.algo, got.sent, results, self.ctx.client_sizes, self.cfg.norm_bound,
                            self.cfg.norm_max)
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
        if not central and len(results) < max(self.cfg.quorum, 1):
            self.state = start_state
            ledger.skipped = True
            return False
        results, moved = self.algo.exchange(info, results)
        ledger.peer += moved
        if not self.cfg.secagg:
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

    def _privacy_record(self, r: int) -> dict[str, Any]:
        """Central DP: ε at δ of every round run so far (the stored events, composed; every round counts) and the
        mechanism's own record (the clip, the clipped clients) from the server state's ``dp`` entry."""
        dp = self.ctx.dp
        if dp.local:
            return self._local_dp_record()
        if not dp.central:
            return {}
        eps = events_epsilon(self.dp_events, dp.delta)
        out: dict[str, Any] = {"dp_epsilon": eps if math.isfinite(eps) else None, "dp_delta": dp.delta}
        out.update({f"dp_{k}": v for k, v in (self.state.get("dp") or {}).items()})
        return out

    def _local_dp_record(self) -> dict[str, Any]:
        """Local DP: every client's ε_i at δ over all its DP-SGD steps so far (Opacus's RDP accountant); the
        largest (the run's guarantee for every example) and the median over the clients that trained."""
        dp, bs = self.ctx.dp, self.ctx.train.batch_size
        eps = []
        for c, steps in sorted(self.local_dp_steps.items()):
            n = int(self.ctx.client_sizes[c])
            eps.append(local_epsilon(dp.noise, sample_rate(n, min(bs, max(n, 1))), steps, dp.delta))
        if not eps:
            return {"dp_epsilon": 0.0, "dp_delta": dp.delta}
        finite = all(math.isfinite(e) for e in eps)
        return {"dp_epsilon": max(eps) if finite else None, "dp_epsilon_median": float(np.median(eps)),
                "dp_delta": dp.delta, "dp_clients": len(eps)}

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
        """Global model on the global test set; every client's personal model on its own splits."""
        out: dict[str, Any] = {"global_accuracy": None, "global_loss": None}
        g = self.algo.global_model(self.state)
        if g is not None:
            model = self.ctx.load(g[0], g[1])
            st = evaluate_model(model, self.fed.test, self.cfg.eval_batch_size)
            out["global_accuracy"], out["global_loss"] = st.accuracy, st.loss
        everyone = list(range(self.fed.num_clients))
        payloads = outgoing(self.client, self.algo.configure_evaluate(self.state, everyone))
        jobs = [Job(c, payloads[c], self.client_states.get(c), ("evaluate", r, 0)) for c in everyone]
        res = dict(sorted(self.executor.map(self.client.evaluate, jobs).items()))
        out.update(aggregate_client_metrics(res))
        out["loss"] = out["global_loss"] if out["global_loss"] is not None else out["personal_loss"]
        if self.fed.task == "lm":
            out["perplexity"] = _exp(out["loss"])
            out["personal_perplexity"] = _exp(out["personal_loss"])
        out.update(self.algo.diagnostics(self.state, self.fed, RoundInfo(index=r, total=self.cfg.rounds)))
        return out

    def _track_best(self, rec: dict[str, Any]) -> None:
        """Keep the record (and, with ``out``, the global model: ``model_best_val_loss.pt``) of the round with the
        lowest validation loss: the model a run selects without looking at the test sets."""
        v = rec.get("val_loss")
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return
        if self.best is None or v < self.best["val_loss"]:
            self.best = dict(rec)
            if self.out:
                g = self.algo.global_model(self.state)
                if g is not None:
                    torch.save({"state": g[0], "meta": g[1], "round": rec["round"]}, self.out / BEST_VAL_LOSS_MODEL)

    # ---- outputs -------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """``summary.json``: the run's ``final`` (:func:`final_block`), ``last`` (the last evaluated round), ``best``
        (the evaluated round with the highest accuracy, :func:`fedfuse.stats.primary_metric`) and ``best_val_loss``
        (the round with the lowest validation loss, whose model is ``model_best_val_loss.pt``) blocks."""
        evaluated = [h for h in self.history if "personal_accuracy" in h]
        last = evaluated[-1] if evaluated else (self.history[-1] if self.history else {})
        metric = primary_metric(evaluated)
        return {
            "algorithm": self.cfg.algorithm,
            "dataset": self.cfg.dataset,
            "partition": self.cfg.partition,
            "model": self.cfg.model,
            "task": self.fed.task,
            "clients": self.fed.num_clients,
            "rounds_completed": len(self.history),
            "final": final_block(self.history, last),
            "last": _block(last),
            "best": {"metric": metric, **_block(best_round(evaluated, metric) or last)},
            "best_val_loss": _block(self.best or last),
            "totals": dataclasses.asdict(self.totals),
            "wall_seconds": self.totals.wall_seconds,
            # what was asked for, what trained the clients and why a request was re-routed (engine/routing.py)
            "executor": executor_summary(self.cfg.executor, self.executor.routing(), self.executor.describe()),
            "precision": self.precision,
            "threads": self.threads,
            **self._dp_summary(),
        }

    def _dp_summary(self) -> dict[str, Any]:
        """Central DP: whether the run may claim its (ε, δ) and, when it may not, why; the run totals that count
        clients are withheld like the round records' (:data:`DP_WITHHELD`)."""
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
            out["totals"] = {"wall_seconds": self.totals.wall_seconds}
        return out

    def _finish(self, summary: dict[str, Any]) -> None:
        assert self.out is not None
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        g = self.algo.global_model(self.state)
        if g is not None:
            torch.save({"state": g[0], "meta": g[1], "round": len(self.history)}, self.out / "model_final.pt")
        self.algo.finish(self.state, self.fed, self.out)


def outs_results(outs: dict[int, Any]) -> dict[int, Message]:
    """The reply part of an executor's ``{cid: (reply, client_state)}`` output."""
    return {c: o[0] for c, o in outs.items()}


def final_block(history: Sequence[dict[str, Any]], last: dict[str, Any]) -> dict[str, Any]:
    """``summary.json``'s ``final``: every evaluation metric (:func:`fedfuse.stats.is_evaluation_metric`) as its
    final value (:func:`fedfuse.stats.final_mean`: the mean of the last 5 evaluations, or of the later half of a
    shorter run's), everything else (totals, parameter counts, diagnostics, wall time) as at the ``last``
    evaluated round; ``window`` = how many evaluations the accuracies average (of the primary metric)."""
    block = _block(last)
    for key, v in block.items():
        if is_evaluation_metric(key) and isinstance(v, int | float) and not isinstance(v, bool):
            block[key] = final_mean(history, key)
    metric = primary_metric(history)
    block["window"] = final_window(sum(1 for h in history if h.get(metric) is not None))
    return block


def _block(rec: dict[str, Any]) -> dict[str, Any]:
    """A summary block: the record's scalar metrics (diagnostics included) with totals as cumulative bytes/FLOPs."""
    b = {k: v for k, v in rec.items() if isinstance(v, int | float | str | bool) or v is None}
    for k in ("bytes_down", "bytes_up", "bytes_peer", "client_flops", "seconds"):
        b.pop(k, None)  # per-round values; the block reports totals
    b["bytes_down"] = b.pop("total_bytes_down", None)
    b["bytes_up"] = b.pop("total_bytes_up", None)
    b["bytes_peer"] = b.pop("total_bytes_peer", None)
    b["client_flops"] = b.pop("total_client_flops", None)
    return b


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


def _clean(obj: Any) -> Any:
    """NaN/inf → None so metrics stay strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def _exp(x: float | None) -> float | None:
    return None if x is None else float(math.exp(min(x, 700.0)))


def _postfix(rec: dict[str, Any]) -> str:
    parts = []
    for k, short in (("global_accuracy", "glob"), ("personal_accuracy", "pers"), ("perplexity", "ppl")):
        v = rec.get(k)
        if v is not None:
            parts.append(f"{short}={v:.3f}" if k != "perplexity" else f"{short}={v:.1f}")
    return " ".join(parts)


def strip_timing(rec: dict[str, Any]) -> dict[str, Any]:
    """A metrics record without wall-clock fields (for bit-identity comparisons)."""
    return {k: v for k, v in rec.items() if k not in TIMING_KEYS}


def run(cfg: RunConfig, algorithm: type, *, resume: bool = False, progress: bool = False) -> dict[str, Any]:
    """Convenience wrapper: build an :class:`Experiment` of ``algorithm`` and run it; returns the summary."""
    return Experiment(cfg, algorithm, progress=progress).run(resume=resume)
