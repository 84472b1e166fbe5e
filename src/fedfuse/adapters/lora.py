"""LoRA adapters as the federated state.

A *base* causal language model is loaded once per process and frozen; ``peft`` injects LoRA modules
(``ΔW = (alpha / rank) · B A`` next to each targeted ``nn.Linear``) and only their ``lora_A`` / ``lora_B``
tensors are ever copied, sent, fused or stored per client.  Every client and every global adapter shares the
one wrapped module: loading an adapter is an in-place copy of a few tensors.

Bases (the ``base`` option of every LoRA algorithm):

* ``fedfuse:PATH`` (or a bare ``PATH`` ending in ``.pt``) — a fedfuse ``transformer`` saved by
  ``fedfuse pretrain`` (character vocabulary stored with it);
* ``hf:DIR`` — any Hugging Face causal LM saved with ``save_pretrained`` in ``DIR`` (LLaMA, GPT-2, Qwen...),
  loaded with ``AutoModelForCausalLM`` and its tokenizer with ``AutoTokenizer`` when present.

Adapter initialisation follows ``peft``'s default (``A`` Kaiming-uniform, ``B`` zero, so a fresh adapter is
the identity), but draws ``A`` from an explicit seed so the server can create ``d`` independent adapters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedfuse.engine.checkpoint import safe_load
from fedfuse.errors import UserError
from fedfuse.extras import require_extra
from fedfuse.types import TensorDict

ADAPTER_MARK = "lora_"


def require_peft() -> None:
    """Raise :class:`fedfuse.extras.MissingExtra` (a usage error naming ``pip install 'fedfuse[lora]'``) when the
    lora extra is not installed."""
    require_extra("lora", "LoRA adapters")


@dataclass(frozen=True)
class LoraSpec:
    """Where and how LoRA modules are injected."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ("q_proj", "v_proj")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LogitsLM(nn.Module):
    """Uniform interface: ``forward(ids) -> logits (B, L, V)`` for fedfuse and Hugging Face models."""

    def __init__(self, lm: nn.Module, hf: bool) -> None:
        super().__init__()
        self.lm = lm
        self.hf = hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.hf:
            return self.lm(input_ids=ids).logits
        return self.lm(ids)


def parse_base(base: str) -> tuple[str, str]:
    if base.startswith("hf:"):
        return "hf", base[3:]
    if base.startswith("fedfuse:"):
        return "fedfuse", base[8:]
    if base.endswith(".pt"):
        return "fedfuse", base
    raise UserError(f"base {base!r}: use fedfuse:PATH.pt (from `fedfuse pretrain`) or hf:DIR (a Hugging Face "
                    "causal LM saved with save_pretrained)")


def load_base(base: str, device: torch.device | str = "cpu") -> tuple[nn.Module, Any, dict[str, Any]]:
    """(frozen module returning logits, tokenizer, info) for a base spec."""
    kind, where = parse_base(base)
    if kind == "fedfuse":
        from fedfuse.adapters.text import CharTokenizer
        from fedfuse.models.transformer import TransformerModel

        path = Path(where)
        if not path.is_file():
            raise FileNotFoundError(f"base model {path} not found: run `fedfuse pretrain` first (it prints the path)")
        ck = safe_load(path, what=f"LoRA base {base!r}", kind="fedfuse pretrained LM")  # tensors only, never code
        if not isinstance(ck, dict) or ck.get("kind") != "fedfuse-lm":
            found = ck.get("kind") if isinstance(ck, dict) else type(ck).__name__
            raise UserError(f"{path} is not a fedfuse pretrained LM (kind={found!r})")
        vocab = list(ck["vocab"])
        lm = TransformerModel(len(vocab), len(vocab), task="lm", **ck["model"])
        lm.load_state_dict(ck["state"])
        module, tok, info = LogitsLM(lm, hf=False), CharTokenizer(vocab), {"kind": kind, "path": str(path)}
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        lm = AutoModelForCausalLM.from_pretrained(where)  # transformers: safetensors or weights_only, no remote code
        try:
            tok = AutoTokenizer.from_pretrained(where)
        except (OSError, ValueError, TypeError):
            tok = None
        module, info = LogitsLM(lm, hf=True), {"kind": kind, "path": where}
    for p in module.parameters():
        p.requires_grad_(False)
    return module.to(device), tok, info


