"""Dataset loaders: real files from ../shared/data when present, small synthetic files otherwise."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import struct
import tarfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfuse.data import datasets as D
from fedfuse.data.dataset import Dataset, DatasetNotFoundError
from fedfuse.data.datasets import DATASETS, dataset_options, load_dataset, resolve_data_dir
from support import SHARED_DATA

SHARED = SHARED_DATA
USER_CACHE = os.environ.get("FEDFUSE_CACHE")  # before the autouse fixture points it at a temp dir


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No data dir from the environment, checksums on, and a private cache per test."""
    monkeypatch.delenv("FEDFUSE_DATA", raising=False)
    monkeypatch.delenv("FEDFUSE_SKIP_CHECKSUMS", raising=False)
    monkeypatch.setenv("FEDFUSE_CACHE", str(tmp_path / "cache"))


def shared(sub: str) -> Path:
    """The shared data directory, skipping the test when ``sub`` is not staged there."""
    if not (SHARED / sub).is_dir():
        pytest.skip(f"{SHARED / sub} not available")
    return SHARED


def _load_with_shared_cache(name: str, **options: object) -> Dataset:
    """Load a slow dataset with the user's cache ($FEDFUSE_CACHE or ~/.cache/fedfuse), shared across runs."""
    with pytest.MonkeyPatch.context() as mp:
        if USER_CACHE:
            mp.setenv("FEDFUSE_CACHE", USER_CACHE)
        else:
            mp.delenv("FEDFUSE_CACHE", raising=False)
        return load_dataset(name, SHARED, **options)


# ------------------------------------------------------------------------------------------ registry / API


