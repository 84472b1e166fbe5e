"""Character-level recurrent networks (the LEAF Shakespeare model: embedding 8, 2-layer LSTM 256, linear).

Each recurrent layer is its own single-layer ``nn.LSTM`` / ``nn.GRU`` (``rnn.0``, ``rnn.1``, ...) so that the
layer structure is explicit (one :class:`~fedfuse.models.base.Layer` of kind "rnn" per recurrent layer).
"""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.errors import UserError
from fedfuse.models.base import FedModel

CELLS: dict[str, type[nn.RNNBase]] = {"lstm": nn.LSTM, "gru": nn.GRU}


class CharRNN(FedModel):
    """``embed`` -> ``rnn.{i}`` -> head ``fc``: per-token logits (lm) or last-step logits (classification)."""

    def __init__(
        self,
        vocab_size: int,
        num_outputs: int,
        task: str = "classification",
        cell: str = "lstm",
        embed_dim: int = 8,
        hidden: int = 256,
        num_layers: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(task)
        if cell not in CELLS:
            raise UserError(f"unknown cell {cell!r}; choose one of {sorted(CELLS)}")
        if num_layers < 1:
            raise UserError("num_layers must be >= 1")
        rnn_cls = CELLS[cell]
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.rnn = nn.ModuleList(
            rnn_cls(embed_dim if i == 0 else hidden, hidden, batch_first=True) for i in range(num_layers)
        )
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(hidden, num_outputs)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, rnn in enumerate(self.rnn):
            if i:
                h = self.drop(h)
            h, _ = rnn(h)
        return h if self.task == "lm" else h[:, -1]
