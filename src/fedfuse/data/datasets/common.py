"""What every dataset family shares: the data and cache directories, missing-file errors, checksums, the
``.npz`` cache and the classification helpers (normalisation, stratified limits, rotation domains).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedfuse.data.dataset import Dataset, DatasetNotFoundError, cache_dir
from fedfuse.data.datasets.registry import _CHECKSUMS, _IMAGE_DATASETS, DATASETS
from fedfuse.errors import UserError
from fedfuse.rng import numpy_rng

SEED = 0  # fixed seed of every deterministic choice made while loading (splits, subsets, rotation domains)
CACHE_VERSION = 2
MAX_HASH_BYTES = 100 * 1024 * 1024
EOS = "<eos>"
UNK = "<unk>"
_NORM: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> Path | None:
    """The data directory: ``data_dir`` if given, else ``$FEDFUSE_DATA`` if set, else ``None``."""
    if data_dir is None or str(data_dir) == "":
        data_dir = os.environ.get("FEDFUSE_DATA") or None
    return None if data_dir is None else Path(data_dir).expanduser()


# ------------------------------------------------------------------------------------ files and errors


def _missing(name: str, root: Path | None, searched: Sequence[Path], detail: str = "") -> DatasetNotFoundError:
    """A :class:`DatasetNotFoundError` saying what to put where and where to get it."""
    info = DATASETS[name]
    base = "DIR" if root is None else str(root)
    if root is None:
        where = "no data directory was given (pass --data-dir DIR or set FEDFUSE_DATA)"
    elif not root.is_dir():
        where = f"data directory {root} does not exist"
    else:
        dirs = ", ".join(dict.fromkeys(str(p) for p in searched)) or str(root)
        where = f"searched {dirs}"
    lines = [f"dataset {name!r} not found: {where}."]
    if detail:
        lines.append(detail)
    lines.append("Expected files:")
    lines += [f"  {base}/{f}" for f in info.files]
    if info.alt_files:
        lines.append("Also accepted:")
        lines += [f"  {base}/{f}" for f in info.alt_files]
    lines.append(f"Get them from: {info.source}")
    return DatasetNotFoundError("\n".join(lines))


def _candidates(root: Path | None, *subdirs: str) -> list[Path]:
    """``root/sub`` for each sub, then ``root`` itself (``[]`` without a root)."""
    if root is None:
        return []
    return [root / s for s in subdirs] + [root]


_CHECKED: dict[tuple[str, int, int], str] = {}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verify(name: str, paths: Sequence[Path]) -> dict[str, str]:
    """Compare files with their canonical size/sha256 (warn on mismatch); status per file name."""
    known = _CHECKSUMS.get(name, {})
    skip_hash = os.environ.get("FEDFUSE_SKIP_CHECKSUMS", "") not in ("", "0")
    status: dict[str, str] = {}
    for path in paths:
        ref = known.get(path.name)
        if ref is None:
            status[path.name] = "unknown"
            continue
        st = path.stat()
        memo = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if memo in _CHECKED:
            status[path.name] = _CHECKED[memo]
            continue
        size, digest = ref
        if st.st_size != size:
            result = "mismatch"
            warnings.warn(
                f"{name}: {path} has {st.st_size} bytes, the canonical file has {size}; using it anyway",
                stacklevel=3,
            )
        elif skip_hash or st.st_size > MAX_HASH_BYTES:
            result = "size-ok"
        elif _sha256(path) != digest:
            result = "mismatch"
            warnings.warn(f"{name}: sha256 of {path} differs from the canonical file; using it anyway", stacklevel=3)
        else:
            result = "ok"
        if result != "size-ok":  # a skipped hash may still be checked later in the process
            _CHECKED[memo] = result
        status[path.name] = result
    return status


def _source_info(name: str, paths: Sequence[Path]) -> dict[str, Any]:
    return {"source_files": [str(p) for p in paths], "checksums": _verify(name, paths)}


# ----------------------------------------------------------------------------------------------- cache


def _cache_key(kind: str, paths: Sequence[Path]) -> str:
    h = hashlib.sha256(f"{kind}|v{CACHE_VERSION}".encode())
    for p in paths:
        st = p.stat()
        h.update(f"|{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def _cached(kind: str, paths: Sequence[Path], build: Callable[[], dict[str, np.ndarray]]) -> tuple[dict, Path]:
    """Arrays cached for ``paths``' current state, else ``build()`` them and store them atomically."""
    target = cache_dir() / f"{kind}-{_cache_key(kind, paths)}.npz"
    if target.is_file():
        try:
            with np.load(target, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}, target
        except Exception as exc:  # corrupt or truncated cache: rebuild it
            warnings.warn(f"ignoring unreadable cache file {target}: {exc}", stacklevel=3)
    arrays = build()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        warnings.warn(f"could not write cache file {target}: {exc}", stacklevel=3)
    return arrays, target


