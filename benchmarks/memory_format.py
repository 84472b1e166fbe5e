"""Training-step time of every convolutional model in NCHW (contiguous) and NHWC (channels-last), fp32 and bf16.

One torch thread, every (model, precision, format) variant interleaved in this process, median CPU time of a
forward + backward + SGD step over ``--repeats`` rounds of ``--steps`` steps, batch ``--batch``:

    python benchmarks/memory_format.py [--models cnn,cnn-cifar,...] [--repeats 5] [--steps 5] [--batch 50]

Prints, per model and precision, ms/step in both formats and the NHWC speed-up — the measurements behind
``memory_format = auto`` (``fedfuse.engine.memory.CHANNELS_LAST``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedfuse.models import build_model
from fedfuse.runtime.precision import train_autocast, use_precision

#: model → (input shape, classes)
SHAPES = {
    "cnn": ((1, 28, 28), 10), "cnn-femnist": ((1, 28, 28), 62), "cnn-cifar": ((3, 32, 32), 10),
    "resnet9": ((3, 32, 32), 10), "resnet20": ((3, 32, 32), 10), "resnet18": ((3, 32, 32), 10),
    "vgg16": ((3, 32, 32), 10), "vgg16-bn": ((3, 32, 32), 10),
}


def step_time(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, fmt: torch.memory_format,
              precision: str) -> float:
    """CPU seconds per training step of ``model`` with weights and inputs in ``fmt``."""
    model = model.to(memory_format=fmt)
    x = x.contiguous(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with use_precision(precision):
        t0 = time.process_time()
        for _ in range(steps):
            with train_autocast("cpu"):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return (time.process_time() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=50)
    a = p.parse_args()
    torch.set_num_threads(1)
    import os

    print(f"load average {os.getloadavg()[0]:.1f} at start; torch {torch.__version__}, 1 thread, batch {a.batch}")
    print("| model | precision | NCHW ms/step | NHWC ms/step | NHWC speed-up |")
    print("|---|---|---|---|---|")
    for name in a.models.split(","):
        shape, classes = SHAPES[name]
        torch.manual_seed(0)
        model = build_model(name, shape, classes)
        model.train()
        x = torch.randn(a.batch, *shape)
        y = torch.randint(0, classes, (a.batch,))
        fmts = {"NCHW": torch.contiguous_format, "NHWC": torch.channels_last}
        for prec in a.precisions.split(","):
            times: dict[str, list[float]] = {k: [] for k in fmts}
            for f in fmts.values():  # warm-up
                step_time(model, x, y, 1, f, prec)
            for _ in range(a.repeats):
                for k, f in fmts.items():
                    times[k].append(step_time(model, x, y, a.steps, f, prec))
            c, n = statistics.median(times["NCHW"]), statistics.median(times["NHWC"])
            print(f"| {name} | {prec} | {c * 1e3:.1f} | {n * 1e3:.1f} | {c / n:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