def test_registry_and_options() -> None:
    images = {"digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "femnist"}
    assert set(DATASETS) == images | {"shakespeare", "ptb", "wikitext2", "tiny-shakespeare"}
    for name, info in DATASETS.items():
        assert info.name == name
        assert info.task in ("classification", "lm")
        assert info.description and "\n" not in info.description
        assert info.source
        assert info.files or not info.needs_data_dir
        assert dataset_options(name) == info.options
    assert dataset_options("cifar100") == {
        "train_limit": None, "test_limit": None, "rotate_domains": 0, "label_mode": "fine",
    }  # fmt: skip
    assert dataset_options("ptb") == {"seq_len": 35}
    assert dataset_options("tiny-shakespeare") == {"seq_len": 64, "level": "char"}
    opts = dataset_options("mnist")
    opts["train_limit"] = 5  # a copy: the registry is unchanged
    assert dataset_options("mnist")["train_limit"] is None
    assert dataset_options("Fashion_MNIST") == dataset_options("fashion-mnist")


def test_unknown_dataset_and_options() -> None:
    with pytest.raises(ValueError, match=r"unknown dataset 'nope'.*digits.*mnist.*tiny-shakespeare"):
        load_dataset("nope")
    with pytest.raises(ValueError, match="unknown dataset"):
        dataset_options("imagenet")
    with pytest.raises(ValueError, match=r"augment.*valid options: rotate_domains, test_limit, train_limit"):
        load_dataset("digits", augment=True)
    with pytest.raises(ValueError, match="valid options: seq_len"):
        load_dataset("ptb", rotate_domains=2)
    with pytest.raises(ValueError, match="train_limit"):
        load_dataset("digits", train_limit=0)
    with pytest.raises(ValueError, match="rotate_domains"):
        load_dataset("digits", rotate_domains=True)
    with pytest.raises(ValueError, match="label_mode"):
        load_dataset("cifar100", label_mode="medium")
    with pytest.raises(ValueError, match="level"):
        load_dataset("tiny-shakespeare", level="byte")


def test_resolve_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_data_dir(None) is None
    assert resolve_data_dir(tmp_path) == tmp_path
    assert resolve_data_dir(str(tmp_path)) == tmp_path
    monkeypatch.setenv("FEDFUSE_DATA", str(tmp_path / "env"))
    assert resolve_data_dir(None) == tmp_path / "env"
    assert resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"


@pytest.mark.parametrize("name", [n for n in DATASETS if n != "digits"])
def test_missing_files_error_without_data_dir(name: str) -> None:
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset(name)
    msg = str(err.value)
    assert repr(name) in msg
    assert "--data-dir DIR" in msg and "FEDFUSE_DATA" in msg
    for f in DATASETS[name].files:
        assert f"DIR/{f}" in msg
    assert DATASETS[name].source in msg


def test_missing_files_error_names_directory(tmp_path: Path) -> None:
    (tmp_path / "mnist").mkdir()
    (tmp_path / "mnist" / "train-images-idx3-ubyte.gz").write_bytes(b"")  # one of four is not enough
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("mnist", tmp_path)
    msg = str(err.value)
    assert f"searched {tmp_path / 'mnist'}" in msg
    assert f"{tmp_path}/mnist/t10k-labels-idx1-ubyte.gz" in msg
    assert "MNIST" in msg
    assert isinstance(err.value, FileNotFoundError)
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        load_dataset("ptb", tmp_path / "absent")


# ------------------------------------------------------------------------------------------------ digits


def test_digits_needs_no_data_dir() -> None:
    ds = load_dataset("digits")
    assert ds.name == "digits" and ds.task == "classification"
    assert ds.train_x.shape == (1437, 1, 8, 8) and ds.test_x.shape == (360, 1, 8, 8)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    assert ds.num_classes == 10 and ds.input_shape == (1, 8, 8)
    assert abs(float(ds.train_x.mean())) < 1e-4 and abs(float(ds.train_x.std()) - 1) < 1e-3
    # stratified: every class has ~80 % of its samples in train
    total = np.bincount(ds.train_labels, minlength=10) + np.bincount(ds.test_labels, minlength=10)
    assert np.all(np.abs(np.bincount(ds.train_labels) - 0.8 * total) <= 1)
    again = load_dataset("digits", "/nonexistent/dir/is/ignored")
    assert torch.equal(again.train_x, ds.train_x) and torch.equal(again.test_y, ds.test_y)
    assert ds.info["counts"] == {"train": 1437, "test": 360}


def test_train_test_limit_is_stratified_and_deterministic() -> None:
    full = load_dataset("digits")
    ds = load_dataset("digits", train_limit=100, test_limit=50)
    assert len(ds.train_y) == 100 and len(ds.test_y) == 50
    expected = np.bincount(full.train_labels) * 100 / len(full.train_y)
    assert np.all(np.abs(np.bincount(ds.train_labels, minlength=10) - expected) < 1)
    again = load_dataset("digits", train_limit=100, test_limit=50)
    assert torch.equal(ds.train_x, again.train_x) and torch.equal(ds.test_y, again.test_y)
    assert ds.info["train_subset"] == "stratified 100 of 1437"
    big = load_dataset("digits", train_limit=10**6)  # a limit above the size keeps everything
    assert len(big.train_y) == len(full.train_y)


# ------------------------------------------------------------------------------------------ rotate_domains


def test_rotate_domains_quarter_turns() -> None:
    base = load_dataset("digits")
    ds = load_dataset("digits", rotate_domains=4)
    assert ds.domain_names == ["rot0", "rot90", "rot180", "rot270"]
    assert ds.train_domains is not None and ds.test_domains is not None
    assert ds.train_domains.shape == (1437,) and ds.test_domains.shape == (360,)
    assert np.bincount(ds.train_domains).tolist() == [360, 359, 359, 359]
    for d in range(4):
        idx = torch.from_numpy(np.flatnonzero(ds.train_domains == d))
        assert torch.equal(ds.train_x[idx], torch.rot90(base.train_x[idx], d, dims=(-2, -1)))
    assert torch.equal(ds.train_y, base.train_y)
    again = load_dataset("digits", rotate_domains=4)
    assert np.array_equal(again.train_domains, ds.train_domains)  # type: ignore[arg-type]


def test_rotate_domains_arbitrary_angles() -> None:
    ds = load_dataset("digits", rotate_domains=3, train_limit=200)
    assert ds.domain_names == ["rot0", "rot120", "rot240"]
    assert ds.train_x.shape == (200, 1, 8, 8) and torch.isfinite(ds.train_x).all()
    assert np.bincount(ds.train_domains).tolist() == [67, 67, 66]  # type: ignore[arg-type]
    # the affine path agrees with rot90 at 90 degrees (up to interpolation round-off)
    x = torch.randn(5, 3, 6, 6)
    assert torch.allclose(D.rotate_images(x, 90.0 + 1e-9), torch.rot90(x, 1, dims=(-2, -1)), atol=1e-4)
    with pytest.raises(ValueError, match="valid options"):
        load_dataset("shakespeare", SHARED, rotate_domains=2)


# -------------------------------------------------------------------------------------- IDX (synthetic)


def _write_idx(path: Path, arr: np.ndarray, compress: bool) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)