class AdapterModel:
    """A frozen base with LoRA modules; adapters are named-tensor dicts (``lora_A``/``lora_B`` only)."""

    def __init__(self, base: str, spec: LoraSpec, device: torch.device | str = "cpu") -> None:
        require_peft()
        from peft import LoraConfig, inject_adapter_in_model

        self.base, self.spec, self.device = base, spec, torch.device(device)
        module, self.tokenizer, self.info = load_base(base, self.device)
        cfg = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                         target_modules=list(spec.targets), bias="none")
        try:
            self.module = inject_adapter_in_model(cfg, module)
        except ValueError as e:
            names = sorted({n.rsplit(".", 1)[-1] for n, m in module.named_modules() if isinstance(m, nn.Linear)})
            raise UserError(f"LoRA targets {list(spec.targets)} match no module of {base}; "
                            f"linear layers are named: {', '.join(names)}") from e
        self.module.to(self.device)
        for n, p in self.module.named_parameters():
            p.requires_grad_(ADAPTER_MARK in n)
        self.params: dict[str, nn.Parameter] = {n: p for n, p in self.module.named_parameters() if ADAPTER_MARK in n}
        if not self.params:
            raise UserError(f"no LoRA parameters were created for targets {list(spec.targets)}")
        self.keys = list(self.params)
        self.vocab_size = int(self.module(torch.zeros(1, 1, dtype=torch.long, device=self.device)).shape[-1])

    # ---- adapters as tensors ----------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return int(sum(p.numel() for p in self.params.values()))

    @property
    def nbytes(self) -> int:
        return int(sum(p.numel() * p.element_size() for p in self.params.values()))

    def base_parameters(self) -> int:
        return int(sum(p.numel() for n, p in self.module.named_parameters() if ADAPTER_MARK not in n))

    def init_adapter(self, seed: int) -> TensorDict:
        """A fresh adapter: ``A`` Kaiming-uniform (a=√5, peft's default) from ``seed``, ``B`` zero."""
        gen = torch.Generator().manual_seed(int(seed))
        out: TensorDict = {}
        for k, p in self.params.items():
            if ".lora_A." in k:
                bound = 1.0 / math.sqrt(p.shape[1])  # kaiming_uniform_(a=sqrt(5)) bound for fan_in
                out[k] = ((torch.rand(p.shape, generator=gen) * 2 - 1) * bound).to(p.dtype).to(self.device)
            else:
                out[k] = torch.zeros_like(p)
        return out

    def adapter(self) -> TensorDict:
        """A detached copy of the current adapter tensors."""
        return {k: p.detach().clone() for k, p in self.params.items()}

    def load(self, tensors: Mapping[str, torch.Tensor]) -> AdapterModel:
        """Copy ``tensors`` into the LoRA parameters (strict: exactly the adapter keys)."""
        if set(tensors) != set(self.params):
            missing, extra = set(self.params) - set(tensors), set(tensors) - set(self.params)
            raise KeyError(f"adapter keys differ: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")
        with torch.no_grad():
            for k, p in self.params.items():
                p.copy_(tensors[k].to(p.device, p.dtype))
        return self

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.module(ids)

    def stack(self, m: int) -> AdapterStack:
        """The (cached) :class:`AdapterStack` of ``m`` adapters on this base; its own values are never read."""
        cache = self.__dict__.setdefault("_stacks", {})
        if m not in cache:
            cache[m] = AdapterStack(self.module, self.keys, m).to(self.device)
        return cache[m]


