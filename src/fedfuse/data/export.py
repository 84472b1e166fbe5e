"""A fedfuse partition written for a Flower pipeline.

:func:`export_partitions` writes any fedfuse dataset × partition as a Hugging Face ``DatasetDict`` on disk
(``train`` with a ``partition_id`` column, ``test`` = the global test set) plus a README, for an existing Flower
pipeline (``NaturalIdPartitioner(partition_by="partition_id")``).  ``datasets`` (extra ``fedfuse[flower]``) is
imported only when used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data.dataset import Dataset, Partition
from fedfuse.data.datasets import load_dataset
from fedfuse.data.flower_datasets import GROUP_COLUMN, _need
from fedfuse.data.partition import make_partition
from fedfuse.errors import UserError
from fedfuse.extras import require_extra


def export_partitions(cfg: Any, out: str | os.PathLike[str], overwrite: bool = False) -> Path:
    """Load ``cfg``'s dataset, partition it as a run would, and :func:`write_partitions` it to ``out``."""
    require_extra("flower", "export-partitions")  # before loading any data
    ds = load_dataset(cfg.dataset, cfg.data_dir, **cfg.dataset_options)
    part = make_partition(cfg.partition, ds, cfg.clients, cfg.seed, **cfg.partition_options)
    return write_partitions(ds, part, out, overwrite=overwrite, command=_command(cfg))


def _command(cfg: Any) -> str:
    sets = [f"--set partition_options.{k}={json.dumps(v)}" for k, v in sorted(cfg.partition_options.items())]
    sets += [f"--set dataset_options.{k}={json.dumps(v)}" for k, v in sorted(cfg.dataset_options.items())
             if v is not None]
    return " ".join(["fedfuse export-partitions", f"--dataset {cfg.dataset}", f"--partition {cfg.partition}",
                     f"--clients {cfg.clients}", f"--seed {cfg.seed}", *sets])


def _input_feature(hf: Any, x: torch.Tensor) -> Any:
    shape, dtype = tuple(int(s) for s in x.shape[1:]), str(x.dtype).replace("torch.", "")
    arrays = {2: hf.Array2D, 3: hf.Array3D, 4: hf.Array4D}
    if len(shape) == 1:
        return hf.List(hf.Value(dtype), length=shape[0])
    if len(shape) not in arrays:
        raise UserError(f"cannot export inputs of shape {shape}")
    return arrays[len(shape)](shape, dtype)


def write_partitions(ds: Dataset, part: Partition, out: str | os.PathLike[str], *, overwrite: bool = False,
                     command: str = "") -> Path:
    """Write ``part`` of ``ds`` as a Hugging Face ``DatasetDict`` at ``out`` plus ``README.md``.

    ``train``: each client's samples (its partition indices, sorted) in client order, columns ``x`` (fedfuse's
    normalised input tensor), ``label`` (ClassLabel), ``partition_id`` (the client) and ``sample_id`` (index into
    the dataset's training split); ``test``: the global test set (``x``, ``label``).  Reading ``hf:OUT`` back
    with partition ``natural`` (or ``flwr:natural-id``) and the same seed rebuilds the same federation.
    """
    if ds.task != "classification":
        raise UserError(f"export-partitions writes classification datasets; {ds.name!r} is a {ds.task} dataset")
    hf = _need("datasets")
    target = Path(out)
    if target.exists() and any(target.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{target} is not empty; choose another --out or pass --overwrite")
        if not (target / "fedfuse_partition.json").is_file():
            raise FileExistsError(f"{target} is not empty and not an earlier export (no fedfuse_partition.json); "
                                  "--overwrite replaces only earlier exports")
    idx = [np.asarray(i, dtype=np.int64) for i in part.train_indices]
    order = np.concatenate(idx) if idx else np.zeros(0, np.int64)
    pid = np.concatenate([np.full(len(i), c, dtype=np.int64) for c, i in enumerate(idx)]) if idx else order
    names = list(ds.class_names or [str(i) for i in range(ds.num_classes)])
    x_feat = _input_feature(hf, ds.train_x)
    label = hf.ClassLabel(names=names)
    train = hf.Dataset.from_dict(
        {"x": ds.train_x[torch.from_numpy(order)].numpy(), "label": ds.train_y.numpy()[order],
         GROUP_COLUMN: pid, "sample_id": order},
        features=hf.Features({"x": x_feat, "label": label, GROUP_COLUMN: hf.Value("int64"),
                              "sample_id": hf.Value("int64")}),
    )
    test = hf.Dataset.from_dict({"x": ds.test_x.numpy(), "label": ds.test_y.numpy()},
                                features=hf.Features({"x": x_feat, "label": label}))
    if target.exists() and overwrite and (target / "fedfuse_partition.json").is_file():
        import shutil

        shutil.rmtree(target)
    hf.DatasetDict({"train": train, "test": test}).save_to_disk(str(target))
    meta = {"dataset": ds.name, "partition": part.info, "num_clients": part.num_clients,
            "sizes": part.sizes().tolist(), "num_classes": ds.num_classes, "input_shape": list(ds.input_shape),
            "command": command}
    (target / "fedfuse_partition.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    (target / "README.md").write_text(_readme(ds, part, target, len(order), command))
    return target


def _readme(ds: Dataset, part: Partition, target: Path, rows: int, command: str) -> str:
    sizes = part.sizes()
    name = str(part.info.get("name", ""))
    columns = (f"`x` (input, {tuple(ds.input_shape)} float, fedfuse's normalisation), `label` ({ds.num_classes} "
               f"classes), `partition_id` (client 0..{part.num_clients - 1}), `sample_id` (index in fedfuse's "
               "train split)")
    return f"""# fedfuse partitions of `{ds.name}` ({name}, {part.num_clients} clients)

Written by fedfuse{f" with `{command}`" if command else ""}.

A Hugging Face `DatasetDict` (`datasets.load_from_disk`):

| split | rows | columns |
|---|---|---|
| `train` | {rows} | {columns} |
| `test` | {len(ds.test_y)} | `x`, `label` (the global test set) |

Client sizes: min {int(sizes.min())}, median {int(np.median(sizes))}, max {int(sizes.max())}; training samples
in no client: {len(ds.train_y) - rows}.  Partition details: `fedfuse_partition.json`.

## Flower

```python
from datasets import load_from_disk
from flwr_datasets.partitioner import NaturalIdPartitioner

dd = load_from_disk("{target}")
partitioner = NaturalIdPartitioner(partition_by="partition_id")
partitioner.dataset = dd["train"]
client_data = partitioner.load_partition(partition_id)   # partition_id == fedfuse client id
client_data = client_data.with_format("torch")           # client_data["x"], client_data["label"]
```

`NaturalIdPartitioner` numbers partitions in order of first appearance; the rows are written client by client,
so Flower's partition `i` is fedfuse's client `i`.

## fedfuse

`fedfuse run --dataset hf:{target} --partition natural --clients {part.num_clients}` (the `partition_id` column is
the natural group) rebuilds the same clients; with the same `--seed` the same validation and test splits.
"""