def _write_mnist_like(folder: Path, compress: bool, n_train: int = 30, n_test: int = 10) -> dict:
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(n_train) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": np.arange(n_test)[::-1] % 10,
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, arr in arrays.items():
        _write_idx(folder / (name + (".gz" if compress else "")), arr, compress)
    return arrays


def test_idx_uncompressed_directly_in_data_dir(tmp_path: Path) -> None:
    arrays = _write_mnist_like(tmp_path, compress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load_dataset("mnist", tmp_path)
    messages = sorted(str(w.message) for w in caught)  # canonical names but not sizes: one warning each
    assert len(messages) == 4 and "t10k-images-idx3-ubyte has 7856 bytes" in messages[0]
    assert ds.train_x.shape == (30, 1, 28, 28) and ds.test_x.shape == (10, 1, 28, 28)
    expected = (arrays["train-images-idx3-ubyte"] / 255.0 - 0.1307) / 0.3081
    assert np.allclose(ds.train_x[:, 0].numpy(), expected, atol=1e-5)
    assert ds.train_y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    assert ds.test_y.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()
    assert set(ds.info["checksums"].values()) == {"mismatch"}


def test_fashion_mnist_gz_and_normalisation(tmp_path: Path) -> None:
    arrays = _write_mnist_like(tmp_path / "fashion-mnist", compress=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no canonical checksums for Fashion-MNIST: nothing to warn about
        ds = load_dataset("fashion-mnist", tmp_path)
    expected = (arrays["t10k-images-idx3-ubyte"] / 255.0 - 0.2860) / 0.3530
    assert np.allclose(ds.test_x[:, 0].numpy(), expected, atol=1e-5)
    assert ds.class_names is not None and ds.class_names[0] == "T-shirt/top"
    assert ds.info["checksums"] == dict.fromkeys(
        [f"{n}.gz" for n in D._MNIST_FILES], "unknown"
    )  # fmt: skip


def test_idx_header_is_validated(tmp_path: Path) -> None:
    good = tmp_path / "good-idx1-ubyte"
    _write_idx(good, np.arange(7), compress=False)
    assert D.read_idx(good).tolist() == list(range(7))
    truncated = tmp_path / "truncated"
    truncated.write_bytes(good.read_bytes()[:-1])
    with pytest.raises(ValueError, match=r"header says \(7,\)"):
        D.read_idx(truncated)
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x12\x34\x08\x01" + good.read_bytes()[4:])
    with pytest.raises(ValueError, match="bad magic"):
        D.read_idx(bad)


# ------------------------------------------------------------------------------------- CIFAR (synthetic)


def _cifar_batch(n: int, labels_key: str, labels: list[int], extra: dict | None = None) -> dict:
    rng = np.random.default_rng(n)
    batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), labels_key.encode(): labels}
    batch.update(extra or {})
    return batch


