"""Dis-PFL (Dai, Shen, He, Tian, Tao, ICML 2022, "DisPFL: Towards communication-efficient personalized
federated learning via decentralized sparse training"): every participant trains a *personalised sparse*
model and exchanges only its sparse weights with its neighbours; no server.

Follows the paper's Algorithm 1 and the authors' code (``rong-dai/DisPFL``, ``standalone/DisPFL``):

* **Masks** m_k over every parameter tensor, density ``dense_ratio`` distributed over layers by ERK
  (Erdős–Rényi-kernel: density ∝ (Σ dims)/(Π dims), layers that would exceed density 1 are made dense and
  the rest re-solved; ``mask_distribution="uniform"`` gives every layer the same density).  Each participant
  draws its own random mask (``different_initial``, the paper's personalised masks); the initial weights
  are the common seed model times the mask.
* **Aggregation** (Eq. 4, code ``_aggregate_func``): over the participant itself and its neighbours N_k,
  w̃ = Σ_j (m_j ⊙ w_j) / Σ_j m_j element-wise (0 where nobody holds the element), then w_k = m_k ⊙ w̃.  The
  masks in the denominator are the ones the neighbours trained with (the masks they sent).  BatchNorm running
  statistics (no mask) are averaged over the neighbourhood; ``num_batches_tracked`` takes the maximum.
* **Local training** (code ``MyModelTrainer.train``): SGD for ``local_epochs`` epochs with the learning rate
  decayed by ``lr_decay`` per round, weights kept on the mask (gradients of masked-out weights are zeroed,
  which with SGD/momentum/weight decay keeps them exactly zero, like the code's re-masking after each step).
* **Mask update** (code ``fire_mask``/``regrow_mask``, RigL-style, skipped when ``static``): drop the
  ⌈α_t·nnz⌉ smallest-magnitude active weights per tensor, α_t = (anneal/2)(1 + cos(π t / T)); regrow as many
  inactive positions with the largest gradient magnitude on one training batch (``regrow="random"`` regrows
  at random, the code's ``dis_gradient_check``).  Regrown weights start at 0 and receive the neighbours'
  average at the next aggregation.
* **Communication**: a participant sends its neighbours the values of its active weights plus its mask as a
  bitmap (1 bit per element) — counted as ``bytes_peer`` on the same peer path as MSfusion and D-PSGD; BN
  statistics travel dense.  The code counts non-zero parameters only; ``peer_params_per_participant`` reports
  that figure too.
* **FLOPs** (code ``client.train``): dense training FLOPs × the model's density for the local epochs, plus one
  dense forward/backward batch for the regrowth gradient.

Topology (``ring`` default, as MSfusion's Table 3), mixing graph and evaluation (every participant's own sparse
model on its own test split) follow :mod:`fedfuse.algorithms.dpsgd`.  There is no global model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfuse.algorithms.base import ClientState, RoundInfo, ServerState
from fedfuse.algorithms.dpsgd import DPSGD
from fedfuse.engine.client import TrainStats, task_loss
from fedfuse.engine.peers import TOPOLOGIES, unpack_mail
from fedfuse.engine.program import ClientProgram
from fedfuse.errors import UserError
from fedfuse.options import opt
from fedfuse.rng import torch_generator
from fedfuse.types import ClientData, Message, Privacy, ServerView, TensorDict, no, not_built

MASK = "grad_mask/"  # a participant's 0/1 mask of parameter k travels in its program's refs as MASK + k


def masked_gradients(grads: TensorDict, params: TensorDict, refs: TensorDict) -> TensorDict:
    """Sparse training: every gradient times the participant's 0/1 mask (only the mask's entries move)."""
    return {k: g * refs[MASK + k].to(g.dtype) if MASK + k in refs else g for k, g in grads.items()}


def erk_densities(shapes: dict[str, tuple[int, ...]], density: float, power: float = 1.0,
                  distribution: str = "ERK") -> dict[str, float]:
    """Per-tensor densities with overall density ``density`` (ERK as in RigL / the Dis-PFL code)."""
    if distribution == "uniform":
        return {k: float(density) for k in shapes}
    if distribution != "ERK":
        raise UserError(f"mask distribution {distribution!r}; choose ERK or uniform")
    dense: set[str] = set()
    while True:
        rhs, divisor, raw = 0.0, 0.0, {}
        for k, s in shapes.items():
            n = float(np.prod(s))
            if k in dense:
                rhs -= n * (1 - density)
            else:
                rhs += n * density
                raw[k] = (float(np.sum(s)) / n) ** power
                divisor += raw[k] * n
        if not raw:
            return {k: 1.0 for k in shapes}
        eps = rhs / divisor
        top = max(raw.values())
        if top * eps > 1:
            dense |= {k for k, v in raw.items() if v == top}
            continue
        return {k: (1.0 if k in dense else eps * raw[k]) for k in shapes}


def random_masks(shapes: dict[str, tuple[int, ...]], densities: dict[str, float], gen: torch.Generator) -> TensorDict:
    """A mask per tensor with ⌊density·numel⌋ ones at random positions."""
    out = {}
    for k, s in shapes.items():
        n = int(np.prod(s))
        m = torch.zeros(n)
        keep = int(densities[k] * n)
        if keep > 0:
            m[torch.randperm(n, generator=gen)[:keep]] = 1.0
        out[k] = m.reshape(s)
    return out


def sparse_average(own: int, models: dict[int, TensorDict], masks: dict[int, TensorDict],
                   own_mask: TensorDict) -> TensorDict:
    """Eq. 4: Σ_j m_j ⊙ w_j / Σ_j m_j over the senders (own included), then ⊙ own mask; buffers averaged."""
    out: TensorDict = {}
    order = sorted(models)
    for k, v in models[own].items():
        if k in own_mask:
            num = torch.zeros_like(v, dtype=torch.float64)
            cnt = torch.zeros_like(v, dtype=torch.float64)
            for j in order:
                mj = masks[j][k].to(v.device, torch.float64)
                num += mj * models[j][k].to(torch.float64)
                cnt += mj
            avg = torch.where(cnt > 0, num / cnt.clamp_min(1), torch.zeros_like(num))
            out[k] = (avg * own_mask[k].to(v.device, torch.float64)).to(v.dtype)
        elif v.is_floating_point():
            out[k] = (sum(models[j][k].to(torch.float64) for j in order) / len(order)).to(v.dtype)
        else:
            out[k] = torch.stack([models[j][k] for j in order]).max(0).values.clone()
    return out


def prune_and_regrow(mask: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor | None, rate: float,
                     gen: torch.Generator | None = None) -> torch.Tensor:
    """Drop ⌈rate·nnz⌉ smallest |w| of the mask; regrow as many zeros by largest |grad| (random if no grad)."""
    flat = mask.reshape(-1).clone()
    weight = weight.to(flat.device)
    grad = None if grad is None else grad.to(flat.device)
    nnz = int(flat.sum())
    k = math.ceil(rate * nnz)
    if k <= 0:
        return mask.clone()
    big = torch.finfo(torch.float32).max
    score = torch.where(flat > 0, weight.reshape(-1).abs().float(), torch.full_like(flat, big))
    flat[torch.argsort(score, stable=True)[:k]] = 0
    if grad is None:
        zeros = torch.nonzero(flat == 0).reshape(-1)
        pick = zeros[torch.randperm(len(zeros), generator=gen)[:k]]
    else:
        g = torch.where(flat == 0, grad.reshape(-1).abs().float(), torch.full_like(flat, -1.0))
        pick = torch.argsort(g, descending=True, stable=True)[:k]
    flat[pick] = 1
    return flat.reshape(mask.shape)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as a bitmap (uint8, 1 bit per element): what crosses the network."""
    return torch.from_numpy(np.packbits(mask.reshape(-1).to(torch.uint8).cpu().numpy()))


