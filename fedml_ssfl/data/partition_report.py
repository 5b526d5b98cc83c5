"""Human-readable summaries of a :class:`~fedml_ssfl.data.partition.Split`: a text table and a heat-map."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedml_ssfl.atomic import atomic_write
from fedml_ssfl.data.partition import Split


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


def save_partition_heatmap(split: Split, labels: torch.Tensor, path: str | Path, title: str = "") -> Path:
    """Save a clients x classes heat-map of sample counts as a PNG.

    Labels-at-client splits get two panels, unlabeled and labeled counts; others one panel of all
    of each client's samples. Uses matplotlib's Agg canvas directly (no global backend change, no
    display needed).

    Parameters
    ----------
    split : Split
        The partition.
    labels : torch.Tensor
        The train labels.
    path : str or Path
        Output file; parent folders are created.
    title : str
        Figure title; the measured R is appended.

    Returns
    -------
    Path
        The written file.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [("unlabeled", "unlabeled"), ("labeled", "labeled")] if split.scenario == "client" else [("all", "")]
    k, d = split.num_clients, split.num_classes
    fig = Figure(figsize=(len(panels) * max(4.0, 0.35 * d + 2.0), max(3.0, 0.3 * k + 1.5)))
    FigureCanvasAgg(fig)
    measured = f"R = {split.measured_r(labels):.3f}"
    for i, (which, name) in enumerate(panels):
        hist = split.class_histograms(labels, which)
        ax = fig.add_subplot(1, len(panels), i + 1)
        image = ax.imshow(hist if k else np.zeros((1, d)), aspect="auto", cmap="viridis", interpolation="nearest")
        fig.colorbar(image, ax=ax, label=f"{name} samples".strip())
        ax.set_xlabel("class")
        ax.set_ylabel("client")
        head = f"{title}  ({measured})" if title else measured
        ax.set_title(f"{head}\n{name}" if name else head)
    return atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=100, bbox_inches="tight"))
