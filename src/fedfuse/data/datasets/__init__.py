"""Dataset loaders: canonical files in a data directory -> :class:`~fedfuse.data.dataset.Dataset`.

One registry, one module per dataset family: :mod:`.registry` (``DATASETS``: what each dataset is, its files,
options and where to get it; canonical checksums), :mod:`.common` (data/cache directories, missing-file errors,
checksums, cache, classification helpers), :mod:`.images` (digits, MNIST, Fashion-MNIST), :mod:`.cifar`
(CIFAR-10/100), :mod:`.leaf` (FEMNIST, Shakespeare) and :mod:`.text` (PTB, WikiText-2, Tiny Shakespeare).  This
package module holds the public API (``load_dataset``, ``dataset_options``, ``check_dataset_options``, ...) and
``_LOADERS`` (name -> loader).  Adding a dataset: a ``DatasetInfo`` in ``registry.DATASETS`` and its loader in
``_LOADERS``; every name importable from ``fedfuse.data.datasets`` before the split still is.

Each loader reads a dataset in the form its authors distribute it (IDX, CIFAR pickles, LEAF JSON, plain text)
from ``data_dir`` (argument, else ``$FEDFUSE_DATA``); nothing is ever downloaded.  Missing files raise
:class:`DatasetNotFoundError` saying which files to put where and where to get them.

Conventions (all deterministic, no option needed):

* ``digits``: scikit-learn's bundled 8×8 digits, pixels /16 then standardised with the train mean/std
  (one scalar); 80/20 stratified split ``train_test_split(..., stratify=y, random_state=0)``, indices sorted.
* image datasets are normalised per channel with the usual constants; FEMNIST (LEAF values in [0, 1], 1.0 = white
  background) is scaled as the FedMR/FedMut authors' loader does, ``(0.5 − x) / 0.5`` (ink +1, background −1);
  the option ``normalize="none"`` keeps LEAF's values.
* ``train_limit`` / ``test_limit`` (classification): a stratified subset (largest-remainder quota per class,
  seeded choice within a class, original order kept).
* ``rotate_domains=k`` (image datasets): domains are dealt round robin along a seeded permutation of each
  split (sample ``perm[j]`` gets domain ``d = j % k``) and each image is rotated counter-clockwise by
  ``d * 360 / k`` degrees (``torch.rot90`` for multiples of 90°, else bilinear with border padding).
* ``shakespeare``: characters map to LEAF's 80-letter ``ALL_LETTERS`` plus one ``<unk>`` id (81 classes); the
  sample count is ``len(y)`` (LEAF's ``num_samples`` over-counts); groups = roles, domains = plays.
* word-level LMs (``ptb``, ``wikitext2``, ``tiny-shakespeare`` with ``level="word"``): whitespace tokens plus
  ``<eos>`` per line; vocabulary sorted by frequency then word (from the train split; ``<unk>`` appended if an
  unseen word occurs elsewhere); x/y are non-overlapping ``seq_len`` windows with y shifted by one token.
* ``tiny-shakespeare``: contiguous 90/5/5 train/val/test split of the stream; vocabulary from the whole text
  (sorted characters, or words by frequency).
* slow parses (CIFAR JPEGs, FEMNIST JSON) are cached as ``.npz`` in ``$FEDFUSE_CACHE`` (default
  ``~/.cache/fedfuse``), keyed by the source files' path, size and mtime; written to a temp file then renamed.
* file sizes are always compared with the canonical ones where known; SHA-256 is checked once per process
  per file (files < 100 MB, skipped with ``FEDFUSE_SKIP_CHECKSUMS=1``); a mismatch only warns.
"""

from __future__ import annotations

