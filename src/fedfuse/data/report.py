"""Text and PNG summaries of how a federation's data is spread over clients."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedfuse.types import Federation


def label_histograms(fed: Federation) -> np.ndarray:
    """``(num_clients, num_classes)`` label counts of each client's train split (validation excluded).

    Language-model federations have no labels: the result then has shape ``(num_clients, 0)``.
    """
    if fed.task == "lm":
        return np.zeros((fed.num_clients, 0), dtype=np.int64)
    hist = np.zeros((fed.num_clients, fed.num_classes), dtype=np.int64)
    for i, c in enumerate(fed.clients):
        if len(c.train):
            counts = np.bincount(c.train.y.cpu().numpy().astype(np.int64), minlength=fed.num_classes)
            hist[i] = counts[: fed.num_classes]
    return hist


def _compact(counts: np.ndarray, top: int = 12) -> str:
    nz = np.flatnonzero(counts)
    if len(nz) > top:
        keep = np.sort(nz[np.argsort(-counts[nz], kind="stable")[:top]])
        return " ".join(f"{c}:{counts[c]}" for c in keep) + f" …(+{len(nz) - top} classes)"
    return " ".join(f"{c}:{counts[c]}" for c in nz)


def partition_table(fed: Federation, max_rows: int = 50) -> str:
    """Per-client train/val/test sizes, group, number of classes and a compact ``class:count`` histogram."""
    hist = label_histograms(fed)
    lm = fed.task == "lm"
    header = f"{'client':>6} {'group':>5} {'train':>7} {'val':>6} {'test':>6}"
    header += "" if lm else f" {'cls':>4}  labels (class:count)"
    lines = [f"dataset={fed.dataset} partition={fed.partition} clients={fed.num_clients}", header]
    rows = range(fed.num_clients)
    shown = list(rows) if fed.num_clients <= max_rows else list(rows[: max(max_rows - 1, 1)])
    for i in shown:
        c = fed.clients[i]
        group = "-" if c.group is None else str(c.group)
        line = f"{c.cid:>6} {group:>5} {len(c.train):>7} {len(c.val):>6} {len(c.test):>6}"
        if not lm:
            line += f" {int((hist[i] > 0).sum()):>4}  {_compact(hist[i])}"
        lines.append(line)
    if len(shown) < fed.num_clients:
        lines.append(f"... ({fed.num_clients - len(shown)} more clients)")
    sizes = fed.client_sizes()
    if len(sizes):
        lines.append(
            f"train sizes: total={int(sizes.sum())} mean={sizes.mean():.1f} std={sizes.std():.1f} "
            f"min={int(sizes.min())} max={int(sizes.max())}; global test={len(fed.test)}"
        )
    return "\n".join(lines)


def plot_partition(fed: Federation, path: str | Path) -> Path:
    """Save a stacked bar chart of each client's train label histogram (sizes only for LMs) as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    hist = label_histograms(fed)
    k = fed.num_clients
    fig = Figure(figsize=(min(max(6.0, 0.18 * k + 2.0), 30.0), 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(k)
    if hist.shape[1] == 0:
        ax.bar(x, fed.client_sizes(), color="tab:blue", width=0.85)
    else:
        import matplotlib as mpl

        cmap = mpl.colormaps["tab10" if hist.shape[1] <= 10 else "tab20" if hist.shape[1] <= 20 else "turbo"]
        bottom = np.zeros(k)
        for c in range(hist.shape[1]):
            if not hist[:, c].any():
                continue
            colour = cmap(c % 20 if hist.shape[1] <= 20 else c / max(hist.shape[1] - 1, 1))
            label = fed.class_names[c] if fed.class_names and c < len(fed.class_names) else str(c)
            ax.bar(x, hist[:, c], bottom=bottom, color=colour, width=0.85, label=label, linewidth=0)
            bottom += hist[:, c]
        if hist.shape[1] <= 20:
            ax.legend(
                title="class", fontsize=7, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0)
            )
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("client")
    ax.set_ylabel("train samples")
    ax.set_xlim(-0.6, k - 0.4)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # client ids are integers: 0, 5, 10, not 2.5
    tallest = float(np.max(fed.client_sizes() if hist.shape[1] == 0 else hist.sum(axis=1), initial=0))
    ax.set_ylim(0, max(1.0, 1.08 * tallest))  # headroom: the tallest bar does not touch the frame
    ax.set_title(f"{fed.dataset or 'dataset'} — {fed.partition or 'partition'} ({k} clients)")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    return path
