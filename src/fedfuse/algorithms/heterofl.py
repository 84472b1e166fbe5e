"""HeteroFL (Diao, Ding & Tarokh, ICLR 2021): clients train the *first* ⌈μK⌉ units of every hidden layer.

As in the spec (``../shared/specs/msfusion.md``) and the authors' code (``diaoenmao/HeteroFL``):

* static sub-models: the first ⌈μ_n K_i⌉ units of every hidden group (:func:`fedfuse.fusion.slicing.static_indices`),
  built as real smaller modules;
* aggregation: every element of the global model is the **unweighted** average over the clients holding it;
  elements nobody holds keep their value; the classifier's rows (weight and bias) of class y are averaged only
  over the clients whose training data contains y ("label split");
* masked cross-entropy: logits of classes absent from the client's data are set to 0 during training (the
  code's ``masked_fill(label_mask == 0, 0)``);
* static BN (``norm="bn-static"`` models: no running statistics during training); before an evaluation
  (every ``stats_every`` rounds — by default the run's ``eval_every`` — and at the last round) a second stage
  recomputes the global model's BN statistics: every client runs the full global model over its training data
  (BN momentum None = cumulative averages) and the server averages the clients' statistics weighted by their
  number of batches.  The authors' code does this centrally on the pooled training set; the result is the
  same cumulative average over all batches.  This pass costs one full-model download per client (counted);
* Scaler: the output of every sliced hidden layer (conv / linear whose output units are split) is divided by μ
  during training only (identity at evaluation).  ``scaler="auto"`` (default) applies it only to models with a
  normalisation layer: in the authors' code every Scaler feeds a norm layer, which undoes the ×1/μ in training,
  and their MLP has no Scaler.  On a norm-free MLP the factor compounds over the layers (logits ×μ^-L) and the
  run's default ``--lr 0.1`` diverges in the first round (MNIST, μ = 0.125: training loss 1e23, then NaN;
  ``docs/msfusion.md``); ``always`` / ``never`` force it.

LMs (``task="lm"``) have no label split or masking.  The learning-rate schedule follows MSfusion's (the paper
keeps it uniform across its baselines): a triangular CyclicLR whose peak is the run's ``--lr`` and whose floor is
``lr_min_ratio · lr`` (:func:`fedfuse.engine.client.scheduled_lr`), or ``constant``.  The run's ``--lr`` is the
only absolute learning rate: no option of this algorithm replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState
from fedfuse.engine.client import CYCLIC_MIN_RATIO, LR_SCHEDULES, TrainStats, scheduled_lr
from fedfuse.engine.program import Batch, ClientProgram, cross_entropy, run_program
from fedfuse.fusion.slicing import (
    Selection,
    SliceSpec,
    build_submodel,
    combine,
    slice_spec,
    slice_state,
    state_bytes,
    static_indices,
    widths_of,
)
from fedfuse.options import opt
from fedfuse.structure import batchnorm_modules
from fedfuse.types import ClientData, FitStats, Message, Privacy, ServerView, TensorDict, not_built


def masked_cross_entropy(b: Batch) -> torch.Tensor:
    """HeteroFL's masked cross-entropy: the logits of classes the client does not hold (``refs["logit_mask"]``
    False) are set to 0 before the loss (training only; evaluation is unmasked)."""
    return b.cross_entropy(b.logits.masked_fill(~b.refs["logit_mask"], 0.0))


def has_bn(model: nn.Module) -> bool:
    return bool(batchnorm_modules(model))


def has_norm(model: nn.Module) -> bool:
    """Whether ``model`` has a normalisation layer (batch, group, instance or layer norm)."""
    norms = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)
    return any(isinstance(m, norms) for m in model.modules())


def bn_statistics(model: nn.Module, x: torch.Tensor, batch_size: int) -> tuple[TensorDict, int]:
    """Cumulative (momentum=None) BN running statistics of ``model`` over ``x``; returns (buffers, batches)."""
    bns = [m for _, m in batchnorm_modules(model)]
    saved = [(m.momentum, m.track_running_stats) for m in bns]
    for m in bns:
        m.momentum = None
        m.track_running_stats = True
        m.reset_running_stats()
    model.train()
    batches = 0
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            model(x[start : start + batch_size])
            batches += 1
    for m, (mom, trk) in zip(bns, saved):
        m.momentum, m.track_running_stats = mom, trk
    stats = {k: v.detach().clone() for k, v in model.state_dict().items()
             if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    return stats, batches


LR_MIN_RATIO = CYCLIC_MIN_RATIO  # App. A.2.2: CyclicLR 0.001 → 0.0012


class HeteroFL(Algorithm):
    name = "heterofl"
    description = "HeteroFL: static first-k width slices, holder averaging, label-split head, static BN, Scaler"
    privacy = (
        Privacy(ServerView.NOTHING_INDIVIDUAL,
                ('holder averaging is a sum of zero-padded sub-models over public holder counts (label-split '
                 'heads reveal the label sets)'),
                central_dp=not_built('per-coordinate holder counts change the sensitivity per coordinate; not '
                                      'wired'),
                local_dp=not_built('DP-SGD on the sub-model step would fit'),
                secagg=not_built('mask the zero-padded sub-model and its holder indicator: only the sums '
                                  'remain')),
    )

    @dataclass
    class Options:
        mu: float = opt(0.25, "width ratio μ: each client keeps the first ⌈μK⌉ units of every hidden layer",
                        gt=0.0, le=1.0)
        mu_list: list[float] = opt([], "per-client ratios μ_n, cycled over client ids (empty: every client uses mu)")
        scaler: str = opt("auto", "Scaler: divide every split hidden layer's output by μ during training. auto = "
                          "only in models with normalisation layers, as in the authors' code (every Scaler sits in "
                          "front of a norm layer; their MLP has none); without one the ×1/μ per layer compounds "
                          "and lr 0.1 diverges | always | never", choices=("auto", "always", "never"))
        masked_ce: bool = opt(True, "masked cross-entropy: logits of classes absent from the client's data set to 0 "
                              "(code)")
        label_split: bool = opt(True, "average each classifier row only over clients that have its class (code)")
        sbn: bool = opt(True, "static BN: recompute the global model's BN statistics on training data before "
                        "evaluation")
        stats_every: int = opt(0, "rounds between BN recomputations; 0 = the run's eval_every", ge=0)
        lr_schedule: str = opt("cyclic", "local learning-rate schedule: cyclic (triangular, one cycle over all rounds, "
                               "peak = the run's --lr, as MSfusion App. A.2.2) or constant (--lr every round)",
                               choices=LR_SCHEDULES)
        lr_min_ratio: float = opt(LR_MIN_RATIO, "floor of the cyclic schedule as a fraction of --lr (paper: "
                                  "0.001/0.0012)", gt=0.0, le=1.0)

    def __init__(self, ctx, options=None) -> None:
        super().__init__(ctx, options)
        self._full = ctx.model({})
        self.spec: SliceSpec = slice_spec(self._full)
        self.shapes = {k: tuple(v.shape) for k, v in self._full.state_dict().items()}
        self._bn = has_bn(self._full) and getattr(self._full, "norm", "bn") == "bn-static"

    # ---- index sets --------------------------------------------------------------------------------
    def mu_of(self, n: int) -> float:
        mus = list(self.opt.mu_list or [])
        return float(mus[n % len(mus)]) if mus else float(self.opt.mu)

    def selection(self, n: int, r: int) -> Selection:
        mu = self.mu_of(n)
        return {g: static_indices(k, mu) for g, k in self.spec.groups.items()}

    # ---- server --------------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        return {**super().init_state(), "bn_stats": None}

    def select_clients(self, info: RoundInfo, rng: np.random.Generator) -> list[int]:
        if self.ctx.clients_per_round >= self.ctx.num_clients:
            return list(range(self.ctx.num_clients))
        return super().select_clients(info, rng)

    def stats_round(self, info: RoundInfo) -> bool:
        return bool(self.opt.sbn and self._bn and
                    ((info.index + 1) % (int(self.opt.stats_every) or self.ctx.eval_every) == 0
                     or info.index + 1 == info.total))

    def num_stages(self, state: ServerState, info: RoundInfo) -> int:
        return 2 if self.stats_round(info) else 1

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        if info.stage == 1:  # BN statistics pass on the full global model
            msg = Message(self.with_bn_buffers(state["global"]), {"stage": "bn-stats"})
            return {c: msg for c in clients}
        out = {}
        for c in clients:
            sel = self.selection(c, info.index)
            out[c] = Message(slice_state(state["global"], self.spec, sel),
                             {"round": info.index, "total": info.total, "sel": {g: v.tolist() for g, v in sel.items()}})
        return out

    def with_bn_buffers(self, g: TensorDict) -> TensorDict:
        """The global state plus fresh BN buffers (for the ``norm="bn"`` twin of a bn-static model)."""
        twin = self.ctx.model({"model_options": {"norm": "bn"}})
        out = dict(g)
        for k, v in twin.state_dict().items():
            if k not in out:
                out[k] = torch.zeros_like(v) if not k.endswith("running_var") else torch.ones_like(v)
        return out

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        if info.stage == 1:
            w = np.array([float(r.meta["batches"]) for r in results.values()])
            keys = next(iter(results.values())).tensors.keys()
            stats = {}
            for k in keys:
                vs = [r.tensors[k] for r in results.values()]
                if vs[0].is_floating_point():
                    stats[k] = sum(float(wi) * v for wi, v in zip(w / w.sum(), vs))
                else:
                    stats[k] = torch.stack(vs).sum(0)  # total batches seen
            return {**state, "bn_stats": stats}
        sources, restrict = [], []
        head = self.head_keys()
        for msg in results.values():
            sel = {g: torch.tensor(v, dtype=torch.long) for g, v in msg.meta["sel"].items()}
            sources.append((msg.tensors, sel))
            if self.opt.label_split and self.ctx.task == "classification" and head:
                classes = torch.tensor(msg.meta["classes"], dtype=torch.long)
                restrict.append({k: [classes] + [None] * (len(self.shapes[k]) - 1) for k in head})
            else:
                restrict.append(None)
        glob, _ = combine(state["global"], self.spec.full_selection(), self.spec, self.shapes, sources, restrict)
        return {**state, "global": glob, "bn_stats": None}

    def head_keys(self) -> list[str]:
        return [k for k in self._full.head_keys() if k in self.shapes and len(self.shapes[k]) >= 1]

    def global_model(self, state: ServerState) -> tuple[TensorDict, dict[str, Any]] | None:
        if state.get("bn_stats"):
            return {**state["global"], **state["bn_stats"]}, {"model_options": {"norm": "bn"}}
        return state["global"], {}

    # ---- client --------------------------------------------------------------------------------------
    def fit(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> tuple[Message, ClientState]:
        if payload.meta.get("stage") == "bn-stats":
            model = self.ctx.load(payload.tensors, {"model_options": {"norm": "bn"}})
            stats, batches = bn_statistics(model, data.train.x, self.ctx.train.batch_size)
            return Message(stats, {"batches": batches}, FitStats(num_examples=len(data.train))), client_state
        return run_program(self.client_program(payload, client_state, data), data, gen)

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram | None:
        """The training stage as a declared program: the sub-model of the client's width (a real smaller module,
        with the Scaler's hooks when it is on), the masked cross-entropy over the client's classes
        (:func:`masked_cross_entropy`), the scheduled learning rate.  The BN statistics stage stays a custom
        ``fit`` (``None``)."""
        if payload.meta.get("stage") == "bn-stats":
            return None
        r, total = int(payload.meta["round"]), int(payload.meta["total"])
        sel = {g: torch.tensor(v, dtype=torch.long) for g, v in payload.meta["sel"].items()}
        mu = self.mu_of(data.cid)
        model = self.train_template(sel, mu)
        classification = self.ctx.task == "classification"
        classes = sorted(int(c) for c in torch.unique(data.train.y).tolist()) if classification else []
        mask = None
        if self.opt.masked_ce and classes:
            mask = torch.zeros(self.ctx.num_classes, dtype=torch.bool, device=data.train.y.device)
            mask[classes] = True
        lr = scheduled_lr(self.ctx.train.lr, r, total, self.opt.lr_schedule, self.opt.lr_min_ratio)

        def finalize(state: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            meta = {"sel": payload.meta["sel"], "classes": classes, "submodel_bytes": state_bytes(state), "lr": lr}
            return Message(state, meta, self.fit_stats(model, data, stats)), client_state

        loss, refs = (cross_entropy, {}) if mask is None else (masked_cross_entropy, {"logit_mask": mask})
        return ClientProgram(model=model, init=dict(payload.tensors), spec=self.ctx.train.replace(lr=lr),
                             finalize=finalize, loss=loss, refs=refs)

    def train_template(self, sel: Selection, mu: float) -> nn.Module:
        """The sub-model architecture for ``sel`` (cached); with the Scaler on, its hooks are part of it."""
        scaled = self.use_scaler() and mu != 1.0
        tag = f"{self.name}-train" + (f"-scaler{mu!r}" if scaled else "")
        model = build_submodel(self._full, self.spec, widths_of(sel), tag)
        if scaled and getattr(model, "_fedfuse_scaler", None) != mu:
            self.scaler_hooks(model, mu)
            model._fedfuse_scaler = mu  # registered once per cached template
        return model

    def use_scaler(self) -> bool:
        """Whether the Scaler is on: ``auto`` follows the authors' code, where a Scaler always feeds a
        normalisation layer (BatchNorm/GroupNorm/LayerNorm), so it is on only for models that have one."""
        if self.opt.scaler == "auto":
            return has_norm(self._full)
        return self.opt.scaler == "always"

    def scaler_hooks(self, model: nn.Module, mu: float) -> list:
        """HeteroFL's Scaler: divide every split hidden layer's output by μ in training mode."""
        hooks = []
        for name, module in model.named_modules():
            key = name + ".weight"
            if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) and key in self.spec.dims:
                d = self.spec.dims[key]
                if d and d[0] is not None:
                    hooks.append(module.register_forward_hook(lambda m, i, o: o / mu if m.training else o))
        return hooks
