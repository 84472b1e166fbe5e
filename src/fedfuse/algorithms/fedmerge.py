"""FedMerge (Chen et al., *FedMerge: Federated Personalization via Model Merging* and *FedMerge: Federated
Model Merging for Personalization*; author code shutong043/FedMerge): d global models, merged per client.

Server state: d global models Θ_1..Θ_d (full state, BN buffers included) and merging logits a ∈ R^{m×d}
(w = row-softmax(a)).  Clients hold nothing.

Round:

1. sample clients (the runner's ``clients_per_round``; the code uses all clients every round);
2. send θ_i = Σ_j w_ij Θ_j over the *full* state (BN running statistics too; ``num_batches_tracked``: max);
3. client i trains θ_i with the run's local SGD and returns Δθ_i = θ_i^after − θ_i^sent for every entry
   (``prox_mu`` > 0 adds the code's ``prox_mu·‖θ − θ_sent‖²``; the papers do not mention it, default 0);
4. with s_i = n_i/n (n = Σ over the sampled clients, ``size_norm="all"``: over all clients):
   * logits (App. D, long paper Eq. 9, delta form): g_ij = s_i · w_ij · ⟨Δθ_i, Θ_j − θ_i⟩, the inner product over
     ``merge_params`` (default ``head``: the classification head, as the long paper and the code; ``last-K``; ``all``),
     parameters only.  ``merge_update="fixed"`` (default, paper §4.1): a ← a + step · G / max|G| — the closed
     form of the code's small-step search, which stops once a logit has moved by the step (the code overshoots
     by at most one of its increments); ``"gradient"``: a ← a + step · G; ``"none"``: frozen weights.
   * global models: ``theta_update="column_normalised"`` (default; the code's ``update_Theta``):
     Θ_j ← Θ_j + theta_lr · Σ_i ŵ_ij Δθ_i with ŵ_ij = w_ij n_i / Σ_k w_kj n_k, so each Θ_j takes a
     FedAvg-sized step along the deltas of the clients that use it; ``"paper"`` (extended FedMerge paper, Eq. 8/10):
     Θ_j ← Θ_j + theta_lr · Σ_i s_i w_ij Δθ_i, about 1/d of a FedAvg step while the weights are near uniform
     (``theta_lr = d`` restores the step size).
   Both use the weights the models were merged with (a simultaneous gradient step on Eq. 3);
   ``weights_first=true`` is the code's order (update a first, then Θ with the *new* w).
   The author code therefore corresponds to ``weights_first=true prox_mu=0.01`` with every client sampled.

Defaults chosen by measurement (the runs and their numbers are in ``docs/fedmerge.md``):

* **Logit step: ``merge_step=0`` = auto** — ``merge_travel`` (5 = the code's 0.01 × 500 rounds with every client
  every round) divided by the number of times a client is expected to be sampled in the run.  The code's fixed
  0.01 per round lets a client's logits move by only 0.04 in a 15-round run with 5 of 20 clients sampled: the
  weights stay uniform, every client gets the same average of d models, and with d = 10 independently
  initialised models that average is nearly input-independent (it collapses to one class).  With the auto
  step the paper and the column-normalised forms both learn the clusters.  ``merge_step=0.01`` is the code's
  value for its 500-round runs.
* **Θ update: column-normalised** (the code).  Eq. 8 leaves η_Θ free; η_Θ = 1 makes FedMerge's global models
  d× slower than FedAvg's; the code's column normalisation is what its authors ran.  Paper form is an option.
* **Initialisation: ``init="independent"``** (the papers' text and the code), zero logits.  The collapse at
  d = 10 came from the frozen weights, not from the initialisation; ``init="shared"`` (one initialisation
  copied d times, symmetry broken by random initial logits, ``logit_init_std`` auto 0.1) is an option.
  ``init="shared"`` with ``logit_init_std=0`` is refused: all d models would stay identical forever (FedAvg).

``fixed_k`` > 0 is the Fixed(k/d) ablation (FedMerge paper, Table 4): each client's weights are uniform over k randomly
chosen global models and frozen.

Diagnostics: ``ari`` (k-means on the weight rows, K = number of true groups, vs ``fed.groups()``, the ground
truth only diagnostics see) and ``merge_entropy`` per evaluated round; a heat-map PNG every ``heatmap_every``
rounds and at the end; at the end ``merge_weights.json``; the ARI of the final/best rounds appears in
``summary.json`` like every diagnostic.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.algorithms.base import Algorithm, ClientState, RoundInfo, ServerState
from fedfuse.engine.client import TrainStats
from fedfuse.engine.context import init_states, model_params, seeded_state
from fedfuse.engine.program import Batch, ClientProgram, LossTerm
from fedfuse.errors import UserError
from fedfuse.fusion.average import delta
from fedfuse.fusion.merge import (
    cluster_ari,
    fixed_weights,
    merge_entropy,
    merge_states,
    row_softmax,
    select_keys,
    server_step,
)
from fedfuse.options import opt
from fedfuse.rng import derive_seed, numpy_rng
from fedfuse.types import ClientData, Message, Privacy, ServerView, TensorDict, no, not_built

SHARED_LOGIT_STD = 0.1


def shared_globals(ctx: Any, count: int, purpose: str) -> list[TensorDict]:
    """``count`` copies of one initialised full model state (seeded from the run seed)."""
    base = seeded_state(ctx, derive_seed(ctx.seed, purpose, "shared"))
    return [{k: v.clone() for k, v in base.items()} for _ in range(count)]


class FedMerge(Algorithm):
    name = "fedmerge"
    description = "FedMerge: d global models, each client receives its learned weighted merge Σ_j w_ij Θ_j"
    privacy = (
        Privacy(ServerView.DELTAS,
                ("the merge logits of client i come from ⟨Δθ_i, Θ_j − θ_i⟩: each client's delta is read "
                 'individually'),
                central_dp=no('per-client merge weights are computed from each delta: noise on a mean does not'
                               ' cover them'),
                local_dp=not_built('DP-SGD on the client step would make each delta DP'),
                secagg=no('the inner products need each delta before any sum (and w_ij differs per client)')),
    )
    reply_kind = "delta"  # clients send Δθ, not a model: update checks measure the reply itself

    @dataclass
    class Options:
        d: int = opt(5, "number of global models d", ge=1)
        init: str = opt("independent", "initialisation of the d global models: independent (papers' text, code; "
                        "default, measured best) or shared (one initialisation copied d times; symmetry broken by "
                        "random initial logits)", choices=("independent", "shared"))
        logit_init_std: float = opt(-1.0, "std of the initial merging logits a_ij ~ N(0, std²); 0 = uniform "
                                    "weights (papers); -1 = auto (0 with init=independent, 0.1 with init=shared)",
                                    ge=-1.0)
        merge_params: str = opt("head", "parameters in the logit inner product: head (papers, code), last-K, all")
        merge_update: str = opt("fixed", "logit step: fixed (largest logit change = merge_step, FedMerge paper "
                                "§4.1, code) | gradient (a += merge_step·G) | none (weights frozen)",
                                choices=("fixed", "gradient", "none"))
        merge_step: float = opt(0.0, "logit step size; 0 = auto: merge_travel spread over the rounds a client is "
                                "expected to be sampled (the code's 0.01 per round fits its 500 rounds)", ge=0.0)
        merge_travel: float = opt(5.0, "auto merge_step: expected total logit travel of a client over the run "
                                  "(code: 0.01 × 500 rounds, every client every round = 5)", gt=0.0)
        theta_lr: float = opt(1.0, "η_Θ of Eq. 8 (global-model step; both theta_update forms)", gt=0.0)
        theta_update: str = opt("column_normalised", "global-model update: column_normalised (code's update_Theta, "
                                "ŵ_ij = w_ij n_i / Σ_k w_kj n_k: each Θ_j takes a FedAvg-sized step) | paper "
                                "(Eq. 8, Σ_i (n_i/n) w_ij Δθ_i: about 1/d of a FedAvg step)",
                                choices=("column_normalised", "paper"))
        weights_first: bool = opt(False, "code order: update the logits first, then Θ with the new weights")
        prox_mu: float = opt(0.0, "code's proximal term prox_mu·‖θ − θ_sent‖² (not halved; code: 0.01; papers: "
                             "none)", ge=0.0)
        size_norm: str = opt("sampled", "n in n_i/n: the sampled clients' total or all clients' total",
                             choices=("sampled", "all"))
        fixed_k: int = opt(0, ">0: Fixed(k/d) ablation (FedMerge paper, Table 4): frozen uniform weights over k "
                              "random models",
                           ge=0)
        int_policy: str = opt("max", "num_batches_tracked when merging/updating: max or first",
                              choices=("max", "first"))
        heatmap_every: int = opt(10, "rounds between merging-weight heat-maps (0 = only at the end)", ge=0)

    def __init__(self, ctx: Any, options: Any | None = None) -> None:
        super().__init__(ctx, options)
        o = self.opt
        if o.d < 1:
            raise UserError(f"d must be >= 1, got {o.d}")
        if o.merge_update not in ("fixed", "gradient", "none"):
            raise UserError(f"merge_update={o.merge_update!r}; choose fixed, gradient or none")
        if o.init not in ("shared", "independent"):
            raise UserError(f"init={o.init!r}; choose shared or independent")
        if o.theta_update not in ("paper", "column_normalised"):
            raise UserError(f"theta_update={o.theta_update!r}; choose paper or column_normalised")
        if o.size_norm not in ("sampled", "all"):
            raise UserError(f"size_norm={o.size_norm!r}; choose sampled or all")
        if o.fixed_k and not 1 <= o.fixed_k <= o.d:
            raise UserError(f"fixed_k must be in [1, d={o.d}], got {o.fixed_k}")
        if o.init == "shared" and o.d > 1 and not o.fixed_k and self.logit_init_std() == 0.0:
            raise UserError("init=shared with uniform initial weights (logit_init_std=0) never breaks the symmetry "
                            "of the d global models (it is FedAvg); use logit_init_std > 0 or init=independent")
        self.keys = select_keys(ctx.model(), o.merge_params)

    # ---- server --------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        o, m = self.opt, self.ctx.num_clients
        if o.fixed_k:
            logits = fixed_weights(m, o.d, o.fixed_k, numpy_rng(self.ctx.seed, "fedmerge-fixed"))
        else:
            std = self.logit_init_std()
            logits = torch.zeros(m, o.d, dtype=torch.float64)
            if std > 0:
                logits = torch.from_numpy(numpy_rng(self.ctx.seed, "fedmerge-logits").normal(0.0, std, (m, o.d)))
        if o.init == "shared":
            globals_ = shared_globals(self.ctx, o.d, "fedmerge-init")
        else:
            globals_ = init_states(self.ctx, o.d, "fedmerge-init")
        return {"globals": globals_, "logits": logits}

    def logit_init_std(self) -> float:
        """The initial logits' std: the option, or (auto) 0.1 for a shared initialisation, 0 otherwise."""
        std = float(self.opt.logit_init_std)
        if std < 0:
            return SHARED_LOGIT_STD if self.opt.init == "shared" else 0.0
        return std

    def merge_step(self, total_rounds: int) -> float:
        """The logit step per round: the option, or (auto) ``merge_travel`` over a client's expected samplings."""
        if self.opt.merge_step > 0:
            return float(self.opt.merge_step)
        m = max(self.ctx.num_clients, 1)
        expected = max(total_rounds, 1) * min(self.ctx.clients_per_round, m) / m
        return float(self.opt.merge_travel) / max(expected, 1.0)

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
        sizes = torch.tensor([float(results[c].num_examples) for c in clients], dtype=torch.float64)
        total = float(sizes.sum()) if o.size_norm == "sampled" else float(self.ctx.client_sizes.sum())
        step = 0.0 if o.fixed_k or o.merge_update == "none" else self.merge_step(info.total)
        globals_, logits = server_step(
            state["globals"], state["logits"], clients, [results[c].tensors for c in clients], sizes, total,
            self.keys, step=step, merge_update=o.merge_update, weights_first=o.weights_first,
            theta_update=o.theta_update, theta_lr=o.theta_lr, int_policy=o.int_policy,
        )
        return {**state, "globals": globals_, "logits": logits}

    def global_model(self, state: ServerState) -> None:
        return None  # every client has its own merge; there is no single global model

    def server_parameters(self, state: ServerState) -> int:
        return self.opt.d * model_params(self.ctx)

    # ---- client --------------------------------------------------------------------------------
    def loss_terms(self, payload: Message) -> tuple[tuple[LossTerm, ...], TensorDict]:
        """The optional proximal pull μ‖θ − θ_received‖² (``prox_mu``; 0 = off, the default)."""
        mu = float(self.opt.prox_mu)
        if mu <= 0:
            return (), {}
        anchor = {k: v.detach().clone() for k, v in payload.tensors.items()}

        def prox(b: Batch) -> torch.Tensor:
            return mu * sum((p - b.refs[n]).pow(2).sum() for n, p in b.params.items())

        return (LossTerm("fedmerge-prox", prox),), anchor

    def client_program(self, payload: Message, client_state: ClientState, data: ClientData) -> ClientProgram:
        """The standard step on the merged model, replying with the update Δθ_i = θ_i' − θ_i (not the state)."""
        program = self.standard_program(payload, client_state, data)
        finalize, sent = program.finalize, payload.tensors

        def as_delta(state: TensorDict, stats: TrainStats) -> tuple[Message, ClientState]:
            reply, cstate = finalize(state, stats)
            return Message(delta(reply.tensors, sent), reply.meta, reply.stats), cstate

        return dataclasses.replace(program, finalize=as_delta)

    # ---- diagnostics ---------------------------------------------------------------------------
    def diagnostics(self, state: ServerState, fed: Any, info: RoundInfo) -> dict[str, Any]:
        w = self.weights(state).numpy()
        out: dict[str, Any] = {"merge_entropy": merge_entropy(w)}
        groups = fed.groups()  # ground truth: diagnostics only
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
        groups = fed.groups()  # ground truth: diagnostics only
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
