"""CIFAR-10 / CIFAR-100: the authors' pickled batches (tar or folder) or a JPEG folder layout."""

from __future__ import annotations

import io
import pickle
import tarfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedfuse.data.dataset import Dataset
from fedfuse.data.datasets.common import _NORM, _cached, _candidates, _labels, _missing, _normalise, _source_info
from fedfuse.errors import UserError

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# --------------------------------------------------------------------------------------- CIFAR (pickles)

_SAFE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and NumPy arrays only (the CIFAR batches need nothing else)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


def _unpickle(data: bytes) -> dict[str, Any]:
    obj = _ArrayUnpickler(io.BytesIO(data), encoding="latin1").load()
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in obj.items()}


def _names(values: Any) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def _pickle_source(
    root: Path | None, folder: str, tarball: str, required: Sequence[str], extra_dirs: Sequence[str]
) -> tuple[Callable[[str], bytes | None], list[Path], list[Path]] | None:
    """A reader ``member -> bytes`` over ``folder/`` or ``tarball``, the files used, and the dirs searched."""
    searched: list[Path] = []
    for base in _candidates(root, *extra_dirs):
        for d in (base / folder, base):
            searched.append(d)
            if all((d / f).is_file() for f in required):

                def read(member: str, d: Path = d) -> bytes | None:
                    p = d / member
                    return p.read_bytes() if p.is_file() else None

                return read, [d / f for f in required], searched
        tar_path = base / tarball
        if tar_path.is_file():
            members: dict[str, bytes] = {}
            try:
                with tarfile.open(tar_path) as tar:
                    for m in tar:
                        parts = m.name.split("/")
                        if m.isfile() and len(parts) >= 2 and parts[-2] == folder:
                            f = tar.extractfile(m)
                            if f is not None:
                                members[parts[-1]] = f.read()
            except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
                raise UserError(f"{tar_path}: corrupt or truncated archive ({e}); replace it with the canonical "
                                "file") from None
            if all(f in members for f in required):
                return members.get, [tar_path], searched
    return None


