"""Time BBP-MAP (and Hungarian alignment) on one layer of N neurons for J clients.

Clients hold noisy, independently permuted copies of one layer (atoms of D = 785 = 784 inputs + bias, as
SimpleMLP's first layer on MNIST): ``w_j = P_j (θ + ε_j)``, ``θ ~ N(0, 0.3²)``, ``ε_j ~ N(0, 0.1²)``.
BBP-MAP runs with the FedMA code's hyper-parameters (σ = σ0 = 1, γ = 7, 5 iterations, cap 700).

    python benchmarks/matching.py                 # 100, 400, 1000 neurons, 10 clients
    python benchmarks/matching.py --neurons 100 --clients 4 --threads 1
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from fedfuse.fusion.match import bbp_map, hungarian


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--neurons", type=int, nargs="+", default=[100, 400, 1000])
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--dim", type=int, default=785)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch/numpy threads (0 = default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print("| neurons | clients | D | BBP-MAP s | global width | Hungarian (align all to client 1) s |")
    print("|---|---|---|---|---|---|")
    for n in args.neurons:
        theta = rng.normal(0, 0.3, size=(n, args.dim))
        atoms = [(theta + rng.normal(0, 0.1, size=theta.shape))[rng.permutation(n)] for _ in range(args.clients)]
        t0 = time.perf_counter()
        res = bbp_map(atoms, iters=args.iters, rng=np.random.default_rng(1))
        t_bbp = time.perf_counter() - t0
        t0 = time.perf_counter()
        for a in atoms[1:]:
            hungarian(atoms[0], a)
        t_h = time.perf_counter() - t0
        print(f"| {n} | {args.clients} | {args.dim} | {t_bbp:.2f} | {res.atoms.shape[0]} | {t_h:.2f} |", flush=True)


if __name__ == "__main__":
    main()
