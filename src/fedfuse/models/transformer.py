"""A small Transformer for token sequences (language modelling or sequence classification).

Written out by hand so later features can reach every tensor: attention uses separate ``q_proj``,
``k_proj``, ``v_proj`` and ``out_proj`` Linear layers (Simple-FedMA permutes Q/K and V separately; MSfusion
slices heads and feed-forward units), the feed-forward net is ``fc1`` -> ReLU -> ``fc2``.  Module names::

    embed, pos_encoding,
    blocks.{i}.{attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, norm1, fc1, fc2, norm2},
    final_norm (pre-norm only), decoder (the head)

Blocks register their modules in forward order (post-norm: attn, norm1, fc1, fc2, norm2; pre-norm: norm1,
attn, norm2, fc1, fc2), so ``layers()`` runs input to output.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.errors import UserError
from fedfuse.models.base import FedModel
from fedfuse.structure import Member, PermGroup, UnitGroupBuilder, UnitGroups, axis


def sinusoid_table(length: int, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """The (length, dim) sinusoidal position table of Vaswani et al. (2017)."""
    pos = torch.arange(length, dtype=torch.float32, device=device).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, device=device)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return table


class SinusoidalPositionalEncoding(nn.Module):
    """Adds fixed sinusoidal positions.

    The table ``pe`` is a *non-persistent* buffer by default: it is the same on every client, so it is
    neither sent nor averaged.  ``persistent=True`` puts it in the state dict (layer kind "posenc"), which a
    method that permutes the residual stream (Simple-FedMA) needs so the permuted table travels with the
    weights.
    Sequences longer than the table get a freshly computed (unpermuted) table on the input's device.
    """

    layer_kind = "posenc"

    def __init__(self, dim: int, max_len: int, persistent: bool = False) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("pe", sinusoid_table(max_len, dim), persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        pe = self.pe[:length] if length <= self.pe.shape[0] else sinusoid_table(length, self.dim, x.device)
        return x + pe.to(x.dtype)


class SelfAttention(nn.Module):
    """Multi-head (optionally causal) self-attention with separate Q, K, V and output projections.

    Heads are contiguous blocks of ``head_dim`` output rows of Q/K/V (head h = rows h·hd ... (h+1)·hd - 1).
    The head count is ``n_heads``; the per-head width is inferred at run time, so slicing units *within* every
    head needs no change, while dropping whole heads must also update ``n_heads``.
    """

    def __init__(self, dim: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
        b, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, length, self.n_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
        return self.out_proj(y.transpose(1, 2).reshape(b, length, -1))


class TransformerBlock(nn.Module):
    """Encoder block: self-attention and a ReLU feed-forward net, each with residual, LayerNorm, dropout."""

    def __init__(self, dim: int, n_heads: int, d_ff: int, dropout: float, norm_first: bool) -> None:
        super().__init__()
        self.norm_first = norm_first
        if norm_first:
            self.norm1 = nn.LayerNorm(dim)
            self.attn = SelfAttention(dim, n_heads, dropout)
            self.norm2 = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, d_ff)
            self.fc2 = nn.Linear(d_ff, dim)
        else:
            self.attn = SelfAttention(dim, n_heads, dropout)
            self.norm1 = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, d_ff)
            self.fc2 = nn.Linear(d_ff, dim)
            self.norm2 = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)

    def _ff(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.relu(self.fc1(x))))

    def forward(self, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
        if self.norm_first:
            x = x + self.drop(self.attn(self.norm1(x), causal))
            return x + self.drop(self._ff(self.norm2(x)))
        x = self.norm1(x + self.drop(self.attn(x, causal)))
        return self.norm2(x + self.drop(self._ff(x)))


class TransformerModel(FedModel):
    """Token embedding (scaled by √d) + sinusoidal positions -> N causal blocks -> linear ``decoder``.

    ``task="lm"``: per-token logits (B, L, V).  ``task="classification"``: logits of the last position (B, C);
    the causal mask lets the last position see the whole sequence.  ``tie_weights`` shares the decoder weight
    with the embedding (needs vocabulary size == number of outputs); the tied key ``decoder.weight`` is
    grouped with ``embed.weight`` in ``layers()``.
    """

    head_name = "decoder"

    def __init__(
        self,
        vocab_size: int,
        num_outputs: int,
        task: str = "lm",
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 2,
        d_ff: int = 256,
        dropout: float = 0.2,
        tie_weights: bool = False,
        norm_first: bool = False,
        max_len: int = 512,
        persistent_pe: bool = False,
    ) -> None:
        super().__init__(task)
        if d_model % n_heads:
            raise UserError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if tie_weights and vocab_size != num_outputs:
            raise UserError("tie_weights needs vocab_size == num_classes")
        self.d_model = d_model
        self.n_heads = n_heads
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_encoding = SinusoidalPositionalEncoding(d_model, max_len, persistent=persistent_pe)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, n_heads, d_ff, dropout, norm_first) for _ in range(n_layers)
        )
        self.final_norm = nn.LayerNorm(d_model) if norm_first else nn.Identity()
        self.decoder = nn.Linear(d_model, num_outputs)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if tie_weights:
            self.decoder.weight = self.embed.weight
        else:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.pos_encoding(self.embed(x) * math.sqrt(self.d_model)))
        for block in self.blocks:
            h = block(h, causal=True)
        h = self.final_norm(h)
        return h if self.task == "lm" else h[:, -1]

    def unit_groups(self) -> UnitGroups:
        """Width slicing: per block, the within-head units of attention (``blocks.{i}.attn``: the same positions
        in every head of Q, K, V and the input columns of ``out_proj``) and the feed-forward hidden units
        (``blocks.{i}.ff``).  The residual stream, embedding and decoder are not split (no feature group)."""
        b = UnitGroupBuilder(self.state_dict())
        for i, block in enumerate(self.blocks):
            att, ff = f"blocks.{i}.attn", f"blocks.{i}.ff"
            h = block.attn.n_heads
            b.group(att, block.attn.q_proj.out_features // h)
            b.group(ff, block.fc1.out_features)
            for proj in ("q_proj", "k_proj", "v_proj"):
                b.layer(f"blocks.{i}.attn.{proj}", axis(att, h), None)
            b.layer(f"blocks.{i}.attn.out_proj", None, axis(att, h))
            b.layer(f"blocks.{i}.fc1", axis(ff), None)
            b.layer(f"blocks.{i}.fc2", None, axis(ff))
        return b.build(None)

    def perm_groups(self, residual: bool | None = None) -> list[PermGroup]:
        """Permutation groups, in the order Simple-FedMA determines them.

        * ``residual`` (d_model): embedding columns, positional table (needs ``persistent_pe=True``), Q/K/V and
          ``fc1`` input columns, ``out_proj``/``fc2`` rows and biases, every LayerNorm, decoder columns.
          ``residual=None`` includes it exactly when the positional table is in the state dict.
        * per block ``blocks.{i}.qk``: Q and K rows (and biases) share one permutation within each head;
        * ``blocks.{i}.v``: V rows and bias, ``out_proj`` input columns;
        * ``blocks.{i}.mlp``: ``fc1`` rows and bias, ``fc2`` input columns.

        ``qk`` and ``v`` have ``head_dim`` set: a valid permutation moves whole heads (the same head order for
        Q/K and V) and permutes within heads; see :func:`fedfuse.fusion.permute.head_structured`.
        """
        state = self.state_dict()
        has_pe = "pos_encoding.pe" in state
        if residual is None:
            residual = has_pe
        if residual and not has_pe:
            raise UserError("permuting the residual stream needs the positional table in the state "
                            "(build the transformer with persistent_pe=True)")
        d = int(self.d_model)
        n_heads = int(self.n_heads)
        groups: list[PermGroup] = []
        if residual:
            res = [Member("embed.weight", 1), Member("pos_encoding.pe", 1)]
            for i, _ in enumerate(self.blocks):
                b = f"blocks.{i}"
                res += [Member(f"{b}.attn.{p}_proj.weight", 1, role="out") for p in ("q", "k", "v")]
                res += [Member(f"{b}.attn.out_proj.weight", 0), Member(f"{b}.attn.out_proj.bias", 0)]
                res += [Member(f"{b}.norm1.weight", 0), Member(f"{b}.norm1.bias", 0)]
                res += [Member(f"{b}.fc1.weight", 1, role="out")]
                res += [Member(f"{b}.fc2.weight", 0), Member(f"{b}.fc2.bias", 0)]
                res += [Member(f"{b}.norm2.weight", 0), Member(f"{b}.norm2.bias", 0)]
            if "final_norm.weight" in state:
                res += [Member("final_norm.weight", 0), Member("final_norm.bias", 0)]
            res.append(Member("decoder.weight", 1, role="out"))
            groups.append(PermGroup("residual", d, tuple(res), by=("embed.weight",)))
        hd = d // n_heads
        for i, blk in enumerate(self.blocks):
            b = f"blocks.{i}"
            qk = tuple(Member(f"{b}.attn.{p}_proj.{t}", 0) for p in ("q", "k") for t in ("weight", "bias"))
            v = (Member(f"{b}.attn.v_proj.weight", 0), Member(f"{b}.attn.v_proj.bias", 0),
                 Member(f"{b}.attn.out_proj.weight", 1, role="out"))
            mlp = (Member(f"{b}.fc1.weight", 0), Member(f"{b}.fc1.bias", 0), Member(f"{b}.fc2.weight", 1, role="out"))
            groups += [
                PermGroup(f"{b}.qk", d, qk, head_dim=hd),
                PermGroup(f"{b}.v", d, v, head_dim=hd),
                PermGroup(f"{b}.mlp", int(blk.fc1.weight.shape[0]), mlp),
            ]
        return groups