def unpack_mask(bits: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    n = int(np.prod(shape))
    return torch.from_numpy(np.unpackbits(bits.cpu().numpy())[:n].astype(np.float32)).reshape(shape)


class DisPFL(DPSGD):
    name = "dispfl"
    description = "Dis-PFL: decentralised personalised sparse training (ERK masks, sparse neighbour averaging)"
    privacy = (
        Privacy(ServerView.PEER_TO_PEER,
                ("sparse neighbour averaging: each peer sees its neighbours' masked-sparse models and masks, no"
                 ' server'),
                central_dp=no('no server step exists to noise'),
                local_dp=not_built('DP-SGD on the sparse step would make each sent model DP'),
                secagg=no('neighbours average plain sparse models; there is no server sum to mask')),
    )

    @dataclass
    class Options:
        topology: str = opt("ring", "peer graph (see dpsgd): ring is MSfusion's ring table", choices=TOPOLOGIES)
        degree: int = opt(2, "in-neighbours per participant for topology=random", ge=1)
        dense_ratio: float = opt(0.5, "overall density of every personalised mask (paper and code: 0.5)", gt=0.0,
                                 le=1.0)
        mask_distribution: str = opt("ERK", "per-layer densities: ERK (code default) or uniform",
                                     choices=("ERK", "uniform"))
        erk_power: float = opt(1.0, "ERK power scale (code: erk_power_scale 1)", ge=0.0)
        different_initial: bool = opt(True, "each participant draws its own mask (personalised, paper); False: "
                                      "one shared initial mask")
        static: bool = opt(False, "keep the masks fixed (no prune/regrow)")
        anneal: float = opt(0.5, "initial prune rate α of the cosine-annealed mask update (code anneal_factor)",
                            ge=0.0, le=1.0)
        regrow: str = opt("gradient", "regrow criterion: gradient (code default) or random",
                          choices=("gradient", "random"))
        lr_decay: float = opt(0.998, "learning rate × lr_decay^round (code default)", gt=0.0, le=1.0)

    def __init__(self, ctx: Any, options: Any = None) -> None:
        super().__init__(ctx, options)
        model = ctx.model({})
        self.shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
        self.densities = erk_densities(self.shapes, float(self.opt.dense_ratio), float(self.opt.erk_power),
                                       self.opt.mask_distribution)
        self.numel = sum(int(np.prod(s)) for s in self.shapes.values())

    def initial_mask(self, n: int) -> TensorDict:
        who = n if self.opt.different_initial else 0
        return random_masks(self.shapes, self.densities, torch_generator(self.ctx.seed, "dispfl-mask", who))

    def density(self, masks: TensorDict) -> float:
        return float(sum(float(m.sum()) for m in masks.values()) / max(self.numel, 1))

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """Participant n's round as a declared program: the sparse average of its own model and its neighbours'
        (values + bitmap masks) happens here; training is the run's local spec at the decayed learning rate
        with its mask as a gradient transform (:func:`masked_gradients`: only the mask's entries move); the
        finalize (which continues the client's generator, ``stats.generator``) screens gradients on one batch,
        prunes and regrows the mask, and sends the trained sparse model with the mask it was trained with."""
        n, r, total = data.cid, int(payload.meta["round"]), int(payload.meta["total"])
        if client_state is None:
            mask = self.initial_mask(n)
            init = self.initial_state()
            own = {k: (v * mask[k] if k in mask else v.clone()) for k, v in init.items()}
            sent_mask = mask
        else:
            own, mask, sent_mask = client_state["model"], client_state["mask"], client_state["sent_mask"]
        # aggregation over itself and the neighbours that sent (values + bitmap masks)
        mail = unpack_mail(payload.tensors, "sim/")
        models, masks = {n: own}, {n: sent_mask}
        for j, t in mail.items():
            m_j = {k: unpack_mask(t[f"mask/{k}"], s) for k, s in self.shapes.items()}
            w_j = {}
            for k, v in t.items():
                if k.startswith("val/"):
                    key = k[4:]
                    full = torch.zeros(int(np.prod(self.shapes[key])), dtype=v.dtype, device=v.device)
                    full[m_j[key].reshape(-1).to(v.device) > 0] = v
                    w_j[key] = full.reshape(self.shapes[key])
                elif k.startswith("buf/"):
                    w_j[k[4:]] = v
            models[j], masks[j] = w_j, m_j
        x = sparse_average(n, models, masks, mask) if len(models) > 1 else \
            {k: (v * mask[k] if k in mask else v.clone()) for k, v in own.items()}
        model = self.ctx.model({})
        device = next(model.parameters()).device
        lr = self.ctx.train.lr * float(self.opt.lr_decay) ** r

        def finalize(new: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            assert stats.generator is not None
            return self.publish(n, r, total, new, mask, stats, data, stats.generator)

        return ClientProgram(model=model, init=x, spec=self.ctx.train.replace(lr=lr), finalize=finalize,
                             refs={MASK + k: m.to(device) for k, m in mask.items()}, transform=masked_gradients)

    def publish(self, n: int, r: int, total: int, new: TensorDict, mask: TensorDict, stats: TrainStats,
                data: ClientData, gen: torch.Generator) -> tuple[Message, ClientState]:
        """After training with ``mask``: FLOPs at the mask's density, the mask update (gradient screening on one
        batch drawn from ``gen``, cosine-annealed prune and regrow) and the sparse message to the neighbours."""
        model = self.ctx.load(new)
        fit = self.fit_stats(model, data, stats)
        density = self.density(mask)
        dense_flops = fit.flops / max(stats.samples, 1)
        fit.flops = fit.flops * density
        new_mask = mask
        if not self.opt.static and len(data.train):
            grads = None
            if self.opt.regrow == "gradient":
                grads = self.screen_gradients(model, data, gen)
                fit.flops += dense_flops * min(self.ctx.train.batch_size, len(data.train))
            rate = float(self.opt.anneal) / 2 * (1 + math.cos(r * math.pi / max(total, 1)))
            new_mask = {k: prune_and_regrow(mask[k], new[k], None if grads is None else grads[k], rate, gen)
                        for k in self.shapes}
        fit.trained_params = int(sum(float(m.sum()) for m in mask.values()))
        # send the trained sparse model with the mask it was trained with
        msg: TensorDict = {}
        for k, v in new.items():
            if k in mask:
                msg[f"val/{k}"] = v.reshape(-1)[mask[k].reshape(-1).to(v.device) > 0].clone()
                msg[f"mask/{k}"] = pack_mask(mask[k])
            else:
                msg[f"buf/{k}"] = v
        peer, sent = self.send(n, r, total, msg)
        listeners = int(self.graph(r + 1)[:, n].sum()) if r + 1 < total else 0
        meta = {"density": density, "peer_bytes": sent, "peer_params": listeners * fit.trained_params}
        own_state = {f"sim/own/{k}": v for k, v in new.items()}
        return Message({**own_state, **peer}, meta, fit), {"model": new, "mask": new_mask, "sent_mask": mask}

    def screen_gradients(self, model: nn.Module, data: ClientData, gen: torch.Generator) -> TensorDict:
        """Gradient of the loss on one random training batch at the trained weights (eval mode, as the code)."""
        model.eval()
        model.zero_grad(set_to_none=True)
        idx = torch.randperm(len(data.train), generator=gen)[: self.ctx.train.batch_size].to(data.train.x.device)
        task_loss(model(data.train.x[idx]), data.train.y[idx]).backward()
        out = {k: (p.grad.detach().clone().cpu() if p.grad is not None else torch.zeros(p.shape))
               for k, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        new = super().aggregate_fit(state, info, results)
        metas = [m.meta for m in results.values()]
        new["diag"].update({
            "peer_params_per_participant": float(np.mean([m.get("peer_params", 0) for m in metas])),
            "mask_density": float(np.mean([m.get("density", 1.0) for m in metas])),
        })
        return new

    def global_model(self, state: ServerState) -> None:
        return None  # personalised sparse models only


__all__ = ["DisPFL", "erk_densities", "pack_mask", "prune_and_regrow", "random_masks", "sparse_average"]
