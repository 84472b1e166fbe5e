"""Evaluation of adapted language models: token loss/accuracy over counted targets, greedy generation and
ROUGE-1 (``rouge-score``) of generated continuations / responses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fedfuse.engine.client import EvalStats
from fedfuse.types import Split

IGNORE = -100
Predict = Callable[[torch.Tensor], torch.Tensor]  # ids (B, L) -> log-probabilities (B, L, V)


@torch.no_grad()
def lm_stats(logprobs: Predict, split: Split, batch_size: int = 64) -> EvalStats:
    """Summed cross-entropy, correct next-token predictions and count over targets ``!= -100``."""
    st = EvalStats()
    for s in range(0, len(split), batch_size):
        x, y = split.x[s : s + batch_size], split.y[s : s + batch_size]
        lp = logprobs(x)
        mask = y != IGNORE
        st.loss_sum += float(F.nll_loss(lp.reshape(-1, lp.shape[-1]), y.reshape(-1), ignore_index=IGNORE,
                                        reduction="sum"))
        st.correct += int(((lp.argmax(-1) == y) & mask).sum())
        st.count += int(mask.sum())
    return st


@torch.no_grad()
def row_losses(logprobs: Predict, split: Split, batch_size: int = 64) -> torch.Tensor:
    """Per-row summed token cross-entropy (FedEM's per-sample loss for sequences)."""
    out = []
    for s in range(0, len(split), batch_size):
        x, y = split.x[s : s + batch_size], split.y[s : s + batch_size]
        lp = logprobs(x)
        nll = F.nll_loss(lp.transpose(1, 2), y, ignore_index=IGNORE, reduction="none")
        out.append(nll.sum(1))
    return torch.cat(out) if out else torch.zeros(0)


def rouge_rows(split: Split, prompt_len: int, limit: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference ids) of the first ``limit`` rows.

    A row with leading ignored targets is a prompt/response pair: the prompt is the input up to the first
    counted target, the reference the counted targets.  A plain-text row shows its first ``prompt_len``
    tokens and the reference is the rest of the window.
    """
    out = []
    for i in range(min(limit, len(split))):
        x, y = split.x[i].tolist(), split.y[i].tolist()
        counted = [j for j, t in enumerate(y) if t != IGNORE]
        if not counted:
            continue
        t0 = counted[0]
        if t0 > 0:
            out.append((x[: t0 + 1], [y[j] for j in counted]))
        else:
            p = min(prompt_len, len(x) - 1)
            full = [*x, y[-1]]
            out.append((full[:p], [t for t in full[p:] if t != IGNORE]))
    return out


@torch.no_grad()
def greedy(logprobs: Predict, prompts: Sequence[Sequence[int]], max_new: int, device: torch.device,
           stop_id: int | None = None) -> list[list[int]]:
    """Greedy continuation of each prompt (batched by prompt length; no cache: fine for small models)."""
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for _, idx in sorted(by_len.items()):
        ids = torch.tensor([list(prompts[i]) for i in idx], dtype=torch.long, device=device)
        new = []
        for _ in range(max_new):
            nxt = logprobs(ids)[:, -1].argmax(-1, keepdim=True)
            new.append(nxt)
            ids = torch.cat([ids, nxt], dim=1)
        gen = torch.cat(new, dim=1).tolist() if new else [[] for _ in idx]
        for i, g in zip(idx, gen):
            if stop_id is not None and stop_id in g:
                g = g[: g.index(stop_id)]
            out[i] = g
    return out


def rouge1(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Mean ROUGE-1 F-measure (``rouge_score``, stemming off), in [0, 1]."""
    from rouge_score import rouge_scorer

    if not predictions:
        return float("nan")
    sc = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=False)
    return float(sum(sc.score(r, p)["rouge1"].fmeasure for p, r in zip(predictions, references)) / len(predictions))


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    if tokenizer is None:
        return " ".join(str(i) for i in ids)
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    except TypeError:
        return tokenizer.decode(list(ids))
