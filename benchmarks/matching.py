"""BBP-MAP speed: fedfuse's :func:`~fedfuse.fusion.bbp.bbp_map` against a port of IBM/FedMA's matching.

``ibm_match_layer`` below re-implements, computation for computation, ``match_layer``, ``matching_upd_j`` and
``compute_cost`` of ``IBM/FedMA`` (``matching/pfnm.py``, Apache-2.0; written here from a reading of that file,
not copied): the cost matrix is built in float32 one local unit at a time (``row_param_cost_simplified``),
global atoms grow by ``np.vstack``, popularity counts are a Python list, and removing a client walks its
assignments and every other client's.  The only substitution is the assignment solver: the code calls
``lapsolver.solve_dense``, the port calls ``scipy.optimize.linear_sum_assignment`` (the same solver fedfuse
uses), so the ratio measures everything *around* the solver.

Inputs: ``J`` clients hold noisy, independently permuted copies of one layer of ``N`` units with ``D``
inputs + bias, ``w_j = P_j (θ + ε_j)``, ``θ ~ N(0, 0.3²)``, ``ε_j ~ N(0, 0.1²)`` (one seed).  Both run the
code's hyper-parameters (σ = σ0 = 1, γ = 7, 5 passes, cap 700, prior mean 0 / 0.1 for the bias) with the same
client order.  Times are CPU seconds of this process (``time.process_time``, one BLAS thread), so a busy
machine inflates both sides alike; each repeat runs the port, then fedfuse, then fedfuse with
``skip_settled=False`` (every pass's scores computed, no skipping once the grouping has settled), and the table
gives the best of the repeats and the median of the per-repeat ratios.  Both fedfuse runs must give the port's
assignments.  Cases: the report's SimpleMLP layers as matched layer by layer (20×785,
100×21, 120×101, 84×121; 2 and 10 clients), its widest first layer (270×785, 5 clients), the 400-unit ×
10-client case, and VGG-9-sized conv layers with 16 clients (128 channels × 64·3·3 inputs, 256 × 256·3·3).

    python benchmarks/matching.py                       # all cases, one thread, repeats chosen per case
    python benchmarks/matching.py --cases 400x785x10 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from scipy.optimize import linear_sum_assignment

CASES = {  # name: (units, inputs + bias, clients)
    "simple-mlp-l1-2": (20, 785, 2),
    "simple-mlp-l1-10": (20, 785, 10),
    "simple-mlp-l2-10": (100, 21, 10),
    "simple-mlp-l3-10": (120, 101, 10),
    "simple-mlp-l4-10": (84, 121, 10),
    "wide-l1-270x785-5": (270, 785, 5),
    "400x785x10": (400, 785, 10),
    "vgg9-conv128-16": (128, 577, 16),
    "vgg9-conv256-16": (256, 2305, 16),
}


# ------------------------------------------------------------------------------------- port of IBM's pfnm


def _ibm_cost(global_w, w_j, global_sig, sig_inv_j, prior_norm, prior_inv_sig, popularity, gamma, J):
    """``compute_cost``: float32, one local unit per Python iteration."""
    Lj = w_j.shape[0]
    counts = np.minimum(np.array(popularity, dtype=np.float32), 10)
    denom = sig_inv_j + global_sig
    reduced = (global_w**2 / global_sig).sum(axis=1)
    param = np.array([((w_j[l] + global_w) ** 2 / denom).sum(axis=1) - reduced for l in range(Lj)],
                     dtype=np.float32)
    param += np.log(counts / (J - counts))
    L = global_w.shape[0]
    max_added = min(Lj, max(700 - L, 1))
    nonparam = np.outer(((w_j + prior_norm) ** 2 / (prior_inv_sig + sig_inv_j)).sum(axis=1)
                        - (prior_norm**2 / prior_inv_sig).sum(), np.ones(max_added, dtype=np.float32))
    nonparam -= 2 * np.log(np.arange(1, max_added + 1))
    nonparam += 2 * np.log(gamma / J)
    return np.hstack((param, nonparam)).astype(np.float32)


def _ibm_update(w_j, global_w, sig_inv_j, global_sig, prior_norm, prior_inv_sig, popularity, gamma, J):
    """``matching_upd_j``: costs cast to float32, solved (minimising the negated cost), atoms appended."""
    L = global_w.shape[0]
    cost = _ibm_cost(global_w.astype(np.float32), w_j.astype(np.float32), global_sig.astype(np.float32),
                     sig_inv_j.astype(np.float32), prior_norm.astype(np.float32), prior_inv_sig.astype(np.float32),
                     popularity, gamma, J)
    rows, cols = linear_sum_assignment(-cost)
    assignment_j = []
    new_L = L
    for l, i in zip(rows, cols):
        if i < L:
            popularity[i] += 1
            assignment_j.append(i)
            global_w[i] += w_j[l]
            global_sig[i] += sig_inv_j
        else:
            popularity += [1]
            assignment_j.append(new_L)
            new_L += 1
            global_w = np.vstack((global_w, prior_norm + w_j[l]))
            global_sig = np.vstack((global_sig, prior_inv_sig + sig_inv_j))
    return global_w, global_sig, popularity, assignment_j


def ibm_match_layer(weights, sigma_inv_layer, mean_prior, sigma_inv_prior, gamma, it, rng):
    """``match_layer``: largest client first, then ``it`` passes of remove-and-rematch in random order."""
    J = len(weights)
    order = sorted(range(J), key=lambda x: -weights[x].shape[0])
    w_norm = [w * s for w, s in zip(weights, sigma_inv_layer)]
    prior_norm = mean_prior * sigma_inv_prior
    global_w = prior_norm + w_norm[order[0]]
    global_sig = np.outer(np.ones(global_w.shape[0]), sigma_inv_prior + sigma_inv_layer[order[0]])
    popularity = [1] * global_w.shape[0]
    assignment: list[list[int]] = [[] for _ in range(J)]
    assignment[order[0]] = list(range(global_w.shape[0]))
    for j in order[1:]:
        global_w, global_sig, popularity, assignment[j] = _ibm_update(
            w_norm[j], global_w, sigma_inv_layer[j], global_sig, prior_norm, sigma_inv_prior, popularity, gamma, J)
    for _ in range(it):
        for j in rng.permutation(J):
            to_delete = []
            Lj = len(assignment[j])
            for l, i in sorted(zip(range(Lj), assignment[j]), key=lambda x: -x[1]):
                popularity[i] -= 1
                if popularity[i] == 0:
                    del popularity[i]
                    to_delete.append(i)
                    for jc in range(J):
                        for idx, li in enumerate(assignment[jc]):
                            if i < li and jc != j:
                                assignment[jc][idx] -= 1
                else:
                    global_w[i] = global_w[i] - w_norm[j][l]
                    global_sig[i] -= sigma_inv_layer[j]
            global_w = np.delete(global_w, to_delete, axis=0)
            global_sig = np.delete(global_sig, to_delete, axis=0)
            global_w, global_sig, popularity, assignment[j] = _ibm_update(
                w_norm[j], global_w, sigma_inv_layer[j], global_sig, prior_norm, sigma_inv_prior, popularity, gamma,
                J)
    return assignment, global_w, global_sig


# ------------------------------------------------------------------------------------------------- driver


def make_inputs(units: int, dim: int, clients: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    theta = rng.normal(0, 0.3, size=(units, dim))
    return [(theta + rng.normal(0, 0.1, size=theta.shape))[rng.permutation(units)] for _ in range(clients)]


def run_case(units: int, dim: int, clients: int, repeat: int = 1, iters: int = 5) -> dict:
    """Time the IBM port and fedfuse (default, and with every pass computed) on the same inputs, interleaved."""
    from fedfuse.fusion.bbp import bbp_map

    atoms = make_inputs(units, dim, clients)
    mu0 = np.r_[np.zeros(dim - 1), 0.1]  # weights 0, bias 0.1 (the code's prior mean)
    ones = np.ones(dim)
    t_ibm: list[float] = []
    t_ff: list[float] = []
    t_all: list[float] = []
    while len(t_ibm) < max(repeat, 1):
        t0 = time.process_time()
        a_ibm, g_ibm, s_ibm = ibm_match_layer(atoms, [ones] * clients, mu0, ones, 7.0, iters, np.random.default_rng(1))
        t_ibm.append(time.process_time() - t0)
        t0 = time.process_time()
        res = bbp_map(atoms, sigma=1.0, sigma0=1.0, gamma=7.0, mu0=mu0, iters=iters, cap=700,
                      rng=np.random.default_rng(1))
        t_ff.append(time.process_time() - t0)
        t0 = time.process_time()
        every = bbp_map(atoms, sigma=1.0, sigma0=1.0, gamma=7.0, mu0=mu0, iters=iters, cap=700,
                        rng=np.random.default_rng(1), skip_settled=False)
        t_all.append(time.process_time() - t0)
        if repeat <= 0 and len(t_ibm) == 1:  # auto: about 2 s of the port's time, 1 to 51 repeats
            repeat = max(1, min(51, int(2.0 / max(t_ibm[0], 1e-6))))
    same = all(np.array_equal(np.asarray(a, dtype=np.int64), b) for a, b in zip(a_ibm, res.assign))
    same &= all(np.array_equal(np.asarray(a, dtype=np.int64), b) for a, b in zip(a_ibm, every.assign))
    atoms_close = all(g_ibm.shape == r.g.shape and bool(np.allclose(g_ibm / s_ibm, r.atoms, rtol=1e-9, atol=1e-9))
                      for r in (res, every))
    return {"ibm_s": min(t_ibm), "fedfuse_s": min(t_ff), "every_s": min(t_all), "same": same, "repeats": len(t_ibm),
            "atoms_close": atoms_close, "width": res.atoms.shape[0],
            "median_ratio": float(np.median(np.array(t_ibm) / np.maximum(t_ff, 1e-9)))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), help=f"case names (default all): {', '.join(CASES)}")
    p.add_argument("--repeat", type=int, default=0,
                   help="timings are the best of this many interleaved runs (0 = auto: ≈ 2 s of the port's time)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="BLAS/torch threads (default 1)")
    args = p.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(args.threads))
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.threads)
    except ImportError:  # pragma: no cover - threadpoolctl ships with scikit-learn
        pass
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| case | units | D | clients | global width | identical assignments | same atoms | IBM port s "
          "| fedfuse s | speed-up | median of paired ratios | fedfuse, every pass computed s | its speed-up "
          "| repeats |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = float("inf")
    all_same = True
    for name in args.cases:
        n, d, j = CASES[name] if name in CASES else map(int, name.split("x"))
        r = run_case(n, d, j, args.repeat, args.iters)
        ratio = r["ibm_s"] / r["fedfuse_s"]
        worst = min(worst, ratio)
        all_same &= r["same"]
        print(f"| {name} | {n} | {d} | {j} | {r['width']} | {'yes' if r['same'] else 'NO'} | "
              f"{'yes' if r['atoms_close'] else 'NO'} | {r['ibm_s']:.4f} | {r['fedfuse_s']:.5f} | {ratio:.1f}× | "
              f"{r['median_ratio']:.1f}× | {r['every_s']:.5f} | {r['ibm_s'] / r['every_s']:.1f}× | {r['repeats']} |",
              flush=True)
    print(f"\nidentical assignments in every case: {'yes' if all_same else 'NO'}; smallest speed-up {worst:.1f}×")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
