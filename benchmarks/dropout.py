"""Every algorithm under client dropouts: final accuracy with and without faults, and what was lost.

    PYTHONPATH=src python benchmarks/dropout.py --rounds 20 --dropout 0,0.3 --out /tmp/dropout

Image algorithms run on the bundled digits data (Dir(0.5), 10 clients, 5 per round, 1 local epoch, the default
MLP); the transformer and LoRA algorithms run on a small generated token federation (4 clients; the LoRA base is
a randomly initialised tiny transformer, so their accuracies only show that the runs complete).  Prints one
markdown table per run setting and writes it to ``OUT/dropout.md``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from fedfuse.algorithms import ALGORITHMS
from fedfuse.config import RunConfig, apply, validate
from fedfuse.runner import experiment
from fedfuse.types import ClientData, Federation, Split

LM_ALGORITHMS = ("simple-fedma", "fedit", "fedlora", "fedmerge-lora", "fedem-lora", "local-lora")
TINY = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "dropout": 0.0, "max_len": 16}


def lm_federation(vocab: int = 12, length: int = 8) -> Federation:
    """Four clients of generated token sequences (runs of consecutive ids mod ``vocab``)."""
    g = torch.Generator().manual_seed(0)

    def split(n: int) -> Split:
        seq = (torch.randint(0, vocab, (n, 1), generator=g) + torch.arange(length + 1)) % vocab
        return Split(seq[:, :-1], seq[:, 1:])

    clients = [ClientData(c, split(48), split(8), split(8)) for c in range(4)]
    return Federation(clients, split(32), vocab, (length,), task="lm", dataset="tiny-shakespeare", partition="iid")


def lora_base(vocab: int = 12) -> str:
    from fedfuse.models.transformer import TransformerModel

    torch.manual_seed(0)
    kw = {**TINY, "norm_first": True}
    m = TransformerModel(vocab, vocab, task="lm", **kw)
    path = Path(tempfile.mkdtemp()) / "base.pt"
    torch.save({"kind": "fedfuse-lm", "model": kw, "vocab": [chr(97 + i) for i in range(vocab)],
                "state": m.state_dict(), "info": {}}, path)
    return f"fedfuse:{path}"


def settings(algorithm: str, base: str | None) -> tuple[dict, bool]:
    if algorithm not in LM_ALGORITHMS:
        return dict(dataset="digits", clients=10, clients_per_round=5), False
    kw = dict(dataset="tiny-shakespeare", model="transformer", model_options=dict(TINY), clients=4,
              clients_per_round=4)
    if algorithm != "simple-fedma":
        kw.update(batch_size=4, optimizer="adam", lr=0.01,
                  algorithm_options={"base": base, "rank": 2, "rouge_samples": 0})
    return kw, True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dropout", default="0,0.3", help="comma-separated dropout probabilities")
    ap.add_argument("--algorithms", default="all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="dropout-benchmark")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = sorted(ALGORITHMS) if args.algorithms == "all" else args.algorithms.split(",")
    drops = [float(x) for x in args.dropout.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = lora_base() if any(n in LM_ALGORITHMS and n != "simple-fedma" for n in names) else None
    lm_fed = lm_federation()
    rows = []
    for name in names:
        kw, lm = settings(name, base)
        row = {"algorithm": name, "data": "generated tokens" if lm else "digits"}
        for p in drops:
            cfg = validate(apply(RunConfig(), {**kw, "algorithm": name, "rounds": args.rounds, "local_epochs": 1,
                                               "seed": args.seed, "dropout": p, "plots": False, "threads": 1,
                                               "eval_every": 5}))
            t0 = time.perf_counter()
            exp = experiment(cfg, fed=lm_fed if lm else None)
            s = exp.run()
            f = s["final"]
            for key, short in (("global_accuracy", "global"), ("personal_accuracy", "personal")):
                v = f.get(key)
                row[f"{short} p={p}"] = None if v is None else round(100 * v, 2)
            row[f"dropped p={p}"] = exp.totals.dropped
            row[f"quarantined p={p}"] = exp.totals.quarantined
            row[f"rounds p={p}"] = s["rounds_completed"]
            row[f"s p={p}"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(row), flush=True)
        rows.append(row)
    cols = list(rows[0])
    md = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    md += ["| " + " | ".join("—" if r.get(c) is None else str(r.get(c)) for c in cols) + " |" for r in rows]
    (out / "dropout.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