class AdapterStack(nn.Module):
    """M adapters on one frozen LoRA-wrapped base as one module: ``forward(ids)`` runs the base once per adapter
    (its own LoRA tensors replaced by adapter m's through ``functional_call``) and stacks the logits to
    (B, M, T, V).  Adapter m's tensors are the parameters ``adapters.{m}.{i}``, i indexing ``keys``; the base
    (``base.*``, its LoRA tensors included) is never trained through this module."""

    def __init__(self, module: nn.Module, keys: Sequence[str], m: int) -> None:
        super().__init__()
        self.base = module
        self.keys = list(keys)
        params = dict(module.named_parameters())
        self.adapters = nn.ModuleList(
            nn.ParameterList(nn.Parameter(torch.zeros_like(params[k])) for k in self.keys) for _ in range(m))

    @staticmethod
    def name(m: int, i: int) -> str:
        return f"adapters.{m}.{i}"

    def state_of(self, adapters: Sequence[Mapping[str, torch.Tensor]]) -> TensorDict:
        """The stack's tensors (``adapters.{m}.{i}``) holding ``adapters`` (adapter dicts keyed like ``keys``)."""
        return {self.name(m, i): a[k] for m, a in enumerate(adapters) for i, k in enumerate(self.keys)}

    def adapters_of(self, state: Mapping[str, torch.Tensor]) -> list[TensorDict]:
        """The inverse of :meth:`state_of`."""
        return [{k: state[self.name(m, i)] for i, k in enumerate(self.keys)} for m in range(len(self.adapters))]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from torch.func import functional_call

        return torch.stack([functional_call(self.base, dict(zip(self.keys, ps)), (ids,)) for ps in self.adapters],
                           dim=1)


_MODELS: dict[tuple, AdapterModel] = {}


def adapter_model(base: str, spec: LoraSpec, device: torch.device | str = "cpu") -> AdapterModel:
    """The process-wide wrapped model for (base, LoRA spec, device): the base is loaded once."""
    key = (base, spec, str(torch.device(device)))
    if key not in _MODELS:
        # Built lazily, possibly inside a client's seeded step: building (random init before the base's weights
        # are loaded, peft's own init) must not move the global RNG streams that step's dropout draws from, or
        # the first run in a process would differ from every later one.
        cuda = torch.device(device).type == "cuda"
        with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
            _MODELS[key] = AdapterModel(base, spec, device)
    return _MODELS[key]


def clear_cache() -> None:
    _MODELS.clear()


# ---- ΔW view -----------------------------------------------------------------------------------------


def module_pairs(keys: Sequence[str]) -> list[tuple[str, str]]:
    """(lora_A key, lora_B key) of every adapted module, in key order."""
    a_keys = [k for k in keys if ".lora_A." in k]
    return [(a, a.replace(".lora_A.", ".lora_B.")) for a in a_keys]


def delta_weights(adapter: Mapping[str, torch.Tensor], scaling: float = 1.0) -> TensorDict:
    """``ΔW = scaling · B A`` per adapted module (keyed by the module path)."""
    return {a.split(".lora_A.")[0]: scaling * (adapter[b].double() @ adapter[a].double())
            for a, b in module_pairs(list(adapter))}


def cross_term_gap(adapters: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> float:
    """How far merging A and B separately is from merging ΔW: ``‖(Σw B)(Σw A) − Σ w B A‖ / ‖Σ w B A‖``
    summed over modules (0 when all adapters share A or B; the cross terms B_j A_k, j ≠ k, otherwise)."""
    w = [float(x) for x in weights]
    num = den = 0.0
    for a, b in module_pairs(list(adapters[0])):
        A = sum(wj * ad[a].double() for wj, ad in zip(w, adapters))
        B = sum(wj * ad[b].double() for wj, ad in zip(w, adapters))
        exact = sum(wj * (ad[b].double() @ ad[a].double()) for wj, ad in zip(w, adapters))
        num += float(((B @ A) - exact).pow(2).sum())
        den += float(exact.pow(2).sum())
    return math.sqrt(num) / math.sqrt(den) if den > 0 else 0.0
