"""``fedfuse pretrain``: train (or find in the cache) the character base LM of the LoRA experiments."""

from __future__ import annotations

import argparse
from dataclasses import fields

from fedfuse.adapters.text import PRESETS, PretrainConfig, pretrain


def add_pretrain_parser(sub: argparse._SubParsersAction) -> None:
    d = PretrainConfig()
    p = sub.add_parser("pretrain", help="pretrain the base character LM for LoRA runs on WikiText-2 + PTB (cached)")
    p.add_argument("--size", default=d.size, choices=sorted(PRESETS), help="model preset (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimiser steps (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW peak learning rate (cosine decay to 10%%)")
    p.add_argument("--corpora", default=",".join(d.corpora), help="comma list of wikitext2, ptb")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of initialisation and batches")
    p.add_argument("--data-dir", default=None, help="folder holding wikitext2/ and ptb/ (default: $FEDFUSE_DATA)")
    p.add_argument("--out", default=None, help="where to save (default: the cache, keyed by these settings)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--force", action="store_true", help="retrain even if the cached file exists")
    p.set_defaults(func=cmd_pretrain)


def config_from_args(args: argparse.Namespace) -> PretrainConfig:
    names = {f.name for f in fields(PretrainConfig)}
    vals = {k: getattr(args, k) for k in ("size", "steps", "batch_size", "seq_len", "lr", "seed") if k in names}
    return PretrainConfig(**vals, corpora=tuple(c for c in args.corpora.split(",") if c))


def cmd_pretrain(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    path = pretrain(config_from_args(args), args.out, args.data_dir, force=args.force, device=args.device)
    print(f"base: fedfuse:{path}")
    return 0
