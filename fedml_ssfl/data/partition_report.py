"""Human-readable summaries of a :class:`~fedml_ssfl.data.partition.Split`: a text table and a heat-map."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedml_ssfl.atomic import atomic_write
from fedml_ssfl.data.partition import Split

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _size(t: torch.Tensor) -> int:
    return int(t.numel())


def _header_lines(split: Split, labels: torch.Tensor) -> list[str]:
    """Sizes of the server sets, the clients' totals and the non-iid level."""
    assigned = _size(split.server_labeled) + _size(split.server_val)
    assigned += sum(_size(u) + _size(lab) for u, lab in zip(split.client_unlabeled, split.client_labeled))
    total = int(labels.numel())
    lines = [
        f"partition: method={split.method} scenario={split.scenario} clients={split.num_clients} "
        f"classes={split.num_classes}",
        f"server labeled: {_size(split.server_labeled)}   server validation: {_size(split.server_val)}",
        f"train samples: {total}   assigned: {assigned}   unassigned: {total - assigned}",
    ]
    r_line = f"non-iid level R (Zhang et al. Eq. 1), measured: {split.measured_r(labels):.4f}"
    if split.requested_r is not None:
        r_line += f"   requested: {split.requested_r:.4f}"
    lines.append(r_line)
    if split.scenario == "client" and split.num_clients:
        lab = np.array([_size(t) for t in split.client_labeled], dtype=np.float64)
        tot = lab + np.array([_size(t) for t in split.client_unlabeled], dtype=np.float64)
        ratio = np.divide(lab, tot, out=np.zeros_like(lab), where=tot > 0)
        classes = (split.class_histograms(labels, "labeled") > 0).sum(axis=1)
        lines.append(
            f"client labeled fraction: min {ratio.min():.3f}  mean {ratio.mean():.3f}  max {ratio.max():.3f}   "
            f"labeled classes per client: {int(classes.min())}..{int(classes.max())}"
        )
    if split.streaming:
        last = (split.num_stages - 1) * split.rounds_per_stage
        sizes = np.stack([split.stage_sizes(k) for k in range(split.num_clients)]) if split.num_clients else None
        size_text = f"{int(sizes.min())}..{int(sizes.max())}" if sizes is not None and sizes.size else "0"
        lines.append(
            f"streaming: {split.num_stages} stages of each client's unlabeled data, stage s released at round "
            f"s * {split.rounds_per_stage} (all out from round {last}, cumulative); stage sizes {size_text}"
        )
    return lines


def _table_lines(split: Split, labels: torch.Tensor, class_names: list[str], which: str = "all") -> list[str]:
    """One row per client: sizes and the per-class histogram of its ``which`` samples."""
    hist = split.class_histograms(labels, which)
    names = [str(n)[:8] for n in class_names] if class_names else [str(c) for c in range(split.num_classes)]
    width = max(6, *(len(n) for n in names), len(str(int(hist.max(initial=0)))))
    head = f"{'client':>6} {'unlab':>7} {'lab':>6} | " + " ".join(f"{n:>{width}}" for n in names)
    lines = [head, "-" * len(head)]
    for k in range(split.num_clients):
        counts = " ".join(f"{int(v):>{width}}" for v in hist[k])
        lines.append(f"{k:>6} {_size(split.client_unlabeled[k]):>7} {_size(split.client_labeled[k]):>6} | {counts}")
    return lines


def partition_report(split: Split, labels: torch.Tensor, class_names: list[str]) -> str:
    """A text report of a split.

    Parameters
    ----------
    split : Split
        The partition.
    labels : torch.Tensor
        The train labels its indices point into.
    class_names : list of str
        Column headers (truncated to 8 characters).

    Returns
    -------
    str
        Server labeled/validation sizes, assigned and unassigned counts, measured R (and the
        requested R for method ``"r"``); labels-at-client: the clients' labeled fractions;
        streaming: the stage schedule. Then a table of per-client sizes (unlabeled, labeled)
        and class histograms of all their samples, and, labels-at-client, a second table with
        the class histograms of the labeled samples only.
    """
    lines = _header_lines(split, labels) + [""] + _table_lines(split, labels, class_names)
    if split.scenario == "client":
        lines += ["", "labeled samples only:"] + _table_lines(split, labels, class_names, "labeled")
    return "\n".join(lines) + "\n"


NAMED_TICKS = 30
"""Up to this many clients (classes) the heat-map ticks every one (and names every class); beyond, a few."""

COUNTED_CELLS = 20
"""Up to this many clients and this many classes each cell also shows its count."""


def partition_heatmap(
    split: Split, labels: torch.Tensor, title: str = "", class_names: list[str] | None = None
) -> Figure:
    """A clients x classes heat-map of sample counts (a matplotlib figure, drawn on the Agg canvas).

    Labels-at-client splits get two panels, unlabeled and labeled counts; others one panel of all of
    each client's samples. Each colour scale starts at 0, so an even (IID) split reads as even;
    clients are ticked by their integer ids, classes by their names, and small grids print each
    cell's count.

    Parameters
    ----------
    split : Split
        The partition.
    labels : torch.Tensor
        The train labels.
    title : str
        The first line of the title (e.g. the run's name and the split); the measured R follows.
    class_names : list of str, optional
        The x-axis tick labels; default the class indices.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = [("unlabeled", "unlabeled samples"), ("labeled", "labeled samples")]
    if split.scenario != "client":
        panels = [("all", "samples")]
    k, d = split.num_clients, split.num_classes
    names = [str(n) for n in class_names] if class_names and len(class_names) == d else [str(c) for c in range(d)]
    slanted = any(len(n) > 2 for n in names)
    width = len(panels) * max(4.5, (0.32 if not slanted else 0.4) * min(d, NAMED_TICKS) + 2.5)
    fig = Figure(figsize=(width, max(3.4, 0.3 * min(k, 40) + 2.0)), layout="constrained")
    FigureCanvasAgg(fig)
    measured = f"measured non-IID level R = {split.measured_r(labels):.3f}"
    fig.suptitle(f"{title}\n{measured}" if title else measured, fontsize=10)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (which, name) in zip(axes, panels):
        hist = split.class_histograms(labels, which) if k else np.zeros((1, d))
        top = max(float(hist.max(initial=0)), 1.0)
        image = ax.imshow(hist, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0, vmax=top)
        bar = fig.colorbar(image, ax=ax, label=f"{name} per client and class")
        bar.locator = MaxNLocator(integer=True)
        bar.update_ticks()
        if d <= NAMED_TICKS:
            ax.set_xticks(range(d), names, rotation=45 if slanted else 0, ha="right" if slanted else "center")
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if k <= NAMED_TICKS:
            ax.set_yticks(range(max(k, 1)))
        else:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if 0 < k <= COUNTED_CELLS and d <= COUNTED_CELLS:
            for (row, col), count in np.ndenumerate(hist):
                light = count > 0.6 * top  # viridis is yellow at the top of the scale
                ax.text(col, row, int(count), ha="center", va="center", fontsize=7, color="black" if light else "white")
        ax.set_xlabel("class")
        ax.set_ylabel("client")
        if len(panels) > 1:
            ax.set_title(name, fontsize=9)
    return fig


def save_partition_heatmap(
    split: Split, labels: torch.Tensor, path: str | Path, title: str = "", class_names: list[str] | None = None
) -> Path:
    """Save :func:`partition_heatmap` as a PNG (parent folders are created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = partition_heatmap(split, labels, title, class_names)
    return atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=100))