import os
import pickle
import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedfuse.data.dataset import Dataset, DatasetInfo, DatasetNotFoundError, cache_dir
from fedfuse.data.datasets.cifar import CIFAR10_CLASSES, _load_cifar10, _load_cifar100
from fedfuse.data.datasets.common import (
    CACHE_VERSION,
    EOS,
    MAX_HASH_BYTES,
    SEED,
    UNK,
    _apply_limits,
    _rotate_domains,
    resolve_data_dir,
    rotate_images,
)
from fedfuse.data.datasets.images import _load_digits, _load_fashion, _load_mnist, read_idx
from fedfuse.data.datasets.leaf import (
    FEMNIST_NORMALIZATION_INFO,
    FEMNIST_NORMALIZATIONS,
    LEAF_LETTERS,
    _load_femnist,
    _load_shakespeare,
    femnist_normalize,
)
from fedfuse.data.datasets.registry import _ALIASES, DATASETS
from fedfuse.data.datasets.registry import _MNIST_FILES as _MNIST_FILES
from fedfuse.data.datasets.text import _load_ptb, _load_tiny_shakespeare, _load_wikitext2
from fedfuse.errors import UserError

__all__ = [
    "CACHE_VERSION",
    "CIFAR10_CLASSES",
    "DATASETS",
    "EOS",
    "FEMNIST_NORMALIZATIONS",
    "FEMNIST_NORMALIZATION_INFO",
    "LEAF_LETTERS",
    "MAX_HASH_BYTES",
    "SEED",
    "UNK",
    "DatasetInfo",
    "DatasetNotFoundError",
    "cache_dir",
    "check_dataset_options",
    "dataset_options",
    "femnist_normalize",
    "load_dataset",
    "read_idx",
    "resolve_data_dir",
    "rotate_images",
]


def _canonical_name(name: str) -> str:
    if str(name).strip().startswith("hf:"):  # a local Hugging Face dataset (fedfuse.data.flower_datasets)
        return str(name).strip()
    key = str(name).strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in DATASETS:
        raise UserError(f"unknown dataset {name!r}; valid choices: {', '.join(DATASETS)}")
    return key


#: type and one help line of every dataset option (``fedfuse show DATASET``), by option name
OPTION_HELP: dict[str, tuple[str, str]] = {
    "train_limit": ("int | none", "use a stratified subset of this many training samples; none = all"),
    "test_limit": ("int | none", "use a stratified subset of this many test samples; none = all"),
    "rotate_domains": ("int", "> 0: each client group sees the images rotated by its own angle (partition domain)"),
    "label_mode": ("str", "fine (100 classes) or coarse (20 superclasses)"),
    "normalize": ("str", "authors (the LEAF authors' pixel normalisation) or none (LEAF's stored values)"),
    "seq_len": ("int", "tokens per training window"),
    "level": ("str", "char or word tokens"),
}


def dataset_options(name: str) -> dict[str, object]:
    """The options ``load_dataset(name, ...)`` accepts, with their defaults."""
    return dict(_info(_canonical_name(name)).options)


def _info(key: str) -> DatasetInfo:
    """The registry entry of a canonical name; ``hf:PATH`` entries are built on demand."""
    if key.startswith("hf:"):
        from fedfuse.data.flower_datasets import hf_dataset_info

        return hf_dataset_info(key)
    return DATASETS[key]


