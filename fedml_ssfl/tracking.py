"""A run's outputs: metrics.jsonl, TensorBoard events, PNG plots, summary.json.

Rounds are numbered from 1 everywhere a person reads them: the ``round`` of a metrics.jsonl row,
the x-axis of the plots and the TensorBoard step all say "round 1" for the first round (the
runtimes' own loop index starts at 0; checkpoints keep it).

TensorBoard tags are grouped by :func:`metric_tag`: ``test/`` (evaluation), ``comm/`` (what a
round costs: bytes, clients, seconds), ``client/`` (the clients' mean training figures) and
``algo/`` (everything else an algorithm reports). matplotlib and tensorboard are imported only
inside the functions that draw or write events; the run's ``SummaryWriter`` is made when the first
round is logged, so TensorBoard's import (0.3 to 1 s) is not on the path to the first round.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .atomic import atomic_write

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

TB_DIR = "tb"
"""The TensorBoard log folder inside a run folder."""

COMPARE_DIR = "compare"
"""The folder inside a run folder that holds its ``compare_with`` baselines, one run folder each."""

_TAG_NAMES = {"final_test_acc": "test/final_acc", "best_test_acc": "test/best_acc"}
_PREFIX_GROUPS = (("test_", "test/"), ("client_", "client/"))
_COMM_KEYS = frozenset({"clients", "clients_sent", "helpers_sent", "refused_replies", "seconds", "wall_seconds"})
_COMM_PREFIXES = ("c2s_", "s2c_", "seconds_")

FINAL_METRICS = (
    "final_test_acc",
    "best_test_acc",
    "bytes_up_per_round",
    "bytes_down_per_round",
    "wire_bytes_up_per_round",
    "wire_bytes_down_per_round",
    "seconds_per_round",
    "wall_seconds",
)
"""The summary.json figures written as the run's final metrics beside its hparams in TensorBoard."""


def metric_tag(key: str) -> str:
    """The TensorBoard tag of a metrics row key (or a final summary figure): ``group/name``.

    ``test_*`` -> ``test/*``; ``client_*`` -> ``client/*``; bytes, clients taking part, refused
    replies, seconds and FedMatch's ``c2s_*`` / ``s2c_*`` costs -> ``comm/<key>``; anything else
    (learning rate, weight diversity, thresholds, an algorithm's own figures) -> ``algo/<key>``.

    Examples
    --------
    >>> metric_tag("test_acc"), metric_tag("client_mask_rate"), metric_tag("wire_bytes_up"), metric_tag("lr")
    ('test/acc', 'client/mask_rate', 'comm/wire_bytes_up', 'algo/lr')
    """
    if key in _TAG_NAMES:
        return _TAG_NAMES[key]
    for prefix, group in _PREFIX_GROUPS:
        if key.startswith(prefix):
            return group + key[len(prefix) :]
    if key in _COMM_KEYS or "bytes" in key or key.startswith(_COMM_PREFIXES):
        return f"comm/{key}"
    return f"algo/{key}"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file (skipping a torn last line)."""
    rows = []
    p = Path(path)
    if not p.is_file():
        return rows
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def round_numbers(rows: list[dict[str, Any]]) -> list[int]:
    """The 1-based round of each row (rows of runs written before rounds were 1-based start at 0)."""
    shift = 1 if rows and rows[0].get("round") == 0 else 0
    return [int(r.get("round", i)) + shift for i, r in enumerate(rows)]


def flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A sectioned config as ``{"section.key": value}``; lists and mappings as JSON text, None dropped."""
    out: dict[str, Any] = {}
    for section, values in config.items():
        items = values.items() if isinstance(values, Mapping) else [("", values)]
        for key, value in items:
            name = f"{section}.{key}" if key else str(section)
            if value is None:
                continue
            out[name] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value, sort_keys=True)
    return out


# ---------------------------------------------------------------------------------------------
# plots


