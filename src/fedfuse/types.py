"""Plain data types shared by every layer of fedfuse.

Everything that crosses a (simulated) network is a :class:`Message`: named tensors plus small
plain-data metadata.  That keeps payloads serialisable and lets the engines (sequential, batched,
Flower) move them without knowing which algorithm produced them.
"""

from __future__ import annotations

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
class Message:
    """What a server, client or peer sends: named tensors and JSON-able metadata."""

    tensors: TensorDict = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.tensors)

    def to(self, device: torch.device | str) -> Message:
        return Message({k: v.to(device) for k, v in self.tensors.items()}, dict(self.meta))


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
    group: int | None = None  # ground-truth cluster/domain when the partition defines one

    @property
    def num_train(self) -> int:
        return len(self.train)

    def to(self, device: torch.device | str) -> ClientData:
        return ClientData(self.cid, self.train.to(device), self.val.to(device), self.test.to(device), self.group)


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

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def client_sizes(self) -> np.ndarray:
        return np.array([c.num_train for c in self.clients], dtype=np.int64)

    def groups(self) -> list[int] | None:
        g = [c.group for c in self.clients]
        return None if any(x is None for x in g) else [int(x) for x in g]  # type: ignore[arg-type]