def _file_being_read(error: BaseException) -> str | None:
    """The file a loader was reading when ``error`` was raised (a truncated archive raises ``EOFError`` without
    naming it): the innermost frame's open file object or path variable that names an existing file."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        for name, value in tb.tb_frame.f_locals.items():
            cand = value
            if hasattr(value, "read"):  # an open file object: the path it was opened from
                try:
                    cand = value.name
                except AttributeError:
                    cand = None
            if name.startswith("_") or not isinstance(cand, str | os.PathLike):
                continue
            try:
                if os.path.isfile(cand):
                    found = os.fspath(cand)
            except (OSError, TypeError, ValueError):
                continue
        tb = tb.tb_next
    return found


def load_dataset(name: str, data_dir: str | os.PathLike[str] | None = None, **options: Any) -> Dataset:
    """Load dataset ``name`` from ``data_dir`` (or ``$FEDFUSE_DATA``); see ``dataset_options(name)``."""
    key = _canonical_name(name)
    opts = _check_options(key, options)
    root = resolve_data_dir(data_dir)
    try:
        ds = (_info(key).loader or _LOADERS[key])(root, opts)
    except DatasetNotFoundError:
        raise
    except (OSError, EOFError, zlib.error, tarfile.TarError, pickle.UnpicklingError, UnicodeDecodeError,
            KeyError, IndexError, TypeError) as e:  # unreadable or corrupt files the readers did not name
        culprit = _file_being_read(e)
        where = f" under {root}" if root is not None else ""
        what = f"file {culprit} is" if culprit else f"files{where} are"
        fix = "replace it with the canonical file" if culprit else "replace them with the canonical files"
        raise UserError(f"dataset {key!r}: its {what} unreadable or corrupt ({type(e).__name__}: {e}); "
                        f"{fix} (see the dataset README)") from e
    _check_labels(ds)
    if ds.task == "classification":
        ds = _apply_limits(ds, opts.get("train_limit"), opts.get("test_limit"))
        k = int(opts.get("rotate_domains") or 0)
        if k > 0:
            _rotate_domains(ds, k)
        ds.info["counts"] = {"train": len(ds.train_y), "test": len(ds.test_y)}
        ds.info["train_class_counts"] = np.bincount(ds.train_labels, minlength=ds.num_classes).tolist()
        ds.info["test_class_counts"] = np.bincount(ds.test_labels, minlength=ds.num_classes).tolist()
    else:
        ds.info["counts"] = {
            "train": len(ds.train_y),
            "val": 0 if ds.val_y is None else len(ds.val_y),
            "test": len(ds.test_y),
        }
    ds.info["options"] = opts
    return ds


def _check_labels(ds: Dataset) -> None:
    """Every label/token id must lie in ``0 .. num_classes - 1``; the error names the split and the files."""
    files = ", ".join(ds.info.get("source_files", [])[:4]) or "its files"
    for split, y in (("train", ds.train_y), ("test", ds.test_y), ("validation", ds.val_y)):
        if y is None or not len(y):
            continue
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= ds.num_classes:
            bad = hi if hi >= ds.num_classes else lo
            what = "token id" if ds.task == "lm" else "label"
            raise UserError(f"dataset {ds.name!r}: {split} {what} {bad} is outside 0..{ds.num_classes - 1} "
                            f"({files}); the files are corrupt or not the canonical ones")


def check_dataset_options(name: str, options: dict[str, Any]) -> None:
    """Raise ValueError naming the option and what is allowed, for any bad option of dataset ``name``."""
    _check_options(_canonical_name(name), options)


def _check_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    info = _info(name)
    defaults = info.options
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        valid = ", ".join(sorted(defaults)) or "none"
        raise UserError(f"unknown option(s) {', '.join(unknown)} for dataset {name!r}; valid options: {valid}")
    opts = dict(defaults)
    opts.update({k: v for k, v in options.items() if v is not None or defaults[k] is None})

    def _int(key: str, lo: int, nullable: bool) -> None:
        v = opts.get(key)
        if v is None and nullable:
            return
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
            raise UserError(f"option {key} of dataset {name!r} must be an integer >= {lo}, got {v!r}")
        opts[key] = int(v)

    for key in ("train_limit", "test_limit"):
        if key in opts:
            _int(key, 1, nullable=True)
    if "rotate_domains" in opts:
        _int("rotate_domains", 0, nullable=False)
    if "seq_len" in opts:
        _int("seq_len", 1, nullable=False)
    for key, choices in (("label_mode", ("fine", "coarse")), ("level", ("char", "word")),
                         ("normalize", FEMNIST_NORMALIZATIONS)):
        if key in opts and opts[key] not in choices:
            raise UserError(f"option {key} of dataset {name!r} must be one of {choices}, got {opts[key]!r}")
    if info.check is not None:
        info.check(opts)
    return opts


_LOADERS: dict[str, Callable[[Path | None, dict[str, Any]], Dataset]] = {
    "digits": _load_digits,
    "mnist": _load_mnist,
    "fashion-mnist": _load_fashion,
    "cifar10": _load_cifar10,
    "cifar100": _load_cifar100,
    "femnist": _load_femnist,
    "shakespeare": _load_shakespeare,
    "ptb": _load_ptb,
    "wikitext2": _load_wikitext2,
    "tiny-shakespeare": _load_tiny_shakespeare,
}
