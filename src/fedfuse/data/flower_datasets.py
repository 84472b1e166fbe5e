"""Data from the Flower ecosystem: local Hugging Face datasets in (Flower Datasets' partitioners are
:mod:`fedfuse.data.flower_partitions`).

* ``hf:PATH`` is a dataset: a local Hugging Face ``datasets`` directory (``save_to_disk`` of a ``DatasetDict`` or
  a ``Dataset``) or parquet files (one file, or a folder whose file names carry the split as on the Hub).
  Nothing is downloaded.  Options: the splits, the input (image) and label columns (auto-detected), an optional
  group column (``partition_id`` when present) for the ``natural`` partition, and how pixels are normalised.
* the way out, a fedfuse partition written for a Flower pipeline, is :mod:`fedfuse.data.export`.

``datasets`` (extra ``fedfuse[flower]``) is imported only when used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data.dataset import Dataset, DatasetInfo, DatasetNotFoundError, cache_dir
from fedfuse.errors import UserError
from fedfuse.extras import import_extra
from fedfuse.rng import numpy_rng

__all__ = [
    "HF_OPTIONS",
    "HF_PREFIX",
    "dataset_label",
    "hf_dataset_info",
    "is_hf_name",
    "load_hf",
]

HF_PREFIX = "hf:"
HOLDOUT_SEED = 0  # seed of the held-out test split when the dataset has none (like every loader's fixed SEED)
NORMALIZATIONS = ("auto", "standard", "none")
LABEL_COLUMNS = ("label", "labels", "fine_label", "target", "y", "class")
INPUT_COLUMNS = ("image", "img", "x", "pixel_values", "pixels", "features", "inputs")
GROUP_COLUMN = "partition_id"  # the column export_partitions writes and Flower's NaturalIdPartitioner reads

HF_OPTIONS: dict[str, object] = {
    "train_split": "train",
    "test_split": "test",
    "test_fraction": 0.2,
    "image_column": None,
    "label_column": None,
    "group_column": None,
    "normalization": "auto",
    "train_limit": None,
    "test_limit": None,
}

def _need(module: str) -> Any:
    """``module`` of the flower extra, or :class:`fedfuse.extras.MissingExtra` naming its install command."""
    return import_extra(module, "flower", "Hugging Face datasets and Flower Datasets' partitioners")


def is_hf_name(name: str) -> bool:
    """True for a dataset name ``hf:PATH``."""
    return str(name).strip().startswith(HF_PREFIX)


def dataset_label(name: str) -> str:
    """A dataset name usable in a file name: ``hf:/data/mnist-hf`` → ``hf-mnist-hf``; others unchanged."""
    if not is_hf_name(name):
        return name
    tail = Path(str(name).strip()[len(HF_PREFIX):].rstrip("/")).name or "data"
    return f"hf-{tail}"


# ------------------------------------------------------------------------------------------ hf:PATH datasets


def hf_dataset_info(name: str) -> DatasetInfo:
    """The registry entry of ``hf:PATH`` (built on demand: the path is part of the name)."""

    path = str(name).strip()[len(HF_PREFIX):]
    if not path:
        raise UserError("dataset 'hf:' needs a path: hf:/path/to/dir (save_to_disk or parquet files)")
    return DatasetInfo(
        name=str(name).strip(),
        description=f"local Hugging Face dataset at {path} (save_to_disk directory or parquet files)",
        task="classification",
        files=[path],
        source="datasets.Dataset(Dict).save_to_disk(PATH) or parquet files; relative paths also under --data-dir",
        options=dict(HF_OPTIONS),
        needs_data_dir=False,
        loader=lambda root, opts: load_hf(path, root, opts),
        check=check_hf_options,
    )


def check_hf_options(opts: dict[str, Any]) -> None:
    """Raise ValueError naming the option for a bad ``hf:`` option value."""
    f = opts.get("test_fraction")
    if isinstance(f, bool) or not isinstance(f, int | float) or not 0.0 < float(f) < 1.0:
        raise UserError(f"option test_fraction of an hf: dataset must be a number in (0, 1), got {f!r}")
    if opts.get("normalization") not in NORMALIZATIONS:
        raise UserError(f"option normalization of an hf: dataset must be one of {NORMALIZATIONS}, "
                        f"got {opts.get('normalization')!r}")
    for key in ("train_split", "test_split", "image_column", "label_column", "group_column"):
        v = opts.get(key)
        if v is not None and (not isinstance(v, str) or not v):
            raise UserError(f"option {key} of an hf: dataset must be a non-empty string, got {v!r}")
    if not opts.get("train_split"):
        raise UserError("option train_split of an hf: dataset must name a split, e.g. train")


def _resolve(path: str, root: Path | None) -> Path:
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or root is None:
        return p
    return root / p


def open_splits(path: Path) -> dict[str, Any]:
    """split name -> ``datasets.Dataset`` of a save_to_disk directory, a parquet file or a parquet folder."""
    hf = _need("datasets")
    if path.is_file() and path.suffix == ".parquet":
        return {"train": hf.Dataset.from_parquet(str(path))}
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            loaded = hf.load_from_disk(str(path))
            return dict(loaded) if isinstance(loaded, hf.DatasetDict) else {"train": loaded}
        if any(path.rglob("*.parquet")):
            loaded = hf.load_dataset("parquet", data_dir=str(path), cache_dir=str(cache_dir() / "hf"))
            return dict(loaded)
    where = "does not exist" if not path.exists() else "holds no save_to_disk dataset and no .parquet files"
    raise DatasetNotFoundError(
        f"dataset 'hf:{path}' not found: {path} {where}.\n"
        "Expected: a directory written by datasets.Dataset(Dict).save_to_disk (dataset_dict.json or state.json),\n"
        "or parquet files (DIR/train-*.parquet, DIR/test-*.parquet, or DIR/data/...).\n"
        "A relative path is looked up in the working directory, then under --data-dir."
    )


def pick_column(columns: Sequence[str], wanted: str | None, preferred: Sequence[str], what: str, option: str,
          fallback: Callable[[], str | None]) -> str:
    if wanted is not None:
        if wanted not in columns:
            raise UserError(f"{what} column {wanted!r} (option {option}) not found; columns: {list(columns)}")
        return wanted
    found = next((c for c in preferred if c in columns), None) or fallback()
    if found is None:
        raise UserError(f"no {what} column found among {list(columns)}; set option {option}")
    return found


def column_values(ds: Any, col: str) -> np.ndarray:
    """One column as an (N, ...) numpy array (images decoded)."""
    arr = ds.select_columns([col]).with_format("numpy")[:][col]
    if isinstance(arr, np.ndarray) and arr.dtype != object:
        return arr
    try:
        return np.stack([np.asarray(v) for v in arr])
    except ValueError as e:
        raise UserError(f"column {col!r}: samples have different shapes ({e}); resize them to one shape") from None


def input_array(raw: np.ndarray, is_image: bool) -> np.ndarray:
    """Per-sample layout fedfuse models expect: images (C, H, W), feature vectors (F,)."""
    if is_image:  # PIL: (N, H, W) grey or (N, H, W, C) colour
        return raw[:, None] if raw.ndim == 3 else np.moveaxis(raw, -1, 1)
    if raw.ndim == 3:  # (N, H, W) arrays: one channel
        return raw[:, None]
    return raw  # (N, F) features or (N, C, H, W) images already channels-first


def normalise_inputs(train: np.ndarray, test: np.ndarray, mode: str,
               is_image: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """``auto``: PIL/uint8 pixels standardised per channel with train statistics, floats kept, other integers kept
    as int64 (token ids); ``standard``: always standardised; ``none``: values as stored, as float32."""
    integer = np.issubdtype(train.dtype, np.integer) or train.dtype == bool
    if not (mode == "standard" or (mode == "auto" and (is_image or train.dtype == np.uint8))):
        dtype = np.int64 if integer and mode == "auto" else np.float32
        return (torch.from_numpy(np.ascontiguousarray(train, dtype)),
                torch.from_numpy(np.ascontiguousarray(test, dtype)), {"kept": np.dtype(dtype).name})
    axes = (0, 2, 3) if train.ndim == 4 else tuple(range(train.ndim))  # per channel for images, else one scalar
    mean = train.mean(axis=axes, dtype=np.float64, keepdims=True)
    std = train.std(axis=axes, dtype=np.float64, keepdims=True)
    std = np.where(std > 0, std, 1.0)

    def f(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((a - mean) / std).astype(np.float32))

    return f(train), f(test), {"mean": mean.ravel().tolist(), "std": std.ravel().tolist(), "from": "train split"}


def _labels(train: np.ndarray, test: np.ndarray, feature: Any) -> tuple[np.ndarray, np.ndarray, int, list[str]]:
    names = getattr(feature, "names", None)
    if names:
        return train.astype(np.int64), test.astype(np.int64), len(names), [str(n) for n in names]
    if np.issubdtype(train.dtype, np.integer) and (not len(test) or np.issubdtype(test.dtype, np.integer)):
        k = int(max(train.max(initial=-1), test.max(initial=-1))) + 1
        return train.astype(np.int64), test.astype(np.int64), k, [str(i) for i in range(k)]
    values = sorted({str(v) for v in np.concatenate([train, test]).tolist()})  # string labels: sorted ids
    ids = {v: i for i, v in enumerate(values)}
    enc = [np.array([ids[str(v)] for v in a.tolist()], dtype=np.int64) for a in (train, test)]
    return enc[0], enc[1], len(values), values


def _groups(ds: Any, col: str | None) -> tuple[np.ndarray | None, list[str] | None]:
    if col is None or col not in ds.column_names:
        return None, None
    values = column_values(ds, col)
    uniq, inverse = np.unique(values, return_inverse=True)
    return inverse.astype(np.int64), [str(u) for u in uniq.tolist()]


def load_hf(path: str, root: Path | None, opts: dict[str, Any]) -> Dataset:
    """Load ``hf:PATH`` (see the module docstring); ``opts`` as in :data:`HF_OPTIONS`."""
    check_hf_options(opts)
    where = _resolve(path, root)
    splits = open_splits(where)
    name = f"{HF_PREFIX}{path}"
    tr_name, te_name = str(opts["train_split"]), str(opts["test_split"])
    if tr_name not in splits:
        raise UserError(f"dataset {name!r} has no split {tr_name!r} (option train_split); splits: {list(splits)}")
    train = splits[tr_name]
    columns = list(train.column_names)
    features = train.features
    label_col = pick_column(columns, opts["label_column"], LABEL_COLUMNS, "label", "label_column",
                      lambda: next((c for c in columns if type(features[c]).__name__ == "ClassLabel"), None))
    image_col = pick_column(
        columns, opts["image_column"], INPUT_COLUMNS, "input", "image_column",
        lambda: next((c for c in columns if type(features[c]).__name__ in ("Image", "Array2D", "Array3D")), None),
    )
    is_image = type(features[image_col]).__name__ == "Image"
    group_col = opts["group_column"] or (GROUP_COLUMN if GROUP_COLUMN in columns else None)
    if opts["group_column"] is not None and group_col not in columns:
        raise UserError(f"group column {group_col!r} (option group_column) not found; columns: {columns}")

    x_tr, y_tr = input_array(column_values(train, image_col), is_image), column_values(train, label_col)
    groups, group_names = _groups(train, group_col)
    test_groups = None
    if te_name in splits:
        test = splits[te_name]
        x_te, y_te = input_array(column_values(test, image_col), is_image), column_values(test, label_col)
        if group_names is not None and group_col in test.column_names:  # onto the train split's group ids
            index = {g: i for i, g in enumerate(group_names)}
            test_groups = np.array([index.get(str(v), -1) for v in column_values(test, group_col).tolist()], np.int64)
        test_info = f"split {te_name!r}"
    else:  # hold out a seeded fraction of the training split
        n = len(y_tr)
        n_test = min(max(round(n * float(opts["test_fraction"])), 1), n - 1)
        perm = numpy_rng(HOLDOUT_SEED, "hf-holdout").permutation(n)
        te, tr = np.sort(perm[:n_test]), np.sort(perm[n_test:])
        x_te, y_te, x_tr, y_tr = x_tr[te], y_tr[te], x_tr[tr], y_tr[tr]
        groups = None if groups is None else groups[tr]
        test_info = f"held out {n_test} of split {tr_name!r} (seed {HOLDOUT_SEED}; no split {te_name!r})"
    train_x, test_x, norm = normalise_inputs(x_tr, x_te, str(opts["normalization"]), is_image)
    ytr, yte, k, names = _labels(y_tr, y_te, features[label_col])
    return Dataset(
        name=name,
        task="classification",
        train_x=train_x,
        train_y=torch.from_numpy(ytr),
        test_x=test_x,
        test_y=torch.from_numpy(yte),
        num_classes=k,
        input_shape=tuple(int(s) for s in train_x.shape[1:]),
        class_names=names,
        train_groups=groups,
        test_groups=test_groups if test_groups is not None and (test_groups >= 0).all() else None,
        group_names=group_names,
        info={
            "source_files": [str(where)],
            "checksums": {},
            "splits": {s: len(d) for s, d in splits.items()},
            "columns": {"input": image_col, "label": label_col, "group": group_col},
            "test": test_info,
            "normalization": norm,
        },
    )