def _write_cifar10_pickles(folder: Path) -> list[dict]:
    folder.mkdir(parents=True)
    batches = []
    for i in range(1, 6):
        batch = _cifar_batch(4, "labels", [(i + j) % 10 for j in range(4)])
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch, protocol=2))
        batches.append(batch)
    test = {"data": _cifar_batch(3, "x", [])[b"data"], "labels": [9, 0, 1]}  # str keys also accepted
    (folder / "test_batch").write_bytes(pickle.dumps(test, protocol=2))
    meta = {b"label_names": [c.encode() for c in D.CIFAR10_CLASSES], b"num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return [*batches, test]


def test_cifar10_pickles(tmp_path: Path) -> None:
    batches = _write_cifar10_pickles(tmp_path / "cifar10" / "cifar-10-batches-py")
    ds = load_dataset("cifar10", tmp_path)
    assert ds.train_x.shape == (20, 3, 32, 32) and ds.test_x.shape == (3, 3, 32, 32)
    assert ds.train_y.tolist() == [label for b in batches[:5] for label in b[b"labels"]]
    assert ds.test_y.tolist() == [9, 0, 1]
    assert ds.class_names == D.CIFAR10_CLASSES and ds.num_classes == 10
    raw = batches[0][b"data"][1].reshape(3, 32, 32) / 255.0
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2470, 0.2435, 0.2616])
    assert np.allclose(ds.train_x[1].numpy(), (raw - mean[:, None, None]) / std[:, None, None], atol=1e-5)
    assert ds.info["format"] == "python pickles"


def test_cifar10_python_tarball(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _write_cifar10_pickles(src / "cifar-10-batches-py")
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    direct = load_dataset("cifar10", src)
    from_tar = load_dataset("cifar10", tmp_path)
    assert torch.equal(direct.train_x, from_tar.train_x) and torch.equal(direct.test_y, from_tar.test_y)


def test_cifar_pickles_refuse_arbitrary_objects(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / split).write_bytes(pickle.dumps({"data": Path("x"), "fine_labels": []}))
    with pytest.raises(ValueError, match="refusing to unpickle pathlib"):  # names the dataset and folder
        load_dataset("cifar100", tmp_path)


@pytest.mark.parametrize("mode", ["fine", "coarse"])
def test_cifar100_fine_and_coarse(tmp_path: Path, mode: str) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    fine, coarse = [99, 0, 42, 7, 13], [19, 0, 4, 3, 2]
    for split, n in (("train", 5), ("test", 2)):
        extra = {b"coarse_labels": coarse[:n], b"filenames": [b"f"] * n}
        batch = _cifar_batch(n, "fine_labels", fine[:n], extra)
        (folder / split).write_bytes(pickle.dumps(batch, protocol=2))
    meta = {
        b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
        b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)],
    }
    (folder / "meta").write_bytes(pickle.dumps(meta, protocol=2))
    ds = load_dataset("cifar100", tmp_path, label_mode=mode, rotate_domains=2)
    assert ds.train_x.shape == (5, 3, 32, 32) and ds.test_x.shape == (2, 3, 32, 32)
    assert ds.num_classes == (100 if mode == "fine" else 20)
    assert ds.train_y.tolist() == (fine if mode == "fine" else coarse)
    assert ds.class_names is not None and len(ds.class_names) == ds.num_classes
    assert ds.class_names[0] == f"{mode}0"
    assert ds.domain_names == ["rot0", "rot180"]


# ------------------------------------------------------------------------------------ CIFAR-10 JPEG layout

_COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255)]


