"""Node-local data: a SuperNode that holds its own clients' examples and nothing else.

A SuperNode started with ``--node-config "data='/path'"`` builds its clients from that path only, reports
which client ids it serves, and refuses a job for any other client.  What the path may be:

* a **node bundle** written by ``fedfuse export-partitions --nodes N`` (``OUT/node-K/``: ``fedfuse_node.json``
  and one ``client-C.pt`` per client with its train / validation / test tensors exactly as the in-process
  engine builds them — a deployment over bundles reproduces the in-process run bit for bit);
* a **table**: a ``datasets`` ``save_to_disk`` directory (e.g. a Flower Datasets partition saved with
  ``partition.save_to_disk``, or ``fedfuse export-partitions`` output), a ``.parquet`` file, a ``.csv`` file;
* a **folder of images** (one sub-folder per class, Hugging Face's ``imagefolder`` layout).

For a table or an image folder the node's clients are the values of its ``partition_id`` column when it has
one, else the single client ``client-id`` (node config; default: ``partition-id``).  Inputs and labels are found
as for ``--dataset hf:`` (options ``input-column``, ``label-column``; labels must be integer ids or a
``ClassLabel``, so that every node numbers the classes alike).  The held-out split is the table's ``test``
split (rows of the node's clients) when it has one, else a seeded ``test-fraction`` (default 0.2) of each
client's rows; the validation split is then carved as in process (``val_fraction``, seeded by client id).
Images and ``uint8`` inputs are standardised with the node's own statistics (``normalization``: ``auto``,
``standard``, ``none``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.rng import numpy_rng
from fedfuse.types import ClientData, Federation, Split

BUNDLE_META = "fedfuse_node.json"
#: the run settings that decide which rows each client holds: a bundle records them, a node checks them
RUN_SETTINGS = ("dataset", "dataset_options", "partition", "partition_options", "clients", "seed", "val_fraction")
NODE_KEYS = ("data", "client-id", "input-column", "label-column", "test-fraction", "normalization")


class NodeDataError(ValueError):
    """The node's data cannot serve this run (missing files, a foreign client, a mismatching dataset)."""


@dataclass
class NodeData:
    """The clients one node holds, plus what the model needs to know about the data."""

    clients: dict[int, ClientData]
    num_classes: int
    input_shape: tuple[int, ...]
    source: Path
    task: str = "classification"
    dataset: str = ""
    class_names: list[str] | None = None
    num_clients: int | None = None  # size of the whole federation, when the data says so
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def client_ids(self) -> list[int]:
        return sorted(self.clients)

    def federation(self, num_clients: int) -> Federation:
        """A :class:`Federation` of ``num_clients`` whose held clients carry their data and every other client
        is empty (zero rows): what a node's algorithm is built from.  The global test set is empty too."""
        if self.client_ids and self.client_ids[-1] >= num_clients:
            raise NodeDataError(f"node data {self.source} holds client {self.client_ids[-1]}, but the run has "
                                f"{num_clients} clients")
        if self.num_clients is not None and self.num_clients != num_clients:
            raise NodeDataError(f"node data {self.source} was exported for {self.num_clients} clients, the run has "
                                f"{num_clients}")
        some = next(iter(self.clients.values()))
        empty = Split(some.train.x[:0], some.train.y[:0])
        clients = [self.clients.get(c) or ClientData(c, empty, empty, empty) for c in range(num_clients)]
        return Federation(clients=clients, test=empty, num_classes=self.num_classes,
                          input_shape=self.input_shape, task=self.task,  # type: ignore[arg-type]
                          dataset=self.dataset, class_names=self.class_names,
                          info={"node_clients": self.client_ids, "node_data": str(self.source)})


# ------------------------------------------------------------------------------------------------ bundles


def run_settings(cfg: Any) -> dict[str, Any]:
    """The :data:`RUN_SETTINGS` of run config ``cfg``, as JSON values (what a bundle records and a node compares)."""
    return json.loads(json.dumps({k: getattr(cfg, k) for k in RUN_SETTINGS}, sort_keys=True, default=str))


