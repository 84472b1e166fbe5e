"""Flower-ecosystem data: hf:PATH datasets, flwr:NAME partitions and export-partitions (no network)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

hf = pytest.importorskip("datasets", reason="needs the flower extra: pip install -e '.[flower]'")
fp = pytest.importorskip("flwr_datasets.partitioner", reason="needs the flower extra: pip install -e '.[flower]'")

from fedfuse.cli import main  # noqa: E402
from fedfuse.config import ConfigError  # noqa: E402
from fedfuse.data.datasets import load_dataset  # noqa: E402
from fedfuse.data.federation import build_federation  # noqa: E402
from fedfuse.data.partition import PARTITIONS, make_partition  # noqa: E402

N_TRAIN = 1400  # sklearn digits: 1,797 images; the first 1,400 are the train split, the rest the test split


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDFUSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    b = load_digits()
    return (b.images * 16).clip(0, 255).astype(np.uint8), b.target.astype(np.int64)


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Digits as a Flower user saves an image dataset: PIL ``image``, ClassLabel ``label``, train/test splits,
    plus a ``uid`` column (ignored by fedfuse) to compare rows with Flower's own partitions."""
    from PIL import Image

    x, y = _digits()
    feats = hf.Features({"image": hf.Image(), "label": hf.ClassLabel(names=[f"d{i}" for i in range(10)]),
                         "uid": hf.Value("int64")})

    def split(lo: int, hi: int) -> object:
        return hf.Dataset.from_dict({"image": [Image.fromarray(a) for a in x[lo:hi]], "label": y[lo:hi],
                                     "uid": np.arange(lo, hi)}, features=feats)

    out = tmp_path_factory.mktemp("hf") / "digits-hf"
    hf.DatasetDict({"train": split(0, N_TRAIN), "test": split(N_TRAIN, len(y))}).save_to_disk(str(out))
    return out


def test_pil_images_load_with_labels_and_train_standardisation(digits_dir: Path) -> None:
    x, y = _digits()
    ds = load_dataset(f"hf:{digits_dir}")
    assert ds.task == "classification" and ds.num_classes == 10 and ds.class_names == [f"d{i}" for i in range(10)]
    assert ds.input_shape == (1, 8, 8) and ds.train_x.dtype == torch.float32
    assert torch.equal(ds.train_y, torch.from_numpy(y[:N_TRAIN]))
    assert torch.equal(ds.test_y, torch.from_numpy(y[N_TRAIN:]))
    mean, std = x[:N_TRAIN].astype(np.float64).mean(), x[:N_TRAIN].astype(np.float64).std()
    expect = torch.from_numpy(((x[N_TRAIN:, None] - mean) / std).astype(np.float32))
    assert torch.allclose(ds.test_x, expect, atol=1e-6)
    assert abs(float(ds.train_x.mean())) < 1e-5 and abs(float(ds.train_x.std()) - 1) < 1e-3
    assert ds.info["columns"] == {"input": "image", "label": "label", "group": None}


def test_array_columns_named_by_options_and_held_out_test(tmp_path: Path) -> None:
    """A single saved Dataset (no test split) with float arrays under other column names."""
    x, y = _digits()
    feats = x.reshape(len(x), -1).astype(np.float32) / 255
    path = tmp_path / "flat"
    hf.Dataset.from_dict({"pixels": feats, "digit": y}).save_to_disk(str(path))
    with pytest.raises(ValueError, match="no label column"):
        load_dataset(f"hf:{path}")
    ds = load_dataset(f"hf:{path}", label_column="digit", test_fraction=0.25)
    n_test = round(len(y) * 0.25)
    assert len(ds.test_y) == n_test and len(ds.train_y) == len(y) - n_test and ds.input_shape == (64,)
    rows = torch.cat([ds.train_x, ds.test_x])  # floats are kept as stored: every row is one of the originals
    assert sorted(map(tuple, rows.numpy().tolist())) == sorted(map(tuple, feats.tolist()))
    assert "held out" in ds.info["test"]
    with pytest.raises(ValueError, match="test_fraction"):
        load_dataset(f"hf:{path}", label_column="digit", test_fraction=1.5)


def test_parquet_files_load_like_save_to_disk(digits_dir: Path, tmp_path: Path) -> None:
    dd = hf.load_from_disk(str(digits_dir))
    for split in ("train", "test"):
        dd[split].to_parquet(str(tmp_path / "pq" / f"{split}-00000-of-00001.parquet"))
    a, b = load_dataset(f"hf:{digits_dir}"), load_dataset(f"hf:{tmp_path / 'pq'}")
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)


def test_missing_directory_says_what_to_put_there(tmp_path: Path) -> None:
    from fedfuse.data.dataset import DatasetNotFoundError

    with pytest.raises(DatasetNotFoundError, match="save_to_disk"):
        load_dataset(f"hf:{tmp_path / 'nothing'}")