def round_axis(ax: Axes) -> None:
    """Label the x-axis as rounds, with integer ticks only."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # one round: one tick, at 1
    ax.set_xlabel("round")


def byte_unit(largest: float) -> tuple[str, int]:
    """The unit to show byte counts up to ``largest`` in: ``("MiB", 2**20)``, GiB, KiB, or bytes below 1 KiB."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, size
    return "bytes", 1


def _new_figure(size: tuple[float, float]) -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    return fig, fig.subplots()


MARKED_ROUNDS = 40
"""Up to this many rounds a plot marks each round's point (beyond, markers would hide the lines)."""


def _marker(marker: str, xs: list) -> str | None:
    return marker if len(xs) <= MARKED_ROUNDS else None


def _acc_curve(rows: list[dict[str, Any]], key: str = "test_acc") -> tuple[list[int], list[float]]:
    pairs = [(n, 100 * r[key]) for n, r in zip(round_numbers(rows), rows) if _number(r.get(key))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def accuracy_figure(
    rows: list[dict[str, Any]],
    title: str,
    label: str = "",
    baselines: Mapping[str, list[dict[str, Any]]] | None = None,
) -> Figure:
    """Test accuracy per round of one run, its ``compare_with`` baselines dashed beside it.

    Parameters
    ----------
    rows : list of dict
        The run's metrics rows.
    title : str
        The figure's title (the run folder's name).
    label : str
        The run's legend entry (its algorithm).
    baselines : mapping
        Baseline name -> its metrics rows (``compare/<name>/metrics.jsonl``).
    """
    fig, ax = _new_figure((6.4, 4.2))
    for i, (name, brows) in enumerate((baselines or {}).items()):
        xs, ys = _acc_curve(brows)
        final = f": {ys[-1]:.1f}%" if ys else ": no evaluated round"
        ax.plot(
            xs, ys, "--", marker=_marker(".", xs), linewidth=1.2, color=f"C{i + 1}", label=f"{name} (baseline){final}"
        )
    xs, ys = _acc_curve(rows)
    lo, hi = _acc_curve(rows, "test_acc_min"), _acc_curve(rows, "test_acc_max")
    if lo[0] and lo[0] == hi[0]:
        ax.fill_between(lo[0], lo[1], hi[1], color="C0", alpha=0.15, label="min to max over the clients' models")
    final = f": {ys[-1]:.1f}%" if ys else ""
    ax.plot(
        xs, ys, "-", marker=_marker("o", xs), markersize=4, linewidth=2, color="C0", label=f"{label or title}{final}"
    )
    round_axis(ax)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{title}: test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


DIRECTIONS = (("up", "client to server"), ("down", "server to client"))
"""The bytes plot's two panels: the row keys' suffix and the panel's title."""


def _series(rows: list[dict[str, Any]], key: str) -> list[float] | None:
    """``key``'s value per row (0 where a row lacks it); None when no row has it."""
    if not any(_number(r.get(key)) for r in rows):
        return None
    return [float(r[key]) if _number(r.get(key)) else 0.0 for r in rows]


def bytes_figure(rows: list[dict[str, Any]], title: str) -> Figure:
    """Bytes per round: client to server on the left, server to client on the right.

    Each panel has one bar per round: the algorithm's payload (``bytes_up`` / ``bytes_down``,
    counted the same way in both runtimes), with the client state FedML workers exchange
    (``state_bytes_*``) stacked on it where there is any; the bytes measured on the wire
    (``wire_bytes_*``, FedML runs) are a dashed line, which then runs along the tops of the bars.
    The y-axis starts at 0, in bytes, KiB, MiB or GiB (whichever suits the largest value), and has
    no offset, so a difference of a few bytes looks as small as it is.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.8))
    axes = fig.subplots(1, 2, sharey=True)
    rounds = round_numbers(rows)
    panels = {}
    for d, _ in DIRECTIONS:
        payload = _series(rows, f"bytes_{d}") or [0.0] * len(rows)
        state = _series(rows, f"state_bytes_{d}")
        stacked = [p + s for p, s in zip(payload, state)] if state is not None and any(state) else None
        panels[d] = (payload, stacked, _series(rows, f"wire_bytes_{d}"))
    largest = max((v for series in panels.values() for line in series if line for v in line), default=0.0)
    unit, size = byte_unit(largest)
    width = 0.7 if len(rows) <= MARKED_ROUNDS else 1.0  # many rounds: bars side by side, no gaps to alias
    for ax, (d, name) in zip(axes, DIRECTIONS):
        payload, stacked, wire = ([v / size for v in line] if line else None for line in panels[d])
        ax.bar(rounds, payload, width=width, linewidth=0, color="C0", alpha=0.6, label="algorithm payload")
        if stacked is not None:
            extra = [t - p for t, p in zip(stacked, payload)]
            ax.bar(
                rounds, extra, width=width, bottom=payload, linewidth=0, color="C2", alpha=0.6, label="+ client state"
            )
        if wire is not None:
            ax.plot(rounds, wire, "--", color="black", marker=_marker("x", rounds), label="wire (measured)")
        round_axis(ax)
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", ncols=2)  # in the headroom above the bars
    axes[0].set_ylim(0, 1.35 * largest / size if largest > 0 else 1)
    axes[0].set_ylabel(f"{unit} per round")
    fig.suptitle(f"{title}: bytes per round")
    fig.tight_layout()
    return fig


def baseline_rows(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The metrics rows of each baseline under ``run_dir/compare/`` (name -> rows), sorted by name."""
    folder = Path(run_dir) / COMPARE_DIR
    if not folder.is_dir():
        return {}
    found = {p.name: read_metrics(p / "metrics.jsonl") for p in sorted(folder.iterdir()) if p.is_dir()}
    return {name: rows for name, rows in found.items() if rows}


def plot_run(run_dir: str | Path, label: str = "", rows: list[dict[str, Any]] | None = None) -> list[Path]:
    """Write ``plots/accuracy.png`` (with the baselines under ``compare/``) and ``plots/bytes.png``.

    Parameters
    ----------
    run_dir : path
        The run folder.
    label : str
        The run's legend entry (its algorithm); default the folder's name.
    rows : list of dict, optional
        The run's metrics rows; default read from ``metrics.jsonl``.

    Returns
    -------
    list of Path
        The PNGs written.
    """
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl") if rows is None else rows
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    figures = {
        "accuracy.png": accuracy_figure(rows, run_dir.name, label, baseline_rows(run_dir)),
        "bytes.png": bytes_figure(rows, run_dir.name),
    }
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=100)
    return [out / name for name in figures]