def _jpeg(colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _jpeg_tree(per_class: dict[str, int]) -> dict[str, bytes]:
    """Relative path -> JPEG bytes; colour encodes (class index, image index)."""
    files = {}
    for split, n in per_class.items():
        for c, cls in enumerate(D.CIFAR10_CLASSES):
            for i in range(n):
                files[f"{split}/{cls}/{i:04d}.jpg"] = _jpeg(_COLOURS[(c + i) % len(_COLOURS)])
    return files


def _check_jpeg_dataset(ds: Dataset, n_train: int, n_test: int) -> None:
    assert ds.train_x.shape == (10 * n_train, 3, 32, 32) and ds.test_x.shape == (10 * n_test, 3, 32, 32)
    assert ds.train_y.tolist() == [c for c in range(10) for _ in range(n_train)]  # sorted paths
    assert ds.class_names == D.CIFAR10_CLASSES
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    pixels = (ds.train_x * std + mean) * 255
    for k in range(len(ds.train_y)):
        c, i = divmod(k, n_train)
        expected = torch.tensor(_COLOURS[(c + i) % len(_COLOURS)], dtype=torch.float32)
        assert torch.allclose(pixels[k].mean(dim=(1, 2)), expected, atol=4), k


def test_cifar10_jpeg_folder_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "data" / "cifar10-jpeg"
    for rel, blob in _jpeg_tree({"train": 3, "test": 1}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(blob)
    ds = load_dataset("cifar10", tmp_path / "data")
    _check_jpeg_dataset(ds, 3, 1)
    cache = tmp_path / "cache"
    assert [p.suffix for p in cache.iterdir()] == [".npz"]  # atomic write: no temp file left behind
    monkeypatch.setattr(D.cifar, "_decode_images", lambda *a: pytest.fail("cache not used"))
    again = load_dataset("cifar10", tmp_path / "data")
    assert torch.equal(again.train_x, ds.train_x) and again.info["cache"] == ds.info["cache"]


def test_cifar10_jpeg_tarball_with_prefix(tmp_path: Path) -> None:
    folder = tmp_path / "cifar10-jpeg"
    folder.mkdir()
    with tarfile.open(folder / "CIFAR-10-images-test.tar.gz", "w:gz") as tar:
        members = sorted(_jpeg_tree({"test": 1, "train": 2}).items(), reverse=True)  # not in sorted order
        for rel, blob in members:
            info = tarfile.TarInfo(f"CIFAR-10-images-master/{rel}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
        readme = tarfile.TarInfo("CIFAR-10-images-master/README.md")
        tar.addfile(readme, io.BytesIO(b""))
    ds = load_dataset("cifar10", tmp_path, train_limit=10)
    assert ds.info["checksums"] == {"CIFAR-10-images-test.tar.gz": "unknown"}
    assert sorted(ds.train_y.tolist()) == list(range(10))  # stratified: one per class
    _check_jpeg_dataset(load_dataset("cifar10", tmp_path), 2, 1)


# ------------------------------------------------------------------------------------------ LEAF (synthetic)


def _leaf(path: Path, users: dict[str, tuple[list, list]], num_samples: list[int] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "users": list(users),
        "num_samples": num_samples or [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    path.write_text(json.dumps(blob))


def test_femnist_leaf_groups_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    img = [[0.0] * 783 + [1.0]]
    data = tmp_path / "femnist" / "data"
    _leaf(data / "train" / "all_data_10_train.json", {"w3": (img, [5])})
    _leaf(data / "train" / "all_data_2_train.json", {"w1": (img * 2, [1, 61]), "w2": (img, [0])})
    _leaf(data / "test" / "all_data_2_test.json", {"w9": (img, [3]), "w2": (img, [4])})
    ds = load_dataset("femnist", tmp_path)
    assert ds.train_x.shape == (4, 1, 28, 28) and ds.train_x.dtype == torch.float32
    # default: the FedMR authors' (0.5 - x) / 0.5, so LEAF's white background (1.0) is -1 and ink (0.0) is +1
    assert float(ds.train_x[0, 0, 27, 27]) == -1.0 and float(ds.train_x.min()) == -1.0
    assert float(ds.train_x.max()) == 1.0 and "0.5 - x" in ds.info["normalization"]
    raw = load_dataset("femnist", tmp_path, normalize="none")
    assert float(raw.train_x[0, 0, 27, 27]) == 1.0 and float(raw.train_x.min()) == 0.0  # values kept as given
    assert torch.equal((0.5 - raw.train_x) / 0.5, ds.train_x) and torch.equal((0.5 - raw.test_x) / 0.5, ds.test_x)
    with pytest.raises(ValueError, match="normalize"):
        load_dataset("femnist", tmp_path, normalize="minmax")
    # users by appearance: files in natural order (2 before 10), then test-only users
    assert ds.group_names == ["w1", "w2", "w3", "w9"]
    assert ds.train_groups.tolist() == [0, 0, 1, 2]  # type: ignore[union-attr]
    assert ds.test_groups.tolist() == [3, 1]  # type: ignore[union-attr]
    assert ds.train_y.tolist() == [1, 61, 0, 5] and ds.num_classes == 62
    monkeypatch.setattr(D.leaf, "_read_leaf", lambda *a: pytest.fail("cache not used"))
    again = load_dataset("femnist", tmp_path)
    assert torch.equal(again.train_x, ds.train_x) and again.group_names == ds.group_names


def test_shakespeare_leaf_trusts_len_y(tmp_path: Path) -> None:
    root = tmp_path / "shakespeare-leaf" / "data"
    _leaf(root / "train" / "a.json", {"PLAY_A_ROLE": (["ab~" + "a" * 77, "z" * 80], ["c", "é"])})
    _leaf(root / "test" / "a.json", {"PLAY_A_ROLE": (["\n" * 80], ["}"])}, num_samples=[5])  # quirk: 5 != 1
    ds = load_dataset("shakespeare", tmp_path)
    unk = len(D.LEAF_LETTERS)
    assert ds.num_classes == unk + 1 and ds.vocab is not None and ds.vocab[-1] == "<unk>"
    assert ds.train_x.shape == (2, 80) and ds.train_x.dtype == torch.int64
    assert ds.train_x[0, :3].tolist() == [D.LEAF_LETTERS.index("a"), D.LEAF_LETTERS.index("b"), unk]
    assert ds.train_y.tolist() == [D.LEAF_LETTERS.index("c"), unk]
    assert len(ds.test_y) == 1 and ds.test_y.tolist() == [D.LEAF_LETTERS.index("}")]
    assert ds.train_domains is None  # no users_and_plays.json


# ------------------------------------------------------------------------------------------ LM (synthetic)


def test_word_lm_windows_and_unknown_words(tmp_path: Path) -> None:
    folder = tmp_path / "wikitext-2"
    folder.mkdir()
    (folder / "wiki.train.tokens").write_text(" a b a \n\n c a b \n")
    (folder / "wiki.valid.tokens").write_text(" a z \n")
    (folder / "wiki.test.tokens").write_text(" b \n")
    with pytest.warns(UserWarning, match="the canonical file has"):
        ds = load_dataset("wikitext2", tmp_path, seq_len=2)
    # train stream: a b a <eos> <eos> c a b <eos>; vocab by frequency, then word ("<eos>" < "a")
    assert ds.vocab == ["<eos>", "a", "b", "c", "<unk>"]
    assert ds.info["tokens"] == {"train": 9, "valid": 3, "test": 2}
    assert ds.train_x.tolist() == [[1, 2], [1, 0], [0, 3], [1, 2]]
    assert ds.train_y.tolist() == [[2, 1], [0, 0], [3, 1], [2, 0]]
    assert ds.val_x is not None and ds.val_x.tolist() == [[1, 4]]  # "z" -> <unk>
    assert ds.test_x.shape == (0, 2)  # 2 tokens make no full window
    assert ds.input_shape == (2,) and ds.num_classes == 5 and ds.task == "lm"


# ------------------------------------------------------------------------------------------ checksums


def test_checksum_mismatch_warns_once_and_skip_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = shared("tiny-shakespeare") / "tiny-shakespeare" / "input.txt"
    text = bytearray(src.read_bytes())
    text[100] = ord("#") if text[100] != ord("#") else ord("%")  # same size, different content
    (tmp_path / "tiny-shakespeare").mkdir()
    copy = tmp_path / "tiny-shakespeare" / "input.txt"
    copy.write_bytes(bytes(text))
    monkeypatch.setenv("FEDFUSE_SKIP_CHECKSUMS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = load_dataset("tiny-shakespeare", tmp_path)
    assert ds.info["checksums"] == {"input.txt": "size-ok"}
    monkeypatch.delenv("FEDFUSE_SKIP_CHECKSUMS")
    with pytest.warns(UserWarning, match=r"sha256 of .*input.txt differs"):
        ds = load_dataset("tiny-shakespeare", tmp_path)
    assert ds.info["checksums"] == {"input.txt": "mismatch"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # memoised: checked once per process
        load_dataset("tiny-shakespeare", tmp_path)


# -------------------------------------------------------------------------------------- real shared files


@pytest.mark.shared_data
def test_mnist_real() -> None:
    root = shared("mnist")
    start = time.process_time()  # CPU time: wall time on a shared machine measures the other jobs too
    ds = load_dataset("mnist", root)
    elapsed = time.process_time() - start
    assert elapsed < 3.0, f"loading MNIST took {elapsed:.2f} CPU s"
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    train_counts = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert np.bincount(ds.train_labels).tolist() == train_counts
    assert np.bincount(ds.test_labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert abs(float(ds.train_x.mean())) < 1e-3 and abs(float(ds.train_x.std()) - 1) < 1e-3
    assert set(ds.info["checksums"].values()) == {"ok"}
    assert len(ds.info["source_files"]) == 4
    direct = load_dataset("mnist", root / "mnist")  # the folder itself as data dir
    assert torch.equal(direct.test_x, ds.test_x)


@pytest.mark.shared_data
def test_mnist_real_rotated_domains() -> None:
    ds = load_dataset("mnist", shared("mnist"), rotate_domains=4, train_limit=2000, test_limit=500)
    assert ds.train_x.shape == (2000, 1, 28, 28) and len(ds.test_y) == 500
    assert np.bincount(ds.train_domains).tolist() == [500] * 4  # type: ignore[arg-type]
    assert np.bincount(ds.test_domains).tolist() == [125] * 4  # type: ignore[arg-type]
    assert ds.domain_names == ["rot0", "rot90", "rot180", "rot270"]


@pytest.mark.shared_data
def test_ptb_real() -> None:
    ds = load_dataset("ptb", shared("ptb"))
    assert ds.task == "lm" and ds.num_classes == 10000 and ds.vocab is not None and len(ds.vocab) == 10000
    assert ds.vocab[0] == "the" and "<eos>" in ds.vocab and "<unk>" in ds.vocab
    assert ds.info["tokens"] == {"train": 929589, "valid": 73760, "test": 82430}
    assert ds.train_x.shape == (929588 // 35, 35) and ds.train_x.dtype == torch.int64
    assert ds.input_shape == (35,)
    assert torch.equal(ds.train_y[:, :-1], ds.train_x[:, 1:])
    assert torch.equal(ds.train_y[:-1, -1], ds.train_x[1:, 0])
    assert ds.val_x is not None and ds.val_y is not None and ds.val_x.shape == (73759 // 35, 35)
    assert set(ds.info["checksums"].values()) == {"ok"}
    assert load_dataset("ptb", shared("ptb"), seq_len=64).train_x.shape == (929588 // 64, 64)


@pytest.mark.shared_data
def test_wikitext2_real() -> None:
    ds = load_dataset("wikitext2", shared("wikitext2"))
    assert ds.num_classes == 33278
    assert ds.info["tokens"] == {"train": 2088628, "valid": 217646, "test": 245569}
    assert ds.train_x.shape == (2088627 // 35, 35)
    assert set(ds.info["checksums"].values()) == {"ok"}


@pytest.mark.shared_data
def test_tiny_shakespeare_real() -> None:
    ds = load_dataset("tiny-shakespeare", shared("tiny-shakespeare"))
    assert ds.num_classes == 65 and ds.vocab == sorted(ds.vocab or [])
    tokens = ds.info["tokens"]
    assert sum(tokens.values()) == 1115394
    assert tokens["train"] == int(0.9 * 1115394)
    assert ds.train_x.shape == ((tokens["train"] - 1) // 64, 64) and ds.input_shape == (64,)
    assert ds.val_x is not None and ds.test_x.shape[1] == 64
    text = "".join((ds.vocab or [])[i] for i in ds.train_x[0].tolist())
    assert text.startswith("First Citizen:")
    words = load_dataset("tiny-shakespeare", shared("tiny-shakespeare"), level="word", seq_len=16)
    assert words.vocab is not None and "<eos>" in words.vocab and words.input_shape == (16,)
    assert sum(words.info["tokens"].values()) == 202651 + 40000  # whitespace words + one <eos> per line


@pytest.mark.shared_data
def test_shakespeare_real() -> None:
    ds = load_dataset("shakespeare", shared("shakespeare-leaf"))
    assert ds.train_x.shape == (41990, 80) and ds.train_x.dtype == torch.int64
    assert len(ds.test_y) == 3881  # len(y), not num_samples (4,671)
    assert ds.num_classes == len(D.LEAF_LETTERS) + 1
    assert ds.group_names is not None and len(ds.group_names) == 10
    assert set(ds.train_groups.tolist()) == set(range(10))  # type: ignore[union-attr]
    assert set(ds.test_groups.tolist()) <= set(range(10))  # type: ignore[union-attr]
    assert ds.domain_names is not None and "THE TRAGEDY OF KING LEAR" in ds.domain_names
    assert ds.train_domains is not None and ds.train_domains.shape == (41990,)
    lear = ds.domain_names.index("THE TRAGEDY OF KING LEAR")
    first_user = ds.group_names[int(ds.train_groups[0])]  # type: ignore[index]
    assert first_user.startswith("THE_TRAGEDY_OF_KING_LEAR") and ds.train_domains[0] == lear
    assert set(ds.info["checksums"].values()) == {"ok"}
    limited = load_dataset("shakespeare", SHARED, train_limit=500)
    assert len(limited.train_y) == 500 and limited.train_groups.shape == (500,)  # type: ignore[union-attr]


@pytest.mark.shared_data
def test_femnist_real(monkeypatch: pytest.MonkeyPatch) -> None:
    shared("femnist-leaf")
    ds = _load_with_shared_cache("femnist")
    assert ds.train_x.shape == (14708, 1, 28, 28) and ds.test_x.shape == (1685, 1, 28, 28)
    assert ds.group_names is not None and len(ds.group_names) == 105
    assert ds.num_classes == 62 and len(np.unique(ds.train_labels)) == 62
    assert float(ds.train_x.min()) >= -1.0 and float(ds.train_x.max()) <= 1.0
    assert float(ds.train_x.mean()) < -0.5  # mostly background, which the authors' scaling maps to -1
    assert set(ds.test_groups.tolist()) == set(range(105))  # type: ignore[union-attr]
    assert set(ds.info["checksums"].values()) == {"ok"}
    monkeypatch.setattr(D.leaf, "_read_leaf", lambda *a: pytest.fail("cache not used"))
    again = _load_with_shared_cache("femnist")
    assert torch.equal(again.test_x, ds.test_x)


@pytest.mark.shared_data
@pytest.mark.slow
def test_cifar10_jpeg_tarball_real(monkeypatch: pytest.MonkeyPatch) -> None:
    shared("cifar10-jpeg")
    ds = _load_with_shared_cache("cifar10")  # first run decodes 60k JPEGs (~10 s), then the cache is used
    assert ds.train_x.shape == (50000, 3, 32, 32) and ds.test_x.shape == (10000, 3, 32, 32)
    assert np.bincount(ds.train_labels).tolist() == [5000] * 10
    assert np.bincount(ds.test_labels).tolist() == [1000] * 10
    assert ds.info["checksums"] == {"CIFAR-10-images-d7d0561.tar.gz": "ok"}
    assert abs(float(ds.train_x.mean())) < 0.05 and abs(float(ds.train_x.std()) - 1) < 0.05
    monkeypatch.setattr(D.cifar, "_decode_images", lambda *a: pytest.fail("cache not used"))
    again = _load_with_shared_cache("cifar10")
    assert torch.equal(again.test_x, ds.test_x)


def test_a_truncated_archive_is_named(tmp_path):
    """A download cut short raises EOFError deep inside tarfile/gzip; the error names the file."""
    import io
    import os
    import tarfile

    from fedfuse.data.datasets import load_dataset
    from fedfuse.errors import UserError

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        blob = os.urandom(200_000)
        info = tarfile.TarInfo("CIFAR-10-images/train/airplane/0000.jpg")
        info.size = len(blob)
        tar.addfile(info, io.BytesIO(blob))
    folder = tmp_path / "cifar10-jpeg"
    folder.mkdir()
    archive = folder / "CIFAR-10-images-d7d0561.tar.gz"
    archive.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(UserError, match=f"its file {archive} is unreadable or corrupt"):
        load_dataset("cifar10", tmp_path)