# ------------------------------------------------------------------------------------------- helpers


def _normalise(x_uint8: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 (N, C, H, W) -> float32 ``(x / 255 - mean) / std`` per channel."""
    x = torch.from_numpy(np.ascontiguousarray(x_uint8)).to(torch.float32)
    s = torch.tensor(std, dtype=torch.float64)
    scale = (1.0 / (255.0 * s)).to(torch.float32).view(1, -1, 1, 1)
    shift = (torch.tensor(mean, dtype=torch.float64) / s).to(torch.float32).view(1, -1, 1, 1)
    return x.mul_(scale).sub_(shift)


def _labels(y: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(y, dtype=np.int64))


def _natural_key(path: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def _stratified_subset(y: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``n`` samples with class proportions of ``y`` (largest remainder), in original order."""
    _, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    quota = counts * (n / len(y))
    take = np.floor(quota).astype(np.int64)
    extra = n - int(take.sum())
    take[np.argsort(-(quota - take), kind="stable")[:extra]] += 1
    chosen = [rng.permutation(np.flatnonzero(inverse == c))[:t] for c, t in enumerate(take)]
    return np.sort(np.concatenate(chosen))


def _apply_limits(ds: Dataset, train_limit: int | None, test_limit: int | None) -> Dataset:
    for split, limit in (("train", train_limit), ("test", test_limit)):
        y = getattr(ds, f"{split}_y")
        if limit is None or limit >= len(y):
            continue
        idx = _stratified_subset(y.numpy(), limit, numpy_rng(SEED, "subset", ds.name, split))
        t = torch.from_numpy(idx)
        setattr(ds, f"{split}_x", getattr(ds, f"{split}_x")[t])
        setattr(ds, f"{split}_y", y[t])
        for attr in (f"{split}_groups", f"{split}_domains"):
            if getattr(ds, attr) is not None:
                setattr(ds, attr, getattr(ds, attr)[idx])
        ds.info[f"{split}_subset"] = f"stratified {limit} of {len(y)}"
    return ds


def rotate_images(x: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate (N, C, H, W) images counter-clockwise by ``degrees`` (exact for multiples of 90°)."""
    if degrees % 90 == 0:
        return torch.rot90(x, int(degrees // 90) % 4, dims=(-2, -1))
    t = math.radians(degrees)
    c, s = math.cos(t), math.sin(t)
    theta = torch.tensor([[c, -s, 0.0], [s, c, 0.0]], dtype=x.dtype)
    out = torch.empty_like(x)
    for i in range(0, x.shape[0], 4096):
        chunk = x[i : i + 4096]
        grid = F.affine_grid(theta.expand(chunk.shape[0], 2, 3), list(chunk.shape), align_corners=False)
        out[i : i + 4096] = F.grid_sample(chunk, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out


def _rotate_domains(ds: Dataset, k: int) -> None:
    if ds.name not in _IMAGE_DATASETS:
        raise UserError(f"rotate_domains applies to image datasets only, not {ds.name!r}")
    angles = [d * 360.0 / k for d in range(k)]
    for split in ("train", "test"):
        x = getattr(ds, f"{split}_x")
        n = x.shape[0]
        domains = np.empty(n, dtype=np.int64)
        domains[numpy_rng(SEED, "rotate_domains", ds.name, k, split).permutation(n)] = np.arange(n) % k
        for d in range(1, k):
            idx = torch.from_numpy(np.flatnonzero(domains == d))
            x[idx] = rotate_images(x[idx], angles[d])
        setattr(ds, f"{split}_x", x)
        setattr(ds, f"{split}_domains", domains)
    ds.domain_names = [f"rot{round(a, 1):g}" for a in angles]