# ---------------------------------------------------------------------------------------------
# the run's writer


def _summary_writer(log_dir: Path, purge_step: int | None = None) -> Any:
    """A TensorBoard ``SummaryWriter``, or None (with a warning) when tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("tensorboard is not installed: no TensorBoard events (metrics.jsonl is still written)")
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


class RunTracker:
    """Writes one row per round to ``metrics.jsonl`` and TensorBoard; plots and summarises.

    Parameters
    ----------
    run_dir : Path
        The run's output folder.
    tensorboard : bool
        Also write TensorBoard events under ``run_dir/tb`` (skipped with a warning when the
        ``tensorboard`` package is missing, e.g. on a slim accelerator image). The writer is made
        when the first round is logged, not here: importing TensorBoard stays off the path to the
        first round (issue 15).
    resume_after : int or None
        When resuming a run that completed this many rounds, rows of later rounds are dropped
        from metrics.jsonl (and TensorBoard events of later steps are purged).
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_after: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.tensorboard = tensorboard
        rows = read_metrics(self.metrics_path) if resume_after is not None else []
        self.rows = [r for r, n in zip(rows, round_numbers(rows)) if n <= (resume_after or 0)]
        text = "".join(json.dumps(r) + "\n" for r in self.rows).encode("utf-8")
        atomic_write(self.metrics_path, lambda fh: fh.write(text))  # a crash here keeps every saved row
        self._tb = None
        self._tb_due = tensorboard  # the writer is made at the first event written (see _writer)
        self._purge_step = resume_after + 1 if resume_after is not None else None
        self._config_text: tuple[str, float] | None = None  # (text, wall time) not written yet

    def _writer(self) -> Any:
        """The run's ``SummaryWriter``, made on first use; None when TensorBoard is off or missing.

        Made lazily (at the first :meth:`log_round`, or at :meth:`close`) so that importing
        TensorBoard is not on the path to the first round; the config text logged before then is
        written first, at step 0 with the wall time it was logged at.
        """
        if self._tb_due:
            self._tb_due = False
            self._tb = _summary_writer(self.run_dir / TB_DIR, purge_step=self._purge_step)
        if self._tb is not None and self._config_text is not None:
            text, walltime = self._config_text
            self._config_text = None
            self._tb.add_text("config", text, 0, walltime=walltime)
            self._tb.flush()
        return self._tb

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The resolved config (a sectioned mapping) as TensorBoard text, tag ``config``, step 0.

        Kept until the writer is made (the first :meth:`log_round`), then written first.
        """
        if not self.tensorboard:
            return
        import yaml

        text = yaml.safe_dump(dict(config), sort_keys=False)
        self._config_text = ("".join(f"    {line}\n" for line in text.splitlines()), time.time())
        if self._tb is not None:  # the writer exists already: write it now
            self._writer()

    def log_round(self, row: dict[str, Any]) -> None:
        """Append one round's metrics (flushed at once, so a crash loses nothing logged).

        ``row["round"]`` is the 1-based round; it is the TensorBoard step.
        """
        row = {k: _clean(v) for k, v in row.items()}
        self.rows.append(row)
        with self.metrics_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        writer = self._writer()
        if writer is not None:
            step = row["round"]
            for k, v in row.items():
                if k != "round" and _number(v):
                    writer.add_scalar(metric_tag(k), v, step)
            writer.flush()

    def write_hparams(self, config: Mapping[str, Any], summary: Mapping[str, Any]) -> None:
        """The run's hparams (the flattened config) and its final metrics (:data:`FINAL_METRICS`).

        Written to TensorBoard's hparams plugin as this run's session (no experiment summary, so
        TensorBoard builds the comparison table from every run under ``--logdir``); the final
        metrics are scalars at the last round's step, tagged by :func:`metric_tag`.
        """
        if not self.tensorboard:
            return
        writer = _summary_writer(self.run_dir / TB_DIR)
        if writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        step = max(round_numbers(self.rows), default=0)
        metrics = {metric_tag(k): float(summary[k]) for k in FINAL_METRICS if _number(summary.get(k))}
        _, start, end = hparams(flat_config(config), metrics)
        with writer:
            writer.file_writer.add_summary(start, step)
            writer.file_writer.add_summary(end, step)
            for tag, value in metrics.items():
                writer.add_scalar(tag, value, step)

    def plot(self, label: str = "") -> list[Path]:
        """Accuracy-per-round and bytes-per-round PNGs under ``plots/`` (see :func:`plot_run`)."""
        return plot_run(self.run_dir, label, self.rows)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2) + "\n", encoding="utf-8")
        return path

    def close(self) -> None:
        """Close the TensorBoard writer (made now when no round was logged, so the config is written)."""
        if self._tb_due and not self.run_dir.is_dir():  # the run folder went away: re-create nothing in it
            self._tb_due = False
        try:
            writer = self._writer()
            if writer is not None:
                writer.close()
        except OSError as exc:  # close runs in a run's finally: never replace the run's own error
            log.warning("could not write the TensorBoard events under %s: %s", self.run_dir / "tb", exc)
        self._tb = None