def write_node_bundles(fed: Federation, out: str | Path, nodes: int, meta: Mapping[str, Any] | None = None,
                       overwrite: bool = False, config: Any = None) -> list[Path]:
    """Write ``OUT/node-K/`` for ``K < nodes``: client ``c`` goes to node ``c % nodes``; each bundle holds its
    clients' train / validation / test tensors (``client-C.pt``) and ``fedfuse_node.json``, with the run settings
    of ``config`` (the run config ``fed`` was built from: :func:`run_settings`) that a node checks every run
    against."""
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    target = Path(out)
    if target.exists() and any(target.iterdir()):
        earlier = all((p / BUNDLE_META).is_file() for p in target.iterdir() if p.is_dir())
        if not overwrite or not earlier:
            raise FileExistsError(f"{target} is not empty; choose another --out or pass --overwrite (which replaces "
                                  "only earlier node bundles)")
        import shutil

        shutil.rmtree(target)
    paths = []
    for k in range(nodes):
        d = target / f"node-{k}"
        d.mkdir(parents=True)
        mine = [c for c in fed.clients if c.cid % nodes == k]
        for c in mine:
            torch.save({"cid": c.cid, **{f"{s}_{t}": getattr(getattr(c, s), t).contiguous().clone()
                                         for s in ("train", "val", "test") for t in ("x", "y")}},
                       d / f"client-{c.cid}.pt")
        info = {"format": "fedfuse-node-bundle/1", "node": k, "nodes": nodes, "clients": [c.cid for c in mine],
                "num_clients": fed.num_clients, "dataset": fed.dataset, "task": fed.task,
                "num_classes": fed.num_classes, "input_shape": list(fed.input_shape),
                "class_names": fed.class_names, **dict(meta or {})}
        if config is not None:
            info["run"] = run_settings(config)
        (d / BUNDLE_META).write_text(json.dumps(info, indent=2, default=str) + "\n")
        paths.append(d)
    return paths


def _read_bundle(path: Path) -> NodeData:
    meta = json.loads((path / BUNDLE_META).read_text())
    clients = {}
    for cid in meta["clients"]:
        t = torch.load(path / f"client-{int(cid)}.pt", weights_only=True)
        clients[int(cid)] = ClientData(int(cid), Split(t["train_x"], t["train_y"]), Split(t["val_x"], t["val_y"]),
                                       Split(t["test_x"], t["test_y"]))
    if not clients:
        raise NodeDataError(f"node bundle {path} holds no client")
    return NodeData(clients, int(meta["num_classes"]), tuple(int(s) for s in meta["input_shape"]), path,
                    task=str(meta.get("task", "classification")), dataset=str(meta.get("dataset", "")),
                    class_names=meta.get("class_names"), num_clients=int(meta["num_clients"]),
                    info={"format": meta.get("format"), "node": meta.get("node"), "run": _recorded_run(meta)})


