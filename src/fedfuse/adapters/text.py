"""Character tokenizer, local text corpora and the reproducible ``fedfuse pretrain`` step.

The base model of the local LoRA experiments is fedfuse's own ``transformer`` trained as a *character*
language model on WikiText-2 and PTB (their training splits) with the LEAF Shakespeare alphabet, so the same
vocabulary covers the federated fine-tuning data (Shakespeare roles, the task split) without any download.
A pretrained base is a ``.pt`` file with ``{"kind": "fedfuse-lm", "model": kwargs, "state": state_dict,
"vocab": [...], "info": {...}}``; it is cached under a key of its settings and data checksums, so running
``fedfuse pretrain`` twice trains once.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data.corpus import corpus_path, load_corpus
from fedfuse.data.datasets import LEAF_LETTERS, UNK, cache_dir
from fedfuse.errors import UserError

CHAR_VOCAB: list[str] = [*LEAF_LETTERS, UNK]


class CharTokenizer:
    """Characters of the LEAF Shakespeare alphabet (80 symbols) plus ``<unk>`` for anything else."""

    def __init__(self, vocab: Sequence[str] = CHAR_VOCAB) -> None:
        self.vocab = list(vocab)
        self.stoi = {c: i for i, c in enumerate(self.vocab)}
        self.unk_id = self.stoi.get(UNK, len(self.vocab) - 1)
        self.pad_id = self.stoi.get(" ", 0)
        self.eos_id = self.stoi.get("\n", 0)

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(c, self.unk_id) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.vocab[i] if 0 <= i < len(self.vocab) and i != self.unk_id else "?" for i in ids)


# ---------------------------------------------------------------------------------------------- pretraining

PRESETS: dict[str, dict[str, Any]] = {
    # the measured preset (docs/lora.md): 0.62 M parameters, about 6 minutes on one CPU core
    "small": {"d_model": 128, "n_heads": 4, "n_layers": 3, "d_ff": 512},
    # a larger base for a longer budget (same code path)
    "base": {"d_model": 256, "n_heads": 8, "n_layers": 4, "d_ff": 1024},
}


@dataclass(frozen=True)
class PretrainConfig:
    """Settings of the base-model pretraining (everything that changes the result enters the cache key)."""

    size: str = "small"
    corpora: tuple[str, ...] = ("wikitext2", "ptb")
    seq_len: int = 64
    batch_size: int = 16
    steps: int = 3000
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    dropout: float = 0.1
    seed: int = 0

    def model_kwargs(self) -> dict[str, Any]:
        if self.size not in PRESETS:
            raise UserError(f"size {self.size!r}; choose one of {', '.join(PRESETS)}")
        return {**PRESETS[self.size], "dropout": self.dropout, "norm_first": True, "max_len": 512}


def _stream(cfg: PretrainConfig, split: str, data_dir: str | Path | None, tok: CharTokenizer) -> np.ndarray:
    parts = [np.asarray(tok.encode(load_corpus(c, split, data_dir)), dtype=np.int64) for c in cfg.corpora]
    return np.concatenate(parts)


def cache_key(cfg: PretrainConfig, data_dir: str | Path | None) -> str:
    h = hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode())
    for c in cfg.corpora:
        for split in ("train", "valid"):
            p = corpus_path(c, split, data_dir)
            h.update(f"{c}/{split}:{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


def default_base_path(cfg: PretrainConfig, data_dir: str | Path | None = None) -> Path:
    return cache_dir() / "pretrain" / f"charlm-{cfg.size}-{cache_key(cfg, data_dir)}.pt"


@torch.no_grad()
def _val_loss(model: torch.nn.Module, ids: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    model.eval()
    n = min(max_windows, (len(ids) - 1) // seq_len)
    x = ids[: n * seq_len].view(n, seq_len)
    y = ids[1 : n * seq_len + 1].view(n, seq_len)
    total = 0.0
    for s in range(0, n, 16):
        logits = model(x[s : s + 16])
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                         y[s : s + 16].reshape(-1), reduction="sum"))
    model.train()
    return total / max(n * seq_len, 1)


def pretrain(cfg: PretrainConfig, out: str | Path | None = None, data_dir: str | Path | None = None, *,
             force: bool = False, device: str | torch.device = "cpu", log_every: int = 200,
             log: Any = print) -> Path:
    """Train the character base LM (AdamW, linear warm-up then cosine decay) and save it; cached by settings.

    Batches are random windows of ``seq_len + 1`` characters drawn from a generator seeded by ``cfg.seed``,
    so the same settings and data give the same weights (on the same device and thread count).
    """
    from fedfuse.models.transformer import TransformerModel

    path = Path(out) if out else default_base_path(cfg, data_dir)
    if path.is_file() and not force:
        log(f"pretrained base found: {path} (cached; --force retrains)")
        return path
    tok = CharTokenizer()
    train = torch.from_numpy(_stream(cfg, "train", data_dir, tok))
    valid = torch.from_numpy(_stream(cfg, "valid", data_dir, tok))
    dev = torch.device(device)
    torch.manual_seed(cfg.seed)
    kwargs = cfg.model_kwargs()
    model = TransformerModel(len(tok), len(tok), task="lm", **kwargs).to(dev)
    params = sum(p.numel() for p in model.parameters())
    log(f"pretraining a {params / 1e6:.2f} M-parameter character LM on {'+'.join(cfg.corpora)} "
        f"({len(train):,} training characters) for {cfg.steps} steps")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    gen = torch.Generator().manual_seed(cfg.seed)
    L = cfg.seq_len
    offsets = torch.arange(L + 1)
    t0 = time.perf_counter()
    model.train()
    history = []
    for step in range(cfg.steps):
        starts = torch.randint(0, len(train) - L - 1, (cfg.batch_size,), generator=gen)
        win = train[starts[:, None] + offsets].to(dev)
        logits = model(win[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), win[:, 1:].reshape(-1))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
            vl = _val_loss(model, valid.to(dev), L)
            history.append({"step": step + 1, "train_loss": float(loss.detach()), "val_loss": vl,
                            "seconds": time.perf_counter() - t0})
            log(f"step {step + 1:>6}  train {float(loss.detach()):.3f}  val {vl:.3f} nats/char "
                f"({vl / math.log(2):.3f} bpc)  {time.perf_counter() - t0:.0f}s")
    path.parent.mkdir(parents=True, exist_ok=True)
    ck = {"kind": "fedfuse-lm", "model": kwargs, "vocab": tok.vocab,
          "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
          "info": {"config": asdict(cfg), "parameters": params, "history": history,
                   "seconds": time.perf_counter() - t0, "train_chars": len(train)}}
    tmp = path.with_suffix(".tmp")
    torch.save(ck, tmp)
    tmp.replace(path)
    (path.with_suffix(".json")).write_text(json.dumps(ck["info"], indent=2))
    log(f"saved {path}")
    return path
