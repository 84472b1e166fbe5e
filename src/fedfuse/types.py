"""Plain data types shared by every layer of fedfuse.

Everything that crosses a (simulated) network is a :class:`Message`: named tensors plus small
plain-data metadata.  That keeps payloads serialisable and lets the engines (sequential, batched,
Flower) move them without knowing which algorithm produced them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

TensorDict = dict[str, torch.Tensor]
Task = Literal["classification", "lm"]

#: Tensors named ``sim/...`` are simulation bookkeeping that would not cross a network in a deployment (a
#: serverless algorithm's relay of peer messages already counted as peer bytes, sub-models collected only to
#: assemble an evaluation model).  They travel with a Message but are not counted as communication.
SIM_PREFIX = "sim/"


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes needed to transmit ``tensors`` (dtype size × numel, no framing); ``sim/`` entries excluded."""
    return int(sum(t.numel() * t.element_size() for k, t in tensors.items() if not k.startswith(SIM_PREFIX)))


@dataclass
class FitStats:
    """What a client reports about its local work, typed: the engine's accounting and the aggregation weights
    read these fields, never strings in ``Message.meta``.

    ``num_examples`` is the size of the client's training set (n_i, the weight of sample-weighted means);
    ``samples`` the examples it processed (epochs × n_i); ``train_loss`` the mean training loss over them;
    ``flops`` its training (and any extra forward) FLOPs; ``trained_params`` the parameters it trained, or
    ``None`` for a stage that trains nothing (e.g. a BN-statistics pass), which the per-round mean skips."""

    num_examples: int = 0
    samples: int = 0
    steps: int = 0
    train_loss: float = 0.0
    flops: float = 0.0
    trained_params: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: Names that belong to :class:`FitStats`; a ``Message.meta`` carrying one of them is refused.
FIT_STATS_FIELDS = frozenset(f.name for f in dataclasses.fields(FitStats))


@dataclass
class Message:
    """What a server, client or peer sends: named tensors, JSON-able metadata and, on a client's reply, the
    typed :class:`FitStats` of its work."""

    tensors: TensorDict = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    stats: FitStats | None = None

    def __post_init__(self) -> None:
        clash = FIT_STATS_FIELDS.intersection(self.meta)
        if clash:
            raise ValueError(f"Message.meta carries {sorted(clash)}: report local work as Message(stats=FitStats(...))")

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.tensors)

    @property
    def num_examples(self) -> int:
        """The sender's declared training-set size (0 when it reported no :class:`FitStats`)."""
        return self.stats.num_examples if self.stats is not None else 0

    def to(self, device: torch.device | str) -> Message:
        return Message({k: v.to(device) for k, v in self.tensors.items()}, dict(self.meta),
                       dataclasses.replace(self.stats) if self.stats is not None else None)


@dataclass
class Split:
    """A tensor split: inputs ``x`` and targets ``y`` on one device."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def to(self, device: torch.device | str) -> Split:
        return Split(self.x.to(device), self.y.to(device))


@dataclass
class ClientData:
    """One client's local data: its own train / validation / test splits."""

    cid: int
    train: Split
    val: Split
    test: Split
    group: int | None = None  # ground truth (the partition's true cluster/domain): for diagnostics only

    @property
    def num_train(self) -> int:
        return len(self.train)

    def to(self, device: torch.device | str) -> ClientData:
        return ClientData(self.cid, self.train.to(device), self.val.to(device), self.test.to(device), self.group)

    def blinded(self) -> ClientData:
        """The client's data without the ground truth (``group`` None; the tensors are shared, not copied).
        This is what the engine hands to an algorithm's ``fit`` / ``evaluate``."""
        return self if self.group is None else dataclasses.replace(self, group=None)


#: :attr:`Federation.info` entries that are a partition's ground truth (true clusters, their classes, domains,
#: group sizes of consecutive client ids): diagnostics may read them, algorithm hooks never see them.
GROUND_TRUTH_INFO = ("client_classes", "clusters_classes", "group_sizes", "domains", "domain_names")


