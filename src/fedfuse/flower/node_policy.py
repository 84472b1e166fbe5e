"""What a device decides for itself, whatever the server sends: the files it opens and its local DP.

The server writes the run config every job carries.  A device (SuperNode) trusts it with *what to compute* (the
algorithm, its settings, the model) but not with what protects the device:

* **Paths** (:func:`node_view`).  ``data_dir``, the run directory ``out``, a LoRA ``base`` and the path of an
  ``hf:PATH`` dataset are taken from the node's own configuration (``flower-supernode --node-config``: ``data-dir``,
  ``lora-base``, ``hf-dataset``; or the node's environment: ``FEDFUSE_DATA``, ``FEDFUSE_LORA_BASE``,
  ``FEDFUSE_HF_DATASET``), never from the server's message.  A run that needs a base or an ``hf:`` dataset the
  node was not given is refused.
* **Local DP** (:class:`NodeDP`).  A node started with ``dp-noise``, ``dp-clip`` and ``dp-epsilon`` (and
  optionally ``dp-delta``, default 1e-5; the accountant lives in ``state-dir``) trains only under DP-SGD at least
  that strong: a job of a run with ``dp`` other than ``local``, a smaller ``dp_noise`` or a larger ``dp_clip`` is
  refused.  The node accounts ε of each of its clients itself (Opacus's RDP accountant over every DP-SGD step it
  ran for that client, in every run, persisted in ``state-dir/local-dp.json``) and refuses a training job whose
  steps (``local_epochs`` × ⌈n/B⌉, ``max_steps``, as the server asks) would take a client past ``dp-epsilon``.
  The noise and the Poisson batches come from a generator seeded from ``os.urandom``
  (:func:`fedfuse.engine.local_dp.secure_generator`), not from the seed the job carries.  The check and the
  charge sit in DP-SGD itself (:func:`fedfuse.engine.local_dp.guarded`): every call is checked with the noise,
  clip, sampling rate and steps it really runs with, whatever algorithm makes it; a training job that took steps
  outside DP-SGD has its reply withheld.

A refused job is a :class:`RefusedJob`: the node replies with an error (logged on both sides) and the server counts
the client as a dropout of the round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: node config keys naming the node's own files, with the environment variable each falls back to
NODE_PATHS = {"data-dir": "FEDFUSE_DATA", "lora-base": "FEDFUSE_LORA_BASE", "hf-dataset": "FEDFUSE_HF_DATASET"}
NODE_DP_KEYS = ("dp-noise", "dp-clip", "dp-epsilon", "dp-delta", "state-dir")
ACCOUNTANT_FILE = "local-dp.json"
HF_PREFIX = "hf:"


class RefusedJob(Exception):
    """A job the node will not run (a client it does not hold, a weaker local DP than its own, a path it was not
    given, a run whose data settings differ from its bundle's): the reply is an error with this message."""


def _node_value(node_config: Mapping[str, Any], key: str) -> str | None:
    value = node_config.get(key)
    if value in (None, ""):
        value = os.environ.get(NODE_PATHS[key]) or None
    return None if value is None else str(value)


def node_view(cfg: Any, node_config: Mapping[str, Any]) -> Any:
    """``cfg`` (a resolved :class:`~fedfuse.config.RunConfig`) with every path replaced by the node's own: the
    data directory, no run directory, the node's LoRA base and ``hf:`` dataset (:class:`RefusedJob` when the run
    needs one the node was not given).  With node-local data (``data``) the run's dataset files are never read."""
    changes: dict[str, Any] = {"data_dir": _node_value(node_config, "data-dir"), "out": None}
    if str(cfg.dataset).startswith(HF_PREFIX) and not node_config.get("data"):
        own = _node_value(node_config, "hf-dataset")
        if own is None:
            raise RefusedJob(f"the run's dataset is {HF_PREFIX}PATH; this node reads a dataset only from its own "
                             "config (--node-config \"hf-dataset='/path'\") or node-local data (data='DIR')")
        changes["dataset"] = HF_PREFIX + own
    opts = dict(cfg.algorithm_options or {})
    if opts.get("base"):
        own = _node_value(node_config, "lora-base")
        if own is None:
            raise RefusedJob(f"the run needs a LoRA base (the server names {opts['base']!r}); this node loads a base "
                             "only from its own config: --node-config \"lora-base='fedfuse:/path/base.pt'\"")
        changes["algorithm_options"] = {**opts, "base": own}
    return dataclasses.replace(cfg, **changes)


# ---- local DP the node enforces -----------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeDP:
    """The local DP a node enforces (see the module docstring): the smallest noise multiplier, the largest clip,
    the ε budget of each client at ``delta``, and the directory of its accountant."""

    noise: float
    clip: float
    epsilon: float
    delta: float
    state_dir: Path

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeDP | None:
        """The node's policy, or None when it sets none of ``dp-noise``, ``dp-clip``, ``dp-epsilon``.  Setting
        some but not all of them, or a value out of range, is an error (the node must not run half-protected)."""
        given = {k: node_config[k] for k in NODE_DP_KEYS if node_config.get(k) not in (None, "")}
        if not any(k in given for k in ("dp-noise", "dp-clip", "dp-epsilon")):
            return None
        missing = [k for k in ("dp-noise", "dp-clip", "dp-epsilon", "state-dir") if k not in given]
        if missing:
            raise RefusedJob(f"node local DP: set {', '.join(missing)} too (--node-config \"dp-noise=1.1 "
                             "dp-clip=1.0 dp-epsilon=8 state-dir='/var/lib/fedfuse'\"); no job runs half-protected")
        try:
            policy = cls(float(given["dp-noise"]), float(given["dp-clip"]), float(given["dp-epsilon"]),
                         float(given.get("dp-delta", 1e-5)), Path(str(given["state-dir"])))
        except ValueError as e:
            raise RefusedJob(f"node local DP: {e}") from None
        if not (policy.noise > 0 and policy.clip > 0 and policy.epsilon > 0 and 0 < policy.delta < 1):
            raise RefusedJob(f"node local DP: dp-noise, dp-clip and dp-epsilon must be > 0 and dp-delta in (0, 1), "
                             f"got {policy.noise}, {policy.clip}, {policy.epsilon}, {policy.delta}")
        return policy

    def describe(self) -> str:
        return (f"dp=local with dp_noise ≥ {self.noise:g}, dp_clip ≤ {self.clip:g}, ε ≤ {self.epsilon:g} at "
                f"δ={self.delta:g}")

    def check_run(self, cfg: Any) -> None:
        """Refuse a run whose local DP is weaker than the node's."""
        weaker = []
        if cfg.dp != "local":
            weaker.append(f"dp={cfg.dp}")
        else:
            if not cfg.dp_noise >= self.noise:
                weaker.append(f"dp_noise={cfg.dp_noise:g}")
            if not cfg.dp_clip <= self.clip:
                weaker.append(f"dp_clip={cfg.dp_clip:g}")
        if weaker:
            raise RefusedJob(f"this node trains only under {self.describe()}; the run asks {', '.join(weaker)}: "
                             "job refused")

    def accountant(self) -> NodeAccountant:
        return NodeAccountant(self.state_dir / ACCOUNTANT_FILE, self.delta)

    def guard(self, cid: int) -> NodeGuard:
        """The check of every DP-SGD call of client ``cid``'s job (:func:`fedfuse.engine.local_dp.guarded`)."""
        return NodeGuard(self, cid)


class NodeGuard:
    """Checks each DP-SGD call of one job with the parameters it really runs with — noise and clip at least the
    node's, the steps within the client's budget (charged before they run, corrected after) — whatever algorithm
    makes the call."""

    def __init__(self, policy: NodeDP, cid: int) -> None:
        self.policy, self.cid = policy, cid
        self.book = policy.accountant()
        self.charged: list[int] = []

    def admit(self, noise: float, clip: float, rate: float, steps: int) -> None:
        p = self.policy
        if not (noise >= p.noise and clip <= p.clip):
            raise RefusedJob(f"client {self.cid}: DP-SGD asked with noise {noise:g}, clip {clip:g}; this node trains "
                             f"only under {p.describe()}: job refused")
        self.charged.append(self.book.reserve(self.cid, noise, rate, steps, p.epsilon))

    def spent(self, steps: int) -> None:
        if self.charged:
            self.book.settle(self.cid, self.charged[-1], steps)


class NodeAccountant:
    """ε of each client a node trains, composed over every DP-SGD step it ran for that client (Opacus's RDP
    accountant), kept in a JSON file: ``{"clients": {cid: [[noise, rate, steps], ...]}}``.  Reads and writes
    are under an exclusive lock on the file, so several processes of one node account together."""

    def __init__(self, path: Path, delta: float) -> None:
        self.path = Path(path)
        self.delta = delta

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            book = json.loads(self.path.read_text()) if self.path.is_file() else {"clients": {}}
            yield book
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(book, indent=1))
            os.replace(tmp, self.path)

    def history(self, cid: int) -> list[tuple[float, float, int]]:
        """The (noise, sampling rate, steps) entries of client ``cid``."""
        book = json.loads(self.path.read_text()) if self.path.is_file() else {"clients": {}}
        return [(float(z), float(q), int(s)) for z, q, s in book["clients"].get(str(cid), [])]

    def epsilon(self, cid: int, extra: list[tuple[float, float, int]] | None = None) -> float:
        """ε at the node's δ of client ``cid``'s steps so far (and ``extra`` ones)."""
        return composed_epsilon([*self.history(cid), *(extra or [])], self.delta)

    def reserve(self, cid: int, noise: float, rate: float, steps: int, budget: float) -> int:
        """Charge ``steps`` DP-SGD steps of client ``cid`` before they run, or raise :class:`RefusedJob` if they
        would take it past ``budget``; returns the entry's index (:meth:`settle` corrects it after training)."""
        with self._locked() as book:
            entries = book["clients"].setdefault(str(cid), [])
            now = composed_epsilon([tuple(e) for e in entries], self.delta)
            after = composed_epsilon([*(tuple(e) for e in entries), (noise, rate, steps)], self.delta)
            if after > budget:
                raise RefusedJob(f"client {cid}: this job's {steps} DP-SGD steps (noise {noise:g}, sampling rate "
                                 f"{rate:.4g}) would bring its ε from {now:.3f} to {after:.3f}, past this node's "
                                 f"budget ε ≤ {budget:g} at δ={self.delta:g}: job refused")
            entries.append([float(noise), float(rate), int(steps)])
            return len(entries) - 1

    def settle(self, cid: int, index: int, steps: int) -> None:
        """The steps entry ``index`` of client ``cid`` really took (at most the reserved ones)."""
        with self._locked() as book:
            entry = book["clients"][str(cid)][index]
            entry[2] = min(int(entry[2]), int(steps))


def composed_epsilon(entries: list[tuple[float, float, int]], delta: float) -> float:
    """ε at ``delta`` of DP-SGD steps ``(noise, sampling rate, steps)`` composed (Opacus's RDP accountant)."""
    from opacus.accountants import RDPAccountant

    entries = [(float(z), float(q), int(s)) for z, q, s in entries if int(s) > 0]
    if not entries:
        return 0.0
    if any(z <= 0 for z, _, _ in entries):
        return math.inf
    acc = RDPAccountant()
    acc.history = entries
    return float(acc.get_epsilon(delta))
