"""Partition reports (data/report.py): label histograms, the partition table, partition plots with integer client
ids and headroom."""

from __future__ import annotations

import fedfuse
from fedfuse.data.dataset import Dataset
from fedfuse.data.federation import build_federation
from fedfuse.data.partition import make_partition
from fedfuse.data.report import label_histograms, partition_table, plot_partition


def test_reports(digits: Dataset, tmp_path) -> None:
    part = make_partition("dirichlet", digits, 12, seed=0, alpha=0.3)
    fed = build_federation(digits, part, seed=0)
    hist = label_histograms(fed)
    assert hist.shape == (12, 10) and hist.sum() == sum(len(c.train) for c in fed.clients)
    table = partition_table(fed)
    rows = table.splitlines()
    for c in fed.clients:
        assert any(r.split()[0] == str(c.cid) for r in rows[2:])
    short = partition_table(fed, max_rows=5)
    assert "more clients" in short
    png = plot_partition(fed, tmp_path / "sub" / "partition.png")
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_partition_plot_integer_client_ids_and_headroom(tmp_path):
    from matplotlib.image import imread

    from fedfuse.data.report import plot_partition
    from fedfuse.engine.loop import build_federation

    fed = build_federation(fedfuse.make_config(clients=7, clients_per_round=2))
    import matplotlib.figure

    captured = {}
    original = matplotlib.figure.Figure.savefig

    def keep(self, *args, **kwargs):
        captured["ax"] = self.axes[0]
        return original(self, *args, **kwargs)

    matplotlib.figure.Figure.savefig = keep
    try:
        plot_partition(fed, tmp_path / "p.png")
    finally:
        matplotlib.figure.Figure.savefig = original
    ax = captured["ax"]
    ticks = [t for t in ax.get_xticks() if -0.6 <= t <= 6.4]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert ax.get_ylim()[1] >= 1.05 * max(fed.client_sizes())
    assert imread(tmp_path / "p.png").shape[0] > 0
