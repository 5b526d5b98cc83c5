"""A run's outputs: metrics.jsonl, TensorBoard events, PNG plots, summary.json."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


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


class RunTracker:
    """Writes one row per round to ``metrics.jsonl`` and TensorBoard; plots and summarises.

    Parameters
    ----------
    run_dir : Path
        The run's output folder.
    tensorboard : bool
        Also write TensorBoard events under ``run_dir/tb`` (skipped with a warning when the
        ``tensorboard`` package is missing, e.g. on a slim accelerator image).
    resume_round : int or None
        When resuming after round r, rows of later rounds are dropped from metrics.jsonl.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_round: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        rows = read_metrics(self.metrics_path) if resume_round is not None else []
        self.rows = [r for r in rows if r.get("round", -1) <= (resume_round if resume_round is not None else -1)]
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in self.rows), encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=(resume_round or -1) + 1)
            except ImportError:
                log.warning("tensorboard is not installed: no TensorBoard events (metrics.jsonl is still written)")

    def log_round(self, row: dict[str, Any]) -> None:
        """Append one round's metrics (flushed at once, so a crash loses nothing logged)."""
        row = {k: _clean(v) for k, v in row.items()}
        self.rows.append(row)
        with self.metrics_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        if self._tb is not None:
            step = row["round"]
            for k, v in row.items():
                if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def plot(self) -> list[Path]:
        """Accuracy-per-round and bytes-per-round PNGs under ``plots/``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out = self.run_dir / "plots"
        out.mkdir(exist_ok=True)
        paths = []
        evals = [r for r in self.rows if r.get("test_acc") is not None]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["round"] + 1 for r in evals], [100 * r["test_acc"] for r in evals], marker=".")
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(self.run_dir.name)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out / "accuracy.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 4))
        rounds = [r["round"] + 1 for r in self.rows]
        ax.plot(rounds, [r.get("bytes_up", 0) / 2**20 for r in self.rows], label="client to server")
        ax.plot(rounds, [r.get("bytes_down", 0) / 2**20 for r in self.rows], label="server to client")
        ax.set_xlabel("round")
        ax.set_ylabel("MiB per round")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out / "bytes.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
        return paths

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2) + "\n", encoding="utf-8")
        return path

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