def _recorded_run(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The run settings a bundle was exported with: ``run`` (every :data:`RUN_SETTINGS`), or for a bundle written
    before it recorded them, the ones its metadata has (``seed``, ``partition``, ``val_fraction``, clients)."""
    if isinstance(meta.get("run"), dict):
        return dict(meta["run"])
    old = {k: meta[k] for k in ("seed", "partition", "val_fraction") if k in meta}
    return {**old, "clients": meta["num_clients"]} if "num_clients" in meta else old


# ------------------------------------------------------------------------------------------------ tables


def _open_table(path: Path) -> dict[str, Any]:
    from fedfuse.data.flower_datasets import _need, open_splits

    hf = _need("datasets")
    if path.is_file() and path.suffix == ".csv":
        return {"train": hf.Dataset.from_csv(str(path))}
    if path.is_dir() and not (path / "dataset_dict.json").is_file() and not (path / "state.json").is_file() \
            and not any(path.rglob("*.parquet")):
        classes = sorted(p for p in path.iterdir() if p.is_dir())
        if not classes:
            raise NodeDataError(f"node data {path}: no bundle, table or image folder found")
        files, labels = [], []
        for k, d in enumerate(classes):
            for f in sorted(d.iterdir()):
                if f.suffix.lower() in (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"):
                    files.append(str(f))
                    labels.append(k)
        feats = hf.Features({"image": hf.Image(), "label": hf.ClassLabel(names=[d.name for d in classes])})
        return {"train": hf.Dataset.from_dict({"image": files, "label": labels}, features=feats)}
    return open_splits(path)


@dataclass(frozen=True)
class _TableColumns:
    """Which columns of a node's table hold the inputs and the labels (``input == "*"``: every other column)."""

    path: Path
    input: str
    label: str
    features: list[str]
    is_image: bool

    def arrays(self, ds: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Inputs, integer labels and (when the table has the column) the client id of every row of ``ds``."""
        from fedfuse.data.flower_datasets import GROUP_COLUMN, column_values, input_array

        if self.input == "*":
            x = np.stack([column_values(ds, c).astype(np.float32) for c in self.features], axis=1)
        else:
            x = input_array(column_values(ds, self.input), self.is_image)
        y = column_values(ds, self.label)
        if not np.issubdtype(y.dtype, np.integer):
            raise NodeDataError(f"node data {self.path}: labels in column {self.label!r} must be integer class ids "
                                "or a ClassLabel (every node must number the classes alike)")
        g = column_values(ds, GROUP_COLUMN).astype(np.int64) if GROUP_COLUMN in ds.column_names else None
        return x, y.astype(np.int64), g


def _table_columns(path: Path, train: Any, opts: Mapping[str, Any]) -> _TableColumns:
    """The input and label columns: named in the node config, else found by their usual names or feature types."""
    from fedfuse.data.flower_datasets import GROUP_COLUMN, INPUT_COLUMNS, LABEL_COLUMNS, pick_column

    cols, feats = list(train.column_names), train.features
    label_col = pick_column(cols, opts.get("label-column"), LABEL_COLUMNS, "label", "label-column",
                      lambda: next((c for c in cols if type(feats[c]).__name__ == "ClassLabel"), None))
    # no input column: every other column is a feature (a CSV/Parquet table of numbers)
    input_col = pick_column(cols, opts.get("input-column"), INPUT_COLUMNS, "input", "input-column",
                      lambda: next((c for c in cols if type(feats[c]).__name__ in ("Image", "Array2D", "Array3D")),
                                   "*"))
    features = [c for c in cols if c not in (label_col, GROUP_COLUMN, "sample_id")]
    is_image = input_col != "*" and type(feats[input_col]).__name__ == "Image"
    return _TableColumns(path, input_col, label_col, features, is_image)


_Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # train x, train y, test x, test y


def _split_clients(columns: _TableColumns, splits: Mapping[str, Any], opts: Mapping[str, Any],
                   seed: int) -> tuple[dict[int, _Rows], np.ndarray]:
    """Every client's training and test rows (the table's test split, else a seeded fraction of its own rows),
    and the labels of the train split."""
    from fedfuse.data.flower_datasets import GROUP_COLUMN

    x, y, groups = columns.arrays(splits["train"])
    if groups is None:
        cid = opts.get("client-id", opts.get("partition-id"))
        if cid is None:
            raise NodeDataError(f"node data {columns.path} has no {GROUP_COLUMN!r} column: give the node's client "
                                "id with --node-config \"client-id=K\"")
        groups = np.full(len(y), int(cid), np.int64)
    held = {}
    if "test" in splits and GROUP_COLUMN in splits["test"].column_names:
        tx, ty, tg = columns.arrays(splits["test"])
        for c in np.unique(groups):
            held[int(c)] = np.flatnonzero(tg == c)
    frac = float(opts.get("test-fraction", 0.2))
    parts: dict[int, _Rows] = {}
    for c in np.unique(groups):
        rows = np.flatnonzero(groups == c)
        if int(c) in held and len(held[int(c)]):
            parts[int(c)] = (x[rows], y[rows], tx[held[int(c)]], ty[held[int(c)]])
        else:  # hold out a seeded fraction of the client's own rows
            n_test = min(max(round(len(rows) * frac), 1), len(rows) - 1) if len(rows) >= 2 and frac > 0 else 0
            perm = numpy_rng(seed, "node-holdout", int(c)).permutation(len(rows))
            te, tr = np.sort(rows[perm[:n_test]]), np.sort(rows[perm[n_test:]])
            parts[int(c)] = (x[tr], y[tr], x[te], y[te])
    return parts, y


def _client_data(c: int, rows: _Rows, all_train: np.ndarray, mode: str, is_image: bool, seed: int,
                 val_fraction: float) -> ClientData:
    """One client's normalised train/validation/test splits (the validation rows a seeded fraction of its train)."""
    from fedfuse.data.flower_datasets import normalise_inputs

    xs, ys, xt, yt = rows
    fx, ft, norm = normalise_inputs(xs, xt, mode, is_image)
    if "mean" in norm:  # the node's own statistics over all its clients' training rows
        fx, ft, norm = _node_standardise(all_train, xs, xt)
    n_val = round(len(ys) * val_fraction)
    n_val = min(max(n_val, 1), len(ys) - 1) if val_fraction > 0 and len(ys) >= 2 else 0
    perm = numpy_rng(seed, "partition", "val", c).permutation(len(ys))
    tr, va = torch.from_numpy(np.sort(perm[n_val:])), torch.from_numpy(np.sort(perm[:n_val]))
    yt_ = torch.from_numpy(ys)
    return ClientData(c, Split(fx[tr], yt_[tr]), Split(fx[va], yt_[va]), Split(ft, torch.from_numpy(yt)))


def _read_table(path: Path, opts: Mapping[str, Any], seed: int, val_fraction: float) -> NodeData:
    splits = _open_table(path)
    if "train" not in splits:
        raise NodeDataError(f"node data {path} has no 'train' split; splits: {list(splits)}")
    columns = _table_columns(path, splits["train"], opts)
    parts, y = _split_clients(columns, splits, opts, seed)
    names = getattr(splits["train"].features[columns.label], "names", None)
    num_classes = len(names) if names else int(y.max(initial=-1)) + 1
    all_train = np.concatenate([p[0] for p in parts.values()])
    mode = str(opts.get("normalization", "auto"))
    clients = {c: _client_data(c, rows, all_train, mode, columns.is_image, seed, val_fraction)
               for c, rows in parts.items()}
    some = next(iter(clients.values()))
    return NodeData(clients, num_classes, tuple(int(s) for s in some.train.x.shape[1:]), path,
                    class_names=[str(n) for n in names] if names else None,
                    info={"format": "table", "columns": {"input": columns.input, "label": columns.label},
                          "normalization": mode})


def _node_standardise(all_train: np.ndarray, xs: np.ndarray, xt: np.ndarray) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        dict[str, Any]]:
    axes = (0, 2, 3) if all_train.ndim == 4 else tuple(range(all_train.ndim))
    mean = all_train.mean(axis=axes, dtype=np.float64, keepdims=True)
    std = all_train.std(axis=axes, dtype=np.float64, keepdims=True)
    std = np.where(std > 0, std, 1.0)

    def f(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((a - mean) / std).astype(np.float32))

    return f(xs), f(xt), {"mean": mean.ravel().tolist(), "std": std.ravel().tolist(), "from": "node"}


