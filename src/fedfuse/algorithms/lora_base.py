"""The shared client/server plumbing of the LoRA algorithms (``fedit``, ``fedlora``, ``local-lora``,
``fedmerge-lora``, ``fedem-lora``): options, adapter training, evaluation, ROUGE and accounting.

Only adapter tensors are put in :class:`~fedfuse.types.Message` objects, so the engine's byte counts are the
adapter sizes; ``flops`` are counted with ``torch.utils.flop_counter`` on the live adapted model (the frozen
base's weight gradients are never computed, so they are not counted); ``trained_params`` is the adapter
size.  Evaluation is client-side and pure: each client scores its own personal model (perplexity, and
ROUGE-1 of greedy generations when the server marks the evaluation — by default the last round), so every
executor gives the same metrics; the engine averages ``test_rouge1`` / ``test_perplexity_clients`` over
clients into ``personal_rouge1`` / ``personal_perplexity_clients``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fedfuse.adapters.evaluate import decode, greedy, lm_stats, rouge1, rouge_rows
from fedfuse.adapters.lora import AdapterModel, LoraSpec, adapter_model
from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState
from fedfuse.engine.client import TrainStats, train_local
from fedfuse.engine.program import ClientProgram
from fedfuse.errors import UserError
from fedfuse.options import opt
from fedfuse.rng import derive_seed
from fedfuse.types import ClientData, Federation, FitStats, Message, TensorDict

Mixture = tuple[list[TensorDict], list[float]]  # adapters and their mixture weights (one adapter: [1.0])


@dataclass
class LoraOptions:
    base: str = opt("", "base causal LM: fedfuse:PATH.pt (from `fedfuse pretrain`) or hf:DIR (Hugging Face)")
    rank: int = opt(8, "LoRA rank r (the papers: 8)", ge=1)
    alpha: float = opt(16.0, "LoRA alpha: ΔW = alpha / r · B A (alpaca-lora: 16)", gt=0.0)
    lora_dropout: float = opt(0.05, "dropout on the LoRA branch input (alpaca-lora: 0.05)", ge=0.0, lt=1.0)
    targets: list = opt(["q_proj", "v_proj"], "names of the Linear modules that get LoRA (alpaca-lora: q_proj, "
                        "v_proj; GPT-2: c_attn)")
    rouge_samples: int = opt(16, "test rows per client scored with ROUGE-1 (0 = no generation)", ge=0)
    rouge_every: int = opt(0, "score ROUGE-1 every this many rounds as well (0 = last round only)", ge=0)
    prompt_len: int = opt(32, "plain-text rows: tokens shown as the prompt, the rest is the reference", ge=1)
    gen_tokens: int = opt(32, "most tokens generated per ROUGE prompt", ge=1)


class LoraAlgorithm(Algorithm):
    """Base of the LoRA algorithms: the frozen base + LoRA wrapper is shared by every client in-process."""

    extras = ("lora",)

    @dataclass
    class Options(LoraOptions):
        pass

    def __init__(self, ctx: Any, options: Any | None = None) -> None:
        super().__init__(ctx, options)
        if not self.opt.base:
            raise UserError(f"{self.name}: option base is required (fedfuse:PATH.pt from `fedfuse pretrain`, "
                            "or hf:DIR)")
        self.spec = LoraSpec(int(self.opt.rank), float(self.opt.alpha), float(self.opt.lora_dropout),
                             tuple(self.opt.targets))

    # ---- the shared model ---------------------------------------------------------------------------
    @property
    def am(self) -> AdapterModel:
        return adapter_model(self.opt.base, self.spec, self.ctx.device)

    def new_adapter(self, purpose: str, j: int = 0) -> TensorDict:
        return self.am.init_adapter(derive_seed(self.ctx.seed, purpose, j))

    def adapter_parameters(self) -> int:
        return self.am.numel

    # ---- client work --------------------------------------------------------------------------------
    def adapter_program(self, adapter: TensorDict, data: ClientData,
                        finalize: Callable[[TensorDict, TrainStats], tuple[Message, ClientState]], *,
                        epochs: int | None = None, lr: float | None = None) -> ClientProgram:
        """Train ``adapter`` on the shared frozen base as a declared program: the wrapped model is the template
        with the adapter as ``init`` (the base weights it leaves out are read from the template, once for every
        client), the adapter tensors are the per-client state and the trainable set;
        ``finalize(trained_adapter, stats)`` builds the reply."""
        am, spec = self.am, self.ctx.train
        if epochs is not None:
            spec = spec.replace(local_epochs=int(epochs))
        if lr is not None:
            spec = spec.replace(lr=float(lr))
        return ClientProgram(model=am.module, init=dict(adapter), finalize=finalize, trainable=frozenset(am.keys),
                             spec=spec)

    def train_adapter(self, adapter: TensorDict, data: ClientData, gen: torch.Generator, *,
                      epochs: int | None = None, lr: float | None = None) -> tuple[TensorDict, TrainStats]:
        am = self.am.load(adapter)
        stats = train_local(am.module, data.train, self.ctx.train, gen, params=list(am.params.values()),
                            epochs=epochs, lr=lr)
        return am.adapter(), stats

    def adapter_stats(self, data: ClientData, stats: TrainStats, adapters_trained: int = 1,
                      extra_forward_rows: int = 0) -> FitStats:
        """The :class:`FitStats` of training ``adapters_trained`` adapters (plus extra forward rows)."""
        fwd, train = self.flops_per_row(data)
        return FitStats(num_examples=len(data.train), samples=int(stats.samples), steps=int(stats.steps),
                        train_loss=float(stats.mean_loss),
                        flops=float(train * stats.samples + fwd * extra_forward_rows),
                        trained_params=int(adapters_trained * self.am.numel))

    def flops_per_row(self, data: ClientData) -> tuple[float, float]:
        """(forward, forward+backward) FLOPs of one training row, counted on the live model once per shape."""
        if not len(data.train):
            return 0.0, 0.0
        cache = self.__dict__.setdefault("_flops", {})
        key = tuple(data.train.x.shape[1:])
        if key not in cache:
            from torch.utils.flop_counter import FlopCounterMode

            am = self.am
            x, y = data.train.x[:2], data.train.y[:2]
            with torch.random.fork_rng(devices=[]):
                am.module.train()
                c1 = FlopCounterMode(display=False)
                with c1, torch.no_grad():
                    am.module(x)
                c2 = FlopCounterMode(display=False)
                with c2:
                    logits = am.module(x)
                    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
                for p in am.params.values():
                    p.grad = None
            n = max(int(x.shape[0]), 1)
            cache[key] = (c1.get_total_flops() / n, c2.get_total_flops() / n)
        return cache[key]

    # ---- evaluation ---------------------------------------------------------------------------------
    def predictor(self, mixture: Mixture):
        """ids -> log-probabilities of the mixture Σ_m π_m softmax(f_m) (one adapter: its log-softmax)."""
        adapters, weights = mixture
        am = self.am

        def logprobs(ids: torch.Tensor) -> torch.Tensor:
            if len(adapters) == 1:
                am.load(adapters[0])
                return torch.log_softmax(am(ids).float(), -1)
            acc = None
            for a, w in zip(adapters, weights):
                am.load(a)
                p = float(w) * torch.softmax(am(ids).float(), -1)
                acc = p if acc is None else acc + p
            return acc.clamp_min(1e-12).log()  # type: ignore[union-attr]

        return logprobs

    def evaluate_mixture(self, mixture: Mixture, data: ClientData, meta: dict[str, Any] | None = None
                         ) -> dict[str, float]:
        """val/test token loss and accuracy of a personal model, its test perplexity, and ROUGE-1 when the
        server marked the evaluation (``meta["rouge"]``); a pure function of payload and client data."""
        self.am.module.eval()
        lp = self.predictor(mixture)
        out: dict[str, float] = {}
        for name, split in (("val", data.val), ("test", data.test)):
            out.update(lm_stats(lp, split, self.ctx.eval_batch_size).as_dict(name))
        if out.get("test_count"):
            out["test_perplexity_clients"] = math.exp(min(out["test_loss"], 700.0))
        if (meta or {}).get("rouge"):
            out["test_rouge1"] = self.client_rouge(mixture, data)
        return out

    # ---- round bookkeeping (so evaluation knows when ROUGE is due, whatever executor runs it) --------
    @staticmethod
    def tag_round(state: ServerState, info: RoundInfo) -> ServerState:
        return {**state, "round": info.index + 1, "total": info.total}

    def eval_meta(self, state: ServerState) -> dict[str, Any]:
        if self.opt.rouge_samples <= 0 or "round" not in state:
            return {"rouge": False}
        r, total, every = int(state["round"]), int(state["total"]), int(self.opt.rouge_every)
        return {"rouge": r == total or (every > 0 and r % every == 0)}

    def client_rouge(self, mixture: Mixture, data: ClientData) -> float:
        rows = rouge_rows(data.test, int(self.opt.prompt_len), int(self.opt.rouge_samples))
        if not rows:
            return float("nan")
        am = self.am
        am.module.eval()
        tok = am.tokenizer
        stop = getattr(tok, "eos_id", None) if tok is not None else None
        if stop is None and tok is not None:
            stop = getattr(tok, "eos_token_id", None)
        prompts = [p for p, _ in rows]
        longest = max(len(r) for _, r in rows)
        gen = greedy(self.predictor(mixture), prompts, min(int(self.opt.gen_tokens), longest), am.device, stop)
        refs = [decode(tok, r) for _, r in rows]
        return rouge1([decode(tok, g) for g in gen], refs)

    def diagnostics(self, state: ServerState, fed: Federation, info: RoundInfo) -> dict[str, Any]:
        return {"adapter_parameters": self.adapter_parameters(), "base_parameters": self.am.base_parameters()}


def size_weights(results: dict[int, Any], clients: Sequence[int]) -> list[float]:
    return [float(results[c].num_examples) for c in clients]
