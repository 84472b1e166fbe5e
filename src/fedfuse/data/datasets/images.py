"""Image datasets in IDX form and the bundled digits: ``digits`` (scikit-learn), ``mnist``, ``fashion-mnist``."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data.dataset import Dataset
from fedfuse.data.datasets.common import _NORM, SEED, _candidates, _labels, _missing, _normalise, _source_info
from fedfuse.data.datasets.registry import _MNIST_FILES
from fedfuse.errors import UserError

# ------------------------------------------------------------------------------------------------ digits


def _load_digits(root: Path | None, opts: dict[str, Any]) -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None]  # (N, 1, 8, 8) in [0, 1]
    y = bunch.target.astype(np.int64)
    tr, te = train_test_split(np.arange(len(y)), test_size=0.2, stratify=y, random_state=SEED)
    tr, te = np.sort(tr), np.sort(te)
    mean, std = float(x[tr].mean()), float(x[tr].std())
    x = (x - mean) / std
    return Dataset(
        name="digits",
        task="classification",
        train_x=torch.from_numpy(x[tr]),
        train_y=torch.from_numpy(y[tr]),
        test_x=torch.from_numpy(x[te]),
        test_y=torch.from_numpy(y[te]),
        num_classes=10,
        input_shape=(1, 8, 8),
        class_names=[str(i) for i in range(10)],
        info={
            "source_files": [],
            "checksums": {},
            "split": f"stratified 80/20 train_test_split(random_state={SEED})",
            "normalization": {"mean": mean, "std": std},
        },
    )


# ------------------------------------------------------------------------------------------- MNIST (IDX)

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Parse an IDX file (gzip-compressed or not): magic ``00 00 <dtype> <ndim>``, big-endian uint32 dims."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as e:
            raise UserError(f"{path}: corrupt or truncated gzip file ({e}); replace it with the canonical file"
                            ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise UserError(f"{path} is not an IDX file (bad magic {raw[:4].hex()})")
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise UserError(f"{path}: truncated IDX header ({len(raw)} bytes, {header} needed)")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(dims)) * dtype.itemsize
    if len(raw) != expected:
        raise UserError(f"{path}: IDX header says {dims} ({expected} bytes) but the file holds {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def _find_idx(folder: Path, base: str) -> Path | None:
    dotted = base.replace("-idx", ".idx")  # some mirrors name them train-images.idx3-ubyte
    for fname in (f"{base}.gz", base, f"{dotted}.gz", dotted):
        if (folder / fname).is_file():
            return folder / fname
    return None


def _load_mnist_like(name: str, subdirs: Sequence[str], root: Path | None) -> Dataset:
    searched = _candidates(root, *subdirs)
    for folder in searched:
        found = [_find_idx(folder, b) for b in _MNIST_FILES]
        if all(p is not None for p in found):
            paths: list[Path] = [p for p in found if p is not None]
            break
    else:
        raise _missing(name, root, searched)
    tr_x, tr_y, te_x, te_y = (read_idx(p) for p in paths)
    for imgs, labels, split in ((tr_x, tr_y, "train"), (te_x, te_y, "test")):
        if imgs.ndim != 3 or labels.ndim != 1 or imgs.shape[0] != labels.shape[0] or imgs.shape[1:] != (28, 28):
            raise UserError(f"{name}: {split} images {imgs.shape} do not match labels {labels.shape}")
    mean, std = _NORM[name]
    return Dataset(
        name=name,
        task="classification",
        train_x=_normalise(tr_x[:, None], mean, std),
        train_y=_labels(tr_y),
        test_x=_normalise(te_x[:, None], mean, std),
        test_y=_labels(te_y),
        num_classes=10,
        input_shape=(1, 28, 28),
        class_names=list(_FASHION_CLASSES if name == "fashion-mnist" else map(str, range(10))),
        info={**_source_info(name, paths), "normalization": {"mean": mean, "std": std}},
    )


_FASHION_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip


def _load_mnist(root: Path | None, opts: dict[str, Any]) -> Dataset:
    return _load_mnist_like("mnist", ["mnist", "MNIST", "MNIST/raw", "mnist/raw"], root)


def _load_fashion(root: Path | None, opts: dict[str, Any]) -> Dataset:
    subdirs = ["fashion-mnist", "fashion_mnist", "FashionMNIST", "FashionMNIST/raw", "fashion-mnist/raw"]
    return _load_mnist_like("fashion-mnist", subdirs, root)