@pytest.mark.parametrize("name", ["iid", "dirichlet"])
def test_flwr_partition_equals_flower_pipeline_and_covers_every_sample(digits_dir: Path, name: str) -> None:
    """Client i = Flower's load_partition(i) after FederatedDataset's shuffle(seed), same seed: one sample each."""
    ds = load_dataset(f"hf:{digits_dir}")
    seed = 3
    part = make_partition(f"flwr:{name}", ds, 10, seed)
    flat = np.concatenate(part.train_indices)
    assert len(flat) == N_TRAIN and np.array_equal(np.sort(flat), np.arange(N_TRAIN))  # each sample exactly once
    train = hf.load_from_disk(str(digits_dir))["train"].shuffle(seed=seed)
    flower = (fp.IidPartitioner(num_partitions=10) if name == "iid"
              else fp.DirichletPartitioner(num_partitions=10, partition_by="label", alpha=0.5, seed=seed))
    flower.dataset = train
    for cid in range(10):
        rows = flower.load_partition(cid)
        assert np.array_equal(part.train_indices[cid], np.sort(rows["uid"]))
        assert np.array_equal(np.sort(ds.train_labels[part.train_indices[cid]]), np.sort(rows["label"]))
    if name == "iid":
        assert part.sizes().tolist() == [140] * 10
    assert part.info["flower_partitioner"] == ("IidPartitioner" if name == "iid" else "DirichletPartitioner")


def test_flwr_partitions_work_on_builtin_datasets_and_options_are_checked() -> None:
    ds = load_dataset("digits")
    part = make_partition("flwr:pathological", ds, 5, 0, num_classes_per_partition=2)
    for idx in part.train_indices:  # every client holds exactly two classes, no sample twice
        assert len(np.unique(ds.train_labels[idx])) == 2
    flat = np.concatenate(part.train_indices)
    assert len(np.unique(flat)) == len(flat) == len(ds.train_y) - part.info["unassigned_samples"]
    assert {f"flwr:{n}" for n in ("iid", "dirichlet", "shard", "pathological", "natural-id")} <= set(PARTITIONS)
    with pytest.raises(ValueError, match="num_shards_per_partition"):
        make_partition("flwr:shard", ds, 5, 0, num_shards_per_partition=0)
    with pytest.raises(ValueError, match="natural-id"):
        make_partition("flwr:natural-id", ds, 5, 0)


def test_cli_run_trains_on_hf_dataset_with_flower_partition(digits_dir: Path, tmp_path: Path, capsys) -> None:
    import json

    out = tmp_path / "run"
    argv = ["run", "--dataset", f"hf:{digits_dir}", "--partition", "flwr:dirichlet", "--set", "alpha=1.0",
            "--set", "min_partition_size=20", "--clients", "5", "--clients-per-round", "5", "--rounds", "4",
            "--local-epochs", "1", "--lr", "0.05", "--no-progress", "--threads", "1", "--out", str(out),
            "--set", "plots=false"]
    assert main(argv) == 0
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accs = [h["global_accuracy"] for h in history if "global_accuracy" in h]
    assert accs[-1] > 0.5  # ten classes: chance is 0.1
    bad = [*argv[:-4], "--out", str(tmp_path / "bad"), "--set", "min_partition_size=-1"]
    assert main(bad) != 0 and not (tmp_path / "bad").exists()
    assert "min_partition_size" in capsys.readouterr().err


def test_bad_partition_option_is_a_config_error(digits_dir: Path) -> None:
    from fedfuse.config import make_config

    with pytest.raises(ConfigError, match="class_assignment_mode"):
        make_config(dataset=f"hf:{digits_dir}", partition="flwr:pathological",
                    partition_options={"class_assignment_mode": "sideways"})


@pytest.mark.parametrize("partition", ["dirichlet", "shards"])
def test_export_round_trip_rebuilds_the_same_federation(tmp_path: Path, partition: str) -> None:
    out = tmp_path / "export"
    argv = ["export-partitions", "--dataset", "digits", "--partition", partition, "--clients", "10",
            "--seed", "7", "--out", str(out)]
    assert main(argv) == 0
    assert (out / "README.md").is_file() and "NaturalIdPartitioner" in (out / "README.md").read_text()
    assert main(argv) != 0  # refuses to overwrite without --overwrite
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main([*argv[:-1], str(other), "--overwrite"]) != 0 and (other / "keep.txt").is_file()

    ds = load_dataset("digits")
    part = make_partition(partition, ds, 10, 7)
    back = load_dataset(f"hf:{out}")
    assert torch.equal(back.test_x, ds.test_x) and torch.equal(back.test_y, ds.test_y)
    for name in ("natural", "flwr:natural-id"):
        part2 = make_partition(name, back, 10, 7)
        for a, b in zip(part.train_indices, part2.train_indices):  # same samples, same order, same client
            assert torch.equal(ds.train_x[a], back.train_x[b]) and torch.equal(ds.train_y[a], back.train_y[b])
        fed, fed2 = build_federation(ds, part, seed=7), build_federation(back, part2, seed=7)
        for c, c2 in zip(fed.clients, fed2.clients):
            for s in ("train", "val", "test"):
                assert torch.equal(getattr(c, s).x, getattr(c2, s).x) and torch.equal(getattr(c, s).y, getattr(c2, s).y)

    # a Flower pipeline reads it unchanged: partition i holds fedfuse client i's samples
    flower = fp.NaturalIdPartitioner(partition_by="partition_id")
    flower.dataset = hf.load_from_disk(str(out))["train"]
    assert flower.num_partitions == 10
    for cid in range(10):
        assert np.array_equal(np.asarray(flower.load_partition(cid)["sample_id"]), part.train_indices[cid])
