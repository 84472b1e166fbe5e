"""Training precision: ``fp32`` or ``bf16`` autocast, chosen per run (``precision = fp32 | bf16 | auto``).

With ``bf16`` the forward pass and the loss of every local training step run under ``torch.autocast`` with
bfloat16: matrix products and convolutions compute in bf16 (their gradients too), while the model's weights,
the optimiser state, the buffers and everything the server does (aggregation, fusion, evaluation) stay fp32.
``auto`` picks bf16 where the hardware computes it natively — a CPU with ``avx512_bf16`` or AMX, a CUDA GPU that
supports bf16 (compute capability 8.0 and above) — and fp32 elsewhere.

The run sets its precision once (:func:`use_precision` around each round, in the worker processes and in a
Flower ``ClientApp``); the one place that reads it is :func:`train_autocast`, entered by every training step
(``train_local``, SAM's second pass and the batched executor's vmapped loss), so every algorithm and executor
honours it.  At ``fp32`` that context is a no-op: fp32 runs are bit-identical to runs without the option.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

PRECISIONS = ("fp32", "bf16", "auto")
MEMORY_FORMATS = ("auto", "contiguous", "channels_last")
FP32_MATMULS = ("ieee", "bf16")

_current = "fp32"
_memory_format = "contiguous"
_fp32_matmul = "ieee"


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 instructions (``avx512_bf16`` or AMX-BF16 in ``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` computes bf16 natively (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_has_native_bf16()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_capability(index)[0] >= 8
    return False


def resolve_precision(name: str, device: torch.device | str) -> str:
    """``fp32`` or ``bf16`` for a ``precision`` setting on ``device`` (``auto``: bf16 where native)."""
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}")
    if name == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    return name


def current_precision() -> str:
    """The training precision in effect in this process (``fp32`` unless a run set it)."""
    return _current


def current_settings() -> tuple[str, str, str]:
    """``(precision, memory_format, fp32_matmul)`` in effect: what a worker process needs to train as this one."""
    return _current, _memory_format, _fp32_matmul


def _set_fp32_matmul(value: str) -> None:
    """PyTorch's documented switch (``torch.backends.mkldnn.matmul.fp32_precision``): ``ieee`` leaves fp32
    products to the default BLAS (MKL), ``bf16`` sends them to oneDNN with bf16 internal arithmetic."""
    if value == "bf16" or torch.backends.mkldnn.matmul.fp32_precision not in ("none", "ieee"):
        torch.backends.mkldnn.matmul.fp32_precision = "bf16" if value == "bf16" else "none"


@contextlib.contextmanager
def use_precision(precision: str, memory_format: str = "contiguous", fp32_matmul: str = "ieee") -> Iterator[None]:
    """Train with ``precision`` (``fp32`` or ``bf16``), ``memory_format`` (``auto``, ``contiguous`` or
    ``channels_last``, see :func:`training_memory_format`) and ``fp32_matmul`` (``ieee`` or ``bf16``: the
    internal arithmetic of fp32 matrix products on a CPU) inside the block."""
    global _current, _memory_format, _fp32_matmul
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be resolved to fp32 or bf16, got {precision!r}")
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"unknown memory_format {memory_format!r}; choose one of {', '.join(MEMORY_FORMATS)}")
    if fp32_matmul not in FP32_MATMULS:
        raise ValueError(f"unknown fp32_matmul {fp32_matmul!r}; choose one of {', '.join(FP32_MATMULS)}")
    before = (_current, _memory_format, _fp32_matmul)
    _current, _memory_format, _fp32_matmul = precision, memory_format, fp32_matmul
    _set_fp32_matmul(fp32_matmul)
    try:
        yield
    finally:
        _current, _memory_format, _fp32_matmul = before
        _set_fp32_matmul(_fp32_matmul)


def train_autocast(device: torch.device | str) -> Any:
    """The autocast context of one training forward pass and loss on ``device`` (a no-op at fp32)."""
    if _current == "fp32":
        return contextlib.nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


#: Model classes that train faster channels-last (NHWC) on a CPU, by precision: measured with
#: ``benchmarks/memory_format.py`` (one thread, batch 50; docs/engine.md has the table).  ``memory_format=auto``
#: trains these channels-last and everything else in PyTorch's default (contiguous, NCHW) layout.
CHANNELS_LAST_CPU: dict[str, frozenset[str]] = {
    "fp32": frozenset({"CNN", "FemnistCNN", "CifarCNN", "ResNet"}),
    "bf16": frozenset({"CNN", "FemnistCNN", "CifarCNN", "ResNet"}),
}


def training_memory_format(model: torch.nn.Module, x: torch.Tensor) -> torch.memory_format | None:
    """The layout to train ``model`` on the 4-D batch ``x`` in, or ``None`` for PyTorch's default.

    ``channels_last`` forces NHWC for every 4-D input; ``auto`` chooses it for the model classes measured
    faster that way (:data:`CHANNELS_LAST_CPU` on a CPU; on a CUDA GPU every convolutional model at bf16,
    where NHWC is the tensor cores' layout); ``contiguous`` keeps NCHW.  The choice depends on the model, the
    device and the precision only, never on a timing, so a run stays a function of its seed.
    """
    if x.dim() != 4 or _memory_format == "contiguous":
        return None
    if _memory_format == "channels_last":
        return torch.channels_last
    has_conv = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    if not has_conv:
        return None
    if x.device.type == "cuda":
        return torch.channels_last if _current == "bf16" else None
    if x.device.type == "cpu" and type(model).__name__ in CHANNELS_LAST_CPU[_current]:
        return torch.channels_last
    return None


@contextlib.contextmanager
def train_layout(model: torch.nn.Module, x: torch.Tensor) -> Iterator[torch.memory_format | None]:
    """Convert ``model``'s 4-D weights to the training layout for the block and back to contiguous after it
    (so states leaving the training step have PyTorch's default strides); yields the layout for the inputs."""
    fmt = training_memory_format(model, x)
    if fmt is None:
        yield None
        return
    model.to(memory_format=fmt)
    try:
        yield fmt
    finally:
        model.to(memory_format=torch.contiguous_format)