def _cifar_arrays(batch: dict[str, Any], label_key: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    data = np.asarray(batch["data"], dtype=np.uint8)
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3072 or data.shape[0] != labels.shape[0]:
        raise UserError(f"{where}: expected data (N, 3072) and N labels, got {data.shape} and {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_dataset(
    name: str, tr: tuple[np.ndarray, np.ndarray], te: tuple[np.ndarray, np.ndarray], num_classes: int,
    class_names: list[str] | None, info: dict[str, Any],
) -> Dataset:  # fmt: skip
    mean, std = _NORM[name]
    return Dataset(
        name=name,
        task="classification",
        train_x=_normalise(tr[0], mean, std),
        train_y=_labels(tr[1]),
        test_x=_normalise(te[0], mean, std),
        test_y=_labels(te[1]),
        num_classes=num_classes,
        input_shape=(3, 32, 32),
        class_names=class_names,
        info={**info, "normalization": {"mean": mean, "std": std}},
    )


def _load_cifar10(root: Path | None, opts: dict[str, Any]) -> Dataset:
    batches = [f"data_batch_{i}" for i in range(1, 6)]
    src = _pickle_source(root, "cifar-10-batches-py", "cifar-10-python.tar.gz", [*batches, "test_batch"], ["cifar10"])
    if src is not None:
        read, paths, _ = src
        parts = [_cifar_arrays(_unpickle(read(b) or b""), "labels", b) for b in batches]
        tr = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        te = _cifar_arrays(_unpickle(read("test_batch") or b""), "labels", "test_batch")
        meta = read("batches.meta")
        names = _names(_unpickle(meta)["label_names"]) if meta else list(CIFAR10_CLASSES)
        info = {**_source_info("cifar10", paths), "format": "python pickles"}
        return _cifar_dataset("cifar10", tr, te, 10, names, info)
    jpeg = _find_cifar_jpeg(root)
    if jpeg is None:
        searched = _candidates(root, "cifar10", "cifar10-jpeg", "cifar-10-batches-py")
        raise _missing("cifar10", root, searched)
    arrays, cache_path = jpeg
    info = {
        **_source_info("cifar10", arrays.pop("_paths")),
        "format": "JPEG images (lossy re-encode)",
        "cache": str(cache_path),
    }
    tr = (arrays["train_x"], arrays["train_y"])
    te = (arrays["test_x"], arrays["test_y"])
    return _cifar_dataset("cifar10", tr, te, 10, list(CIFAR10_CLASSES), info)


_IMAGE_EXT = (".jpg", ".jpeg", ".png")


def _jpeg_key(parts: Sequence[str]) -> tuple[str, int] | None:
    """(split, label) of a path ``.../{train,test}/<class>/<file>.jpg``, else None."""
    if len(parts) < 3 or not parts[-1].lower().endswith(_IMAGE_EXT):
        return None
    split, cls = parts[-3], parts[-2]
    if split not in ("train", "test") or cls not in CIFAR10_CLASSES:
        return None
    return split, CIFAR10_CLASSES.index(cls)


def _decode_images(items: list[tuple[str, int, Callable[[], bytes]]]) -> dict[str, np.ndarray]:
    """Decode (split, label, reader) items in the given order into uint8 (N, 3, 32, 32) arrays per split."""
    from PIL import Image

    out: dict[str, np.ndarray] = {}
    for split in ("train", "test"):
        chosen = [(label, read) for s, label, read in items if s == split]
        x = np.empty((len(chosen), 3, 32, 32), dtype=np.uint8)
        for i, (_, read) in enumerate(chosen):
            with Image.open(io.BytesIO(read())) as img:
                arr = np.asarray(img.convert("RGB"))
            if arr.shape != (32, 32, 3):
                raise UserError(f"cifar10: image {i} of {split} has shape {arr.shape}, expected 32x32x3")
            x[i] = arr.transpose(2, 0, 1)
        out[f"{split}_x"] = x
        out[f"{split}_y"] = np.array([label for label, _ in chosen], dtype=np.int64)
    return out


def _find_cifar_jpeg(root: Path | None) -> tuple[dict[str, Any], Path] | None:
    """Decoded arrays of the JPEG layout (folder or tarball), via the cache, and the cache path."""
    bases = _candidates(root, "cifar10-jpeg", "cifar10", "CIFAR-10-images")
    folders: list[Path] = []
    for base in bases:
        folders.append(base)
        if base.is_dir():
            folders += sorted(p for p in base.glob("CIFAR-10-images*") if p.is_dir())
    for folder in folders:
        if not all((folder / s / c).is_dir() for s in ("train", "test") for c in CIFAR10_CLASSES):
            continue
        files = sorted(
            p for s in ("train", "test") for c in CIFAR10_CLASSES for p in (folder / s / c).iterdir()
            if p.suffix.lower() in _IMAGE_EXT
        )  # fmt: skip
        rel = [p.relative_to(folder).parts for p in files]

        def build_folder(files: list[Path] = files, rel: list[tuple[str, ...]] = rel) -> dict[str, np.ndarray]:
            return _decode_images([(r[-3], CIFAR10_CLASSES.index(r[-2]), p.read_bytes) for p, r in zip(files, rel)])

        arrays, cache_path = _cached("cifar10-jpeg-folder", files, build_folder)
        return {**arrays, "_paths": [folder]}, cache_path
    for base in bases:
        if not base.is_dir():
            continue
        tars = sorted(p for pat in ("CIFAR-10-images*.tar.gz", "CIFAR-10-images*.tgz", "CIFAR-10-images*.tar")
                      for p in base.glob(pat))  # fmt: skip
        if not tars:
            continue
        tar_path = tars[0]

        def build_tar(tar_path: Path = tar_path) -> dict[str, np.ndarray]:
            blobs: dict[str, tuple[str, int, bytes]] = {}
            with tarfile.open(tar_path) as tar:
                for m in tar:
                    key = _jpeg_key(m.name.split("/")) if m.isfile() else None
                    f = tar.extractfile(m) if key else None
                    if key and f is not None:
                        blobs["/".join(m.name.split("/")[-3:])] = (*key, f.read())
            items = [(s, label, (lambda b=b: b)) for _, (s, label, b) in sorted(blobs.items())]
            if not items:
                raise UserError(f"cifar10: {tar_path} holds no {{train,test}}/<class>/*.jpg images")
            return _decode_images(items)

        arrays, cache_path = _cached("cifar10-jpeg-tar", [tar_path], build_tar)
        return {**arrays, "_paths": [tar_path]}, cache_path
    return None


def _load_cifar100(root: Path | None, opts: dict[str, Any]) -> Dataset:
    src = _pickle_source(root, "cifar-100-python", "cifar-100-python.tar.gz", ["train", "test"], ["cifar100"])
    if src is None:
        raise _missing("cifar100", root, _candidates(root, "cifar100/cifar-100-python", "cifar-100-python"))
    read, paths, _ = src
    mode = str(opts["label_mode"])
    key = f"{mode}_labels"
    tr = _cifar_arrays(_unpickle(read("train") or b""), key, "cifar-100-python/train")
    te = _cifar_arrays(_unpickle(read("test") or b""), key, "cifar-100-python/test")
    meta = read("meta")
    names = _names(_unpickle(meta)[f"{mode}_label_names"]) if meta else None
    info = {**_source_info("cifar100", paths), "format": "python pickles", "label_mode": mode}
    return _cifar_dataset("cifar100", tr, te, 100 if mode == "fine" else 20, names, info)
