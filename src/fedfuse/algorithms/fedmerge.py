"""FedMerge (seed papers 000 and 001; author code shutong043/FedMerge): d global models, merged per client.

Server state: d global models Θ_1..Θ_d (full state, BN buffers included, each initialised independently)
and merging logits a ∈ R^{m×d} (zeros → uniform weights w = row-softmax(a)).  Clients hold nothing.

Round (defaults = the papers; the author code's behaviours are options):

1. sample clients (the runner's ``clients_per_round``; the code uses all clients every round);
2. send θ_i = Σ_j w_ij Θ_j over the *full* state (BN running statistics too; ``num_batches_tracked``: max);
3. client i trains θ_i with the run's local SGD and returns Δθ_i = θ_i^after − θ_i^sent for every entry
   (``prox_mu`` > 0 adds the code's ``prox_mu·‖θ − θ_sent‖²``; the papers do not mention it, default 0);
4. with s_i = n_i/n (n = Σ over the sampled clients, ``size_norm="all"``: over all clients):
   * logits (App. D, delta form of 001 Eq. 9): g_ij = s_i · w_ij · ⟨Δθ_i, Θ_j − θ_i⟩, the inner product over
     ``merge_params`` (default ``head``: the classification head, as 001 and the code; ``last-K``; ``all``),
     parameters only.  ``merge_update="fixed"`` (default, 000 §4.1): a ← a + merge_step · G / max|G| — the
     closed form of the code's small-step search, which stops once a logit has moved by ``merge_step``
     (the code overshoots by at most one of its increments); ``"gradient"``: a ← a + merge_step · G.
   * global models (001 Eq. 8/10): Θ_j ← Θ_j + theta_lr · Σ_i s_i w_ij Δθ_i (``theta_update="paper"``), or the
     code's column-normalised ŵ_ij = w_ij n_i / Σ_k w_kj n_k (``"column_normalised"``).
   Both use the weights the models were merged with (a simultaneous gradient step on Eq. 3);
   ``weights_first=true`` is the code's order (update a first, then Θ with the *new* w).
   The author code therefore corresponds to ``theta_update=column_normalised weights_first=true
   prox_mu=0.01`` with every client sampled.

``fixed_k`` > 0 is the Fixed(k/d) ablation (000 Table 4): each client's weights are uniform over k randomly
chosen global models and frozen.

Diagnostics: ``ari`` (k-means on the weight rows, K = number of true groups, vs ``ctx.client_groups``) and
``merge_entropy`` per evaluated round; a heat-map PNG every ``heatmap_every`` rounds and at the end; at the
end ``merge_weights.json``; the ARI of the final/best rounds appears in ``summary.json`` like every diagnostic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState, state_of
from fedfuse.fusion.average import delta
from fedfuse.fusion.merge import (
    cluster_ari,
    column_normalised,
    fixed_magnitude_step,
    fixed_weights,
    inner_products,
    logit_gradient,
    merge_states,
    paper_coefficients,
    row_softmax,
    select_keys,
    update_globals,
)
from fedfuse.rng import derive_seed, numpy_rng
from fedfuse.types import ClientData, Message, TensorDict


def init_globals(ctx: Any, count: int, purpose: str) -> list[TensorDict]:
    """``count`` independently initialised full model states (seeded from the run seed)."""
    out = []
    for j in range(count):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(ctx.seed, purpose, j))
            out.append(state_of(ctx.build()))
    return out


def model_params(ctx: Any) -> int:
    return int(sum(p.numel() for p in ctx.model().parameters()))


class FedMerge(Algorithm):
    name = "fedmerge"
    description = "FedMerge: d global models, each client receives its learned weighted merge Σ_j w_ij Θ_j"
    personalized = True
    reply_kind = "delta"  # clients send Δθ, not a model: update checks measure the reply itself

    @dataclass
    class Options:
        d: int = 5
        merge_params: str = "head"  # head | last-K | all
        merge_step: float = 0.01
        merge_update: str = "fixed"  # fixed (max logit change = merge_step) | gradient (a += merge_step·G)
        theta_lr: float = 1.0
        theta_update: str = "paper"  # paper | column_normalised (author code)
        weights_first: bool = False  # author code: update a, then Θ with the new w
        prox_mu: float = 0.0  # author code: 0.01 (coefficient of ||θ − θ_sent||², not halved)
        size_norm: str = "sampled"  # n in n_i/n: sampled clients' total | all clients' total
        fixed_k: int = 0  # >0: Fixed(k/d) ablation (frozen uniform weights over k random models)
        int_policy: str = "max"  # num_batches_tracked: max | first
        heatmap_every: int = 10  # rounds between heat-map PNGs (0 = only at the end)

    def __init__(self, ctx: Any, options: Any | None = None) -> None:
        super().__init__(ctx, options)
        o = self.opt
        if o.d < 1:
            raise ValueError(f"d must be >= 1, got {o.d}")
        if o.merge_update not in ("fixed", "gradient"):
            raise ValueError(f"merge_update={o.merge_update!r}; choose fixed or gradient")
        if o.theta_update not in ("paper", "column_normalised"):
            raise ValueError(f"theta_update={o.theta_update!r}; choose paper or column_normalised")
        if o.size_norm not in ("sampled", "all"):
            raise ValueError(f"size_norm={o.size_norm!r}; choose sampled or all")
        if o.fixed_k and not 1 <= o.fixed_k <= o.d:
            raise ValueError(f"fixed_k must be in [1, d={o.d}], got {o.fixed_k}")
        self.keys = select_keys(ctx.model(), o.merge_params)

    # ---- server --------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        o, m = self.opt, self.ctx.num_clients
        if o.fixed_k:
            logits = fixed_weights(m, o.d, o.fixed_k, numpy_rng(self.ctx.seed, "fedmerge-fixed"))
        else:
            logits = torch.zeros(m, o.d, dtype=torch.float64)
        return {"globals": init_globals(self.ctx, o.d, "fedmerge-init"), "logits": logits}

    def weights(self, state: ServerState) -> torch.Tensor:
        return row_softmax(state["logits"])

    def merged(self, state: ServerState, cid: int) -> TensorDict:
        return merge_states(state["globals"], self.weights(state)[cid], self.opt.int_policy)

    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]:
        return {c: Message(self.merged(state, c)) for c in clients}

    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]:
        return {c: Message(self.merged(state, c)) for c in clients}

    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState:
        if not results:
            return state
        o = self.opt
        clients = sorted(results)
        idx = torch.tensor(clients)
        deltas = [results[c].tensors for c in clients]
        sizes = torch.tensor([float(results[c].meta.get("num_examples", 0)) for c in clients], dtype=torch.float64)
        total = float(sizes.sum()) if o.size_norm == "sampled" else float(self.ctx.client_sizes.sum())
        scale = sizes / total if total > 0 else torch.zeros_like(sizes)
        logits = state["logits"].clone()
        w_old = row_softmax(logits[idx])
        if not o.fixed_k and o.merge_step > 0:
            sent = [merge_states([{k: g[k] for k in self.keys} for g in state["globals"]], w_old[r])
                    for r in range(len(clients))]
            inner = inner_products(deltas, state["globals"], sent, self.keys)
            grad = logit_gradient(w_old, inner, scale)
            if o.merge_update == "fixed":
                logits[idx] = fixed_magnitude_step(logits[idx], grad, o.merge_step)
            else:
                logits[idx] = logits[idx] + o.merge_step * grad
        w = row_softmax(logits[idx]) if o.weights_first else w_old
        if o.theta_update == "paper":
            coef, normalised = paper_coefficients(w, scale), False
        else:
            coef, normalised = column_normalised(w, sizes), True
        globals_ = update_globals(
            state["globals"], deltas, coef, o.theta_lr, normalised=normalised, int_policy=o.int_policy
        )
        return {**state, "globals": globals_, "logits": logits}

    def global_model(self, state: ServerState) -> None:
        return None  # every client has its own merge; there is no single global model

    def server_parameters(self, state: ServerState) -> int:
        return self.opt.d * model_params(self.ctx)

    # ---- client --------------------------------------------------------------------------------
    def fit(
        self, payload: Message, client_state: ClientState, data: ClientData, gen: torch.Generator
    ) -> tuple[Message, ClientState]:
        mu = float(self.opt.prox_mu)
        extra = None
        if mu > 0:
            anchor = {k: v.detach().clone() for k, v in payload.tensors.items()}

            def extra(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
                return mu * sum((p - anchor[n]).pow(2).sum() for n, p in m.named_parameters())

        model, meta = self.train_payload(payload, data, gen, extra_loss=extra)
        return Message(delta(state_of(model), payload.tensors), meta), client_state

    # ---- diagnostics ---------------------------------------------------------------------------
    def diagnostics(self, state: ServerState, fed: Any, info: RoundInfo) -> dict[str, Any]:
        w = self.weights(state).numpy()
        out: dict[str, Any] = {"merge_entropy": float(-(w * np.log(np.clip(w, 1e-300, None))).sum(1).mean())}
        groups = self.ctx.client_groups
        out["ari"] = cluster_ari(w, groups, self.ctx.seed) if groups else None
        every = int(self.opt.heatmap_every)
        if self.ctx.out_dir is not None and every > 0 and (info.index + 1) % every == 0:
            plot_weights(w, groups, Path(self.ctx.out_dir) / f"merge_weights_r{info.index + 1:04d}.png",
                         f"{self.name} merging weights, round {info.index + 1}")
        return out

    def finish(self, state: ServerState, fed: Any, out_dir: Path | None) -> None:
        if out_dir is None:
            return
        out_dir = Path(out_dir)
        w = self.weights(state).numpy()
        groups = self.ctx.client_groups
        plot_weights(w, groups, out_dir / "merge_weights_final.png", f"{self.name} merging weights (final)")
        (out_dir / "merge_weights.json").write_text(json.dumps({"weights": w.tolist(), "groups": groups}))


def plot_weights(w: np.ndarray, groups: list[int] | None, path: Path, title: str) -> Path:
    """Heat-map of the merging weights (clients × global models), clients ordered by ground-truth cluster
    when known, with dashed lines between clusters (papers' Fig. 5/7)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = np.arange(w.shape[0]) if groups is None else np.argsort(np.asarray(groups), kind="stable")
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * w.shape[1], 1.2 + 0.18 * w.shape[0]))
    im = ax.imshow(w[order], aspect="auto", cmap="viridis", vmin=0.0, vmax=max(float(w.max()), 1e-9))
    ax.set_xlabel("global model")
    ax.set_ylabel("client" + (" (ordered by true cluster)" if groups is not None else ""))
    ax.set_xticks(range(w.shape[1]))
    ax.set_yticks(range(w.shape[0]))
    ax.set_yticklabels([str(int(c)) for c in order], fontsize=6)
    if groups is not None:
        g = np.asarray(groups)[order]
        for i in np.flatnonzero(g[1:] != g[:-1]):
            ax.axhline(i + 0.5, color="white", linestyle="--", linewidth=0.8)
    fig.colorbar(im, ax=ax, fraction=0.05)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