# ------------------------------------------------------------------------------------------------ entry point


def load_node_data(node_config: Mapping[str, Any], *, seed: int, val_fraction: float) -> NodeData:
    """The clients of the node whose Flower node config names its data (``data``; see the module docstring)."""
    path = Path(str(node_config["data"])).expanduser()
    if not path.exists():
        raise NodeDataError(f"node data {path} does not exist")
    if path.is_dir() and (path / BUNDLE_META).is_file():
        return _read_bundle(path)
    return _read_table(path, node_config, seed, val_fraction)


def check_compatible(data: NodeData, cfg: Any) -> None:
    """The run's config and the node's data must agree on the clients and the data: a bundle's recorded run
    settings (dataset, its options, partition and its options, clients, seed, validation split) must equal the
    run's, or the node would train other rows than the run's clients hold (a bundle of another export)."""
    if data.dataset and cfg.dataset and data.dataset != cfg.dataset and data.info.get("format") != "table":
        raise NodeDataError(f"node data {data.source} was exported from dataset {data.dataset!r}; the run uses "
                            f"{cfg.dataset!r}")
    recorded = data.info.get("run") or {}
    now = run_settings(cfg)
    differ = [f"{k}={recorded[k]!r} (the run: {now[k]!r})" for k in RUN_SETTINGS if k in recorded
              and recorded[k] != now[k]]
    if differ:
        raise NodeDataError(f"node data {data.source} was exported with {', '.join(differ)}: it does not hold "
                            "this run's clients; export the bundles again with the run's settings")