@dataclass
class Federation:
    """A dataset split among clients, plus the global test set."""

    clients: list[ClientData]
    test: Split
    num_classes: int
    input_shape: tuple[int, ...]
    task: Task = "classification"
    dataset: str = ""
    partition: str = ""
    class_names: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    #: the federation an algorithm's ``setup`` started from (Fed-ET holds a public set aside); ``None`` when
    #: this one is not derived.  A new run handed a derived federation starts again from its source.
    source: Federation | None = field(default=None, repr=False, compare=False)
    #: a federation without data (a deployed server: :func:`fedfuse.flower.server_data.dataless_federation`):
    #: every client's training-set size as its node reported it; its clients' splits and ``test`` are empty
    sizes: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def holds_data(self) -> bool:
        """False for a federation without data (:attr:`sizes`): only the clients' sizes and the data's shape."""
        return self.sizes is None

    def client_sizes(self) -> np.ndarray:
        if self.sizes is not None:
            return np.array(self.sizes, dtype=np.int64)
        return np.array([c.num_train for c in self.clients], dtype=np.int64)

    def groups(self) -> list[int] | None:
        """The partition's true client clusters (ground truth: only diagnostics are handed a Federation that
        has them), or None when the partition defines none."""
        g = [c.group for c in self.clients]
        return None if any(x is None for x in g) else [int(x) for x in g]  # type: ignore[arg-type]

    def blinded(self) -> Federation:
        """What the server side of an algorithm may know: the same clients and data without the ground truth
        (every client's ``group`` and the :data:`GROUND_TRUTH_INFO` entries removed)."""
        return dataclasses.replace(self, clients=[c.blinded() for c in self.clients],
                                   info={k: v for k, v in self.info.items() if k not in GROUND_TRUTH_INFO})

    def with_truth_of(self, truth: Federation) -> Federation:
        """This federation (e.g. what an algorithm's ``setup`` returned from a blinded one) with the ground truth
        of ``truth`` put back: each client's ``group`` (by client id) and the ground-truth ``info`` entries."""
        groups = {c.cid: c.group for c in truth.clients}
        info = {**self.info, **{k: v for k, v in truth.info.items() if k in GROUND_TRUTH_INFO}}
        clients = [dataclasses.replace(c, group=groups.get(c.cid)) for c in self.clients]
        return dataclasses.replace(self, clients=clients, info=info)


# ---- privacy declarations (docs/privacy.md) ---------------------------------------------------------------

class ServerView(enum.StrEnum):
    """The least a method's server (or coordinator) must see of the clients' work to run the method."""

    NOTHING_INDIVIDUAL = "nothing individual"  # only sums over clients (a secure-aggregation-shaped step)
    DELTAS = "per-client deltas"  # each client's update (or a function of it) individually
    MODELS = "per-client models"  # each client's trained model (parts) individually
    PEER_TO_PEER = "peer-to-peer only"  # no server step: clients exchange models with their peers


class Support(enum.StrEnum):
    """Whether a privacy mechanism applies to a method in fedfuse."""

    YES = "yes"  # built and admitted: the run option works
    NO = "no"  # the method's server step cannot work under it (the reason says why)
    NOT_BUILT = "not built"  # it could apply, fedfuse does not implement it for this method (the reason says how)


@dataclass(frozen=True)
class Admits:
    """One mechanism's verdict for one method, with its one-line reason."""

    support: Support
    why: str

    @property
    def ok(self) -> bool:
        return self.support is Support.YES


def yes(why: str) -> Admits:
    return Admits(Support.YES, why)


def no(why: str) -> Admits:
    return Admits(Support.NO, why)


def not_built(why: str) -> Admits:
    return Admits(Support.NOT_BUILT, why)


#: the mechanisms a run can request, as named in the declarations and the run options
MECHANISMS = ("central_dp", "local_dp", "secagg")


@dataclass(frozen=True)
class Privacy:
    """What a method's server must see (:class:`ServerView`, with why) and which of central DP, local DP and
    secure aggregation it admits.  ``when`` names the option values the entry describes (empty: the defaults);
    an algorithm lists its default entry first and option-dependent variants after it."""

    view: ServerView
    why: str
    central_dp: Admits
    local_dp: Admits
    secagg: Admits
    when: tuple[tuple[str, Any], ...] = ()

    def admits(self, mechanism: str) -> Admits:
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown privacy mechanism {mechanism!r}; choose one of {', '.join(MECHANISMS)}")
        return getattr(self, mechanism)

    def applies(self, options: Any) -> bool:
        """Whether ``options`` (an Options dataclass or a mapping) has every value of ``when``."""
        get = options.get if isinstance(options, Mapping) else (lambda k, d=None: getattr(options, k, d))
        return all(get(k) == v for k, v in self.when)


#: the entry of a method in which nothing leaves a client (Local, Local-LoRA)
LOCAL_ONLY = Privacy(ServerView.NOTHING_INDIVIDUAL, "nothing leaves a client: no server step at all",
                     central_dp=no("no server step exists to noise"),
                     local_dp=no("nothing is released, so there is nothing to protect"),
                     secagg=no("no messages to mask"))

def privacy_entry(entries: tuple[Privacy, ...], options: Any) -> Privacy | None:
    """The entry of ``entries`` that describes ``options``: the last variant whose ``when`` matches, else the first
    (``None`` when nothing is declared)."""
    if not entries:
        return None
    chosen = entries[0]
    for e in entries[1:]:
        if e.applies(options):
            chosen = e
    return chosen
