"""Why MSfusion's full model trails HeteroFL on MNIST shards: the pieces against the whole.

For finished MSfusion run directories (with ``checkpoint.pt``), each participant's last trained sub-model is
scored on the global test images of *its own* classes (argmax over all 10 outputs, and over its own classes
only), and on all test images; beside them the assembled full model, and "oracle routing": every test image
sent to a participant whose classes include its label (the best of them, i.e. an upper bound of what the pieces
know).  For HeteroFL / FedRolex run directories the global model is scored the same way.

    python benchmarks/msfusion_experts.py RUN_DIR [RUN_DIR ...] [--data-dir ../shared/data]

Prints one Markdown row per run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from fedfuse.engine.checkpoint import load_checkpoint
from fedfuse.fusion.slicing import load_submodel
from fedfuse.result import load
from fedfuse.runner import experiment


@torch.no_grad()
def logits_of(model: torch.nn.Module, x: torch.Tensor, batch: int = 1024) -> torch.Tensor:
    model.eval()
    return torch.cat([model(x[i:i + batch]) for i in range(0, len(x), batch)])


def classes_of(client) -> list[int]:
    return sorted(int(c) for c in torch.unique(client.train.y))


def analyse(run_dir: Path, data_dir: str | None) -> dict[str, float | str]:
    res = load(run_dir)
    cfg = res.config
    cfg.out, cfg.data_dir = None, data_dir or cfg.data_dir
    exp = experiment(cfg, progress=False)
    ck = load_checkpoint(run_dir / "checkpoint.pt")  # safe: a tampered file is refused, nothing in it runs
    x, y = exp.fed.test.x, exp.fed.test.y
    g = exp.algo.global_model(ck["state"])
    full_logits = logits_of(exp.ctx.load(g[0], g[1]), x)
    out: dict[str, float | str] = {"run": f"{cfg.algorithm} seed {cfg.seed}",
                                   "full model, all test images %": 100 * float((full_logits.argmax(1) == y).float()
                                                                                .mean())}
    if cfg.algorithm != "msfusion":
        return out
    own_any, own_masked, all_imgs = [], [], []
    best_correct = torch.zeros(len(y), dtype=torch.bool)
    for c, st in sorted(ck["client_states"].items()):
        if not st:
            continue
        sub = load_submodel(exp.algo._full, exp.algo.spec, st["sub"], st["sel"], "analysis")
        lg = logits_of(sub, x)
        cls = torch.tensor(classes_of(exp.fed.clients[c]))
        mine = torch.isin(y, cls)
        pred = lg.argmax(1)
        masked = lg.clone()
        masked[:, ~torch.isin(torch.arange(lg.shape[1]), cls)] = -float("inf")
        mpred = masked.argmax(1)
        own_any.append(float((pred[mine] == y[mine]).float().mean()))
        own_masked.append(float((mpred[mine] == y[mine]).float().mean()))
        all_imgs.append(float((pred == y).float().mean()))
        best_correct |= mine & (mpred == y)
    n = len(own_any)
    out.update({
        "sub-models on own classes %": 100 * sum(own_any) / n,
        "same, argmax over own classes %": 100 * sum(own_masked) / n,
        "sub-models on all test images %": 100 * sum(all_imgs) / n,
        "oracle routing %": 100 * float(best_correct.float().mean()),
    })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--data-dir", default=os.environ.get("FEDFUSE_DATA"))
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = [analyse(r, args.data_dir) for r in args.runs]
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "—"))
                                for c in cols) + " |")


if __name__ == "__main__":
    main()
