"""``fedml-ssfl report RUN_DIR [RUN_DIR ...]``: compare finished runs in one table and one plot.

The papers present SSFL results as one table of final test accuracy per method (with the
server-only lower bound beside them) and accuracy-versus-round curves. :func:`report_runs` reads
each run directory written by the runtime (``summary.json``, ``metrics.jsonl``, ``config.yaml``)
and produces both. A run made by ``fedml-ssfl run`` keeps its baselines under
``compare/<name>/``; those are included automatically, so ``fedml-ssfl report runs/x`` shows the
method beside server-only from the same split. The plot has one line per run on a 0-100% axis with
the chance level dotted, titled with the runs' names; each legend entry (below the plot) names the
run folder, its runtime, seed and the settings that set it apart from the other runs. The table gives
each run's wall-clock runtime and its status ("failed", "stopped", ...), and "-" where a figure is
missing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .atomic import atomic_write
from .tracking import (
    accuracy_axis,
    class_count,
    dataset_name,
    flat_config,
    legend_below,
    new_figure,
    read_metrics,
    round_axis,
    round_numbers,
    runtime_name,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REFERENCE = "server_only"
"""The baseline every row's gain is measured against (the lower bound of Bian et al., Diao et al.)."""


@dataclass
class RunRecord:
    """What the report needs from one run directory."""

    path: Path
    algorithm: str
    dataset: str
    model: str
    num_labels: int | None
    split: tuple[Any, ...]
    clients: str
    seed: int | None
    rounds_done: int
    comm_round: int | None
    final_acc: float
    best_acc: float
    mib_up_per_round: float
    seconds_per_round: float
    status: str
    wall_seconds: float = float("nan")
    curve: list[tuple[int, float]] = field(default_factory=list)
    parent: Path | None = None
    label: str = ""
    runtime: str = "local"
    num_classes: int | None = None
    dataset_label: str = "-"
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def run_name(self) -> str:
        """The run folder's name (a baseline's as ``<run>/<baseline>``)."""
        return f"{self.parent.name}/{self.path.name}" if self.parent is not None else self.path.name

    @property
    def split_key(self) -> tuple[Any, ...]:
        """Runs with equal keys were trained on the same data split."""
        return (self.dataset, self.num_labels, self.clients, self.seed, *self.split)


def _read_mapping(path: Path, parse: Any) -> dict[str, Any]:
    """A JSON/YAML file's top-level mapping, or ``{}`` when it is missing or unreadable."""
    if not path.is_file():
        return {}
    try:
        data = parse(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")


def load_run(path: Path, parent: Path | None = None) -> RunRecord:
    """Read one run directory into a :class:`RunRecord`.

    Raises
    ------
    FileNotFoundError
        When ``path`` holds neither ``metrics.jsonl`` nor ``summary.json``.
    """
    path = Path(path)
    summary = _read_mapping(path / "summary.json", json.loads)
    rows = read_metrics(path / "metrics.jsonl")
    if not summary and not rows:
        raise FileNotFoundError(f"{path}: not a run directory (no summary.json or metrics.jsonl)")
    cfg = _read_mapping(path / "config.yaml", yaml.safe_load)
    sect = {k: (v if isinstance(v, dict) else {}) for k, v in cfg.items()}
    data, train, common = sect.get("data_args", {}), sect.get("train_args", {}), sect.get("common_args", {})
    model = sect.get("model_args", {})
    curve = [(n, float(r["test_acc"])) for n, r in zip(round_numbers(rows), rows) if r.get("test_acc") is not None]
    accs = [a for _, a in curve]
    done = len(rows) or int(summary.get("rounds_completed", 0) or 0)
    up = [r.get("bytes_up", 0) or 0 for r in rows]
    secs = [r.get("seconds", 0.0) or 0.0 for r in rows]
    algorithm = sect.get("ssfl_args", {}).get("algorithm") or summary.get("algorithm") or "-"
    k, ck = train.get("client_num_in_total"), train.get("client_num_per_round")
    final = _num(summary.get("final_test_acc")) if "final_test_acc" in summary else float("nan")
    if math.isnan(final) and accs:
        final = accs[-1]
    best = _num(summary.get("best_test_acc")) if "best_test_acc" in summary else float("nan")
    if math.isnan(best) and accs:
        best = max(accs)
    up_round = _num(summary.get("bytes_up_per_round")) if "bytes_up_per_round" in summary else float("nan")
    if math.isnan(up_round):
        up_round = sum(up) / len(up) if up else float("nan")
    s_round = _num(summary.get("seconds_per_round")) if "seconds_per_round" in summary else float("nan")
    if math.isnan(s_round):
        s_round = sum(secs) / len(secs) if secs else float("nan")
    model_name = summary.get("model") or (f"{model.get('model')}-{model.get('norm')}" if model.get("model") else "-")
    return RunRecord(
        path=path,
        algorithm=str(algorithm),
        dataset=str(data.get("dataset") or summary.get("dataset") or "-"),
        model=str(model_name),
        num_labels=data.get("num_server_labels"),
        split=tuple(
            data.get(k)
            for k in (
                "num_server_val",
                "partition_method",
                "non_iid_r",
                "partition_alpha",
                "classes_per_client",
                "label_scenario",
            )
        ),
        clients=f"{k}/{ck}" if k is not None else "-",
        seed=common.get("random_seed"),
        rounds_done=done,
        comm_round=train.get("comm_round") or summary.get("comm_round"),
        final_acc=final,
        best_acc=best,
        mib_up_per_round=up_round / 2**20,
        seconds_per_round=s_round,
        status=str(summary.get("status") or "running"),
        wall_seconds=_num(summary.get("wall_seconds")),
        curve=curve,
        parent=parent,
        runtime=runtime_name(cfg, summary),
        num_classes=class_count(summary),
        dataset_label=dataset_name(cfg) if cfg else str(summary.get("dataset") or "-"),
        settings=flat_config(cfg),
    )


def collect_runs(run_dirs: list[Path], include_compare: bool = True) -> list[RunRecord]:
    """The runs to report: each directory's ``compare/*`` baselines first, then the run itself.

    A directory given twice (or also reached as a baseline) is reported once.
    """
    records: list[RunRecord] = []
    seen: set[Path] = set()
    for given in run_dirs:
        path = Path(given).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such run directory")
        subs = (
            sorted(p for p in (path / "compare").iterdir() if p.is_dir())
            if include_compare and (path / "compare").is_dir()
            else []
        )
        for sub in subs:
            key = sub.resolve()
            if key not in seen and ((sub / "summary.json").is_file() or (sub / "metrics.jsonl").is_file()):
                seen.add(key)
                records.append(load_run(sub, parent=path))
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            records.append(load_run(path))
    names = [r.algorithm for r in records]
    for r in records:
        r.label = r.algorithm if names.count(r.algorithm) == 1 else f"{r.algorithm} [{_short(r)}]"
    return records


def _short(r: RunRecord) -> str:
    return f"{r.parent.name}/{r.path.name}" if r.parent is not None else r.path.name


def _reference_for(r: RunRecord, records: list[RunRecord]) -> RunRecord | None:
    """The server-only run from the same split: the same parent run's first, else any match."""
    if r.algorithm == REFERENCE:
        return None
    candidates = [x for x in records if x.algorithm == REFERENCE and x.split_key == r.split_key]
    own = [x for x in candidates if x.parent is not None and x.parent == r.path]
    chosen = own or candidates
    return chosen[0] if chosen else None


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.2f}%"


def _fixed(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def format_duration(seconds: float) -> str:
    """``42.0s``, ``3m07s``, ``2h05m``; ``-`` when unknown."""
    if math.isnan(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m{int(seconds % 60):02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def format_table(records: list[RunRecord]) -> str:
    """The comparison table: one row per run, final and best accuracy, gain over server-only,
    upload per round, seconds per round, the run's wall-clock runtime and its status.

    A figure a run does not have (a failed run's accuracy, a runtime older runs did not record)
    reads ``-``.
    """
    width = max([len("method"), *(len(r.label) for r in records)]) + 2
    head = (
        f"{'method':<{width}}{'dataset':<12}{'model':<12}{'labels':>7}{'K/C_k':>8}{'rounds':>9}"
        f"{'final acc':>11}{'best acc':>10}{'vs ' + REFERENCE:>16}{'MiB up/rnd':>12}{'s/round':>9}"
        f"{'runtime':>9}  status"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        ref = _reference_for(r, records)
        gain = (
            ""
            if ref is None or math.isnan(ref.final_acc) or math.isnan(r.final_acc)
            else (f"{100 * (r.final_acc - ref.final_acc):+.2f} pts")
        )
        rounds = f"{r.rounds_done}/{r.comm_round}" if r.comm_round else str(r.rounds_done)
        lines.append(
            f"{r.label:<{width}}{r.dataset:<12}{r.model:<12}{_text(r.num_labels):>7}{r.clients:>8}{rounds:>9}"
            f"{_pct(r.final_acc):>11}{_pct(r.best_acc):>10}{gain:>16}"
            f"{_fixed(r.mib_up_per_round):>12}{_fixed(r.seconds_per_round):>9}"
            f"{format_duration(r.wall_seconds):>9}  {r.status}"
        )
    notes = [f"  {r.label}: {r.status}, {r.path}" for r in records]
    return "\n".join([*lines, "", "runs:", *notes])


SHOWN_ELSEWHERE = (
    "common_args.run_name",
    "common_args.output_dir",
    "common_args.run_id",
    "common_args.compare_with",
    "common_args.random_seed",
    "common_args.training_type",
    "ssfl_args.algorithm",
    "device_args.using_gpu",
    "device_args.gpu_id",
    "device_args.gpu_mapping_file",
    "device_args.gpu_mapping_key",
    "device_args.num_threads",
    "device_args.state_memory_mb",
    "device_args.state_spill_dir",
    "device_args.data_on_device",
)
"""Config keys a legend entry never lists as a difference: names and folders, what it always shows (seed,
algorithm, the runtime: ``training_type`` and every ``comm_args`` key but ``mode``) and where a run kept its
memory and threads, which change no result."""

MAX_DIFFERENCES = 3
"""At most this many differing settings in one legend entry (then ``+N more``)."""


def _transport_key(key: str) -> bool:
    """A ``comm_args`` key other than ``mode``: how the runtime talks (backend, addresses, TLS files)."""
    return key.startswith("comm_args.") and key != "comm_args.mode"


def differences(records: list[RunRecord]) -> dict[int, list[str]]:
    """The settings that set each run apart from the others: ``id(record) -> ["key=value", ...]``.

    A key counts when the runs that have it do not all agree; keys some run lacks (an older config)
    and :data:`SHOWN_ELSEWHERE` do not. ``ssfl_args`` keys are compared only between runs of the same
    algorithm (two algorithms' own settings are not a difference worth a legend). Keys are shown by
    their last part (``threshold=0.95``).
    """
    out: dict[int, list[str]] = {id(r): [] for r in records}
    keys = sorted(set().union(*(r.settings for r in records))) if records else []
    for key in keys:
        if key in SHOWN_ELSEWHERE or key.startswith("tracking_args.") or _transport_key(key):
            continue
        groups = [records]
        if key.startswith("ssfl_args."):
            groups = [[r for r in records if r.algorithm == a] for a in dict.fromkeys(r.algorithm for r in records)]
        for group in groups:
            if len(group) < 2 or any(key not in r.settings for r in group):
                continue
            if len({json.dumps(r.settings[key]) for r in group}) > 1:
                for r in group:
                    out[id(r)].append(f"{key.rsplit('.', 1)[-1]}={r.settings[key]}")
    return out


def legend_label(r: RunRecord, differing: list[str] | None = None) -> str:
    """A run's legend entry: its run name, then in brackets its algorithm (when the name lacks it), runtime,
    seed and the settings that set it apart (``differing``, from :func:`differences`), then its final
    accuracy or status."""
    parts = [] if r.algorithm in r.run_name else [r.algorithm]
    parts.append(r.runtime)
    if r.seed is not None:
        parts.append(f"seed {r.seed}")
    shown = list(differing or [])
    parts += shown[:MAX_DIFFERENCES]
    if len(shown) > MAX_DIFFERENCES:
        parts.append(f"+{len(shown) - MAX_DIFFERENCES} more")
    name = f"{r.run_name} ({', '.join(parts)})"
    if r.curve:
        return f"{name}: {_pct(r.final_acc)}" + ("" if r.status == "completed" else f", {r.status}")
    return f"{name}: {r.status}, no evaluated round"


TITLE_CHARS = 60
"""A title lists the compared runs' names up to about this many characters (then ``and N other runs``)."""


def figure_title(records: list[RunRecord]) -> str:
    """The compare plot's title: the names of the runs given (their baselines aside), then the datasets."""
    names = list(dict.fromkeys(r.path.name for r in records if r.parent is None)) or [r.run_name for r in records[:1]]
    head = ", ".join(names)
    if len(names) > 1 and len(head) > TITLE_CHARS:
        head = f"{names[0]} and {len(names) - 1} other runs"
    datasets = ", ".join(dict.fromkeys(r.dataset_label for r in records if r.dataset_label != "-"))
    return f"{head}: test accuracy" + (f"\non {datasets}" if datasets else "")


def accuracy_figure(records: list[RunRecord]) -> Figure:
    """Test accuracy per round, one line per run (a run with no evaluated round: a legend entry).

    0 to 100% with the chance level of each run's class count dotted (runs written before
    summary.json recorded ``num_classes`` draw none); the legend below the axes, one entry per run
    (:func:`legend_label`); the title names the runs (:func:`figure_title`).
    """
    fig, ax = new_figure(7, 4.5, entries=len(records) + 1)
    differing = differences(records)
    for r in records:
        xs, ys = zip(*r.curve) if r.curve else ((), ())
        style = "--" if r.algorithm == REFERENCE else "-"
        label = legend_label(r, differing[id(r)])
        ax.plot(xs, [100 * y for y in ys], style, marker="." if len(xs) < 40 else None, label=label)
    round_axis(ax)
    accuracy_axis(ax, [r.num_classes for r in records])
    ax.set_title(figure_title(records), fontsize=10)
    ax.grid(alpha=0.3)
    legend_below(fig, [ax])
    return fig


def plot_accuracy(records: list[RunRecord], out: Path) -> Path:
    """Write :func:`accuracy_figure` to ``out`` (a PNG); returns the path."""
    fig = accuracy_figure(records)
    return atomic_write(out, lambda fh: fig.savefig(fh, format="png", dpi=110))


def report_runs(run_dirs: list[Path], out: Path | None = None, include_compare: bool = True) -> str:
    """Compare runs: return the table text and write one accuracy-vs-round PNG.

    Parameters
    ----------
    run_dirs : list of Path
        Run directories (``runs/<name>``); each one's ``compare/*`` baselines are included
        unless ``include_compare`` is false.
    out : Path, optional
        The PNG to write (a directory gets ``accuracy_vs_round.png`` inside). Default:
        ``<first run>/plots/compare_accuracy.png``.
    include_compare : bool
        Include the baselines stored under each run's ``compare/``.

    Returns
    -------
    str
        The table, the list of runs, and a last line ``plot: <path>``.

    Raises
    ------
    FileNotFoundError
        A path that is not a run directory.
    ValueError
        No run directory given.
    """
    if not run_dirs:
        raise ValueError("report: give at least one run directory")
    records = collect_runs([Path(p) for p in run_dirs], include_compare)
    if out is None:
        png = Path(run_dirs[0]).expanduser() / "plots" / "compare_accuracy.png"
    else:
        out = Path(out).expanduser()
        png = out / "accuracy_vs_round.png" if out.is_dir() or not out.suffix else out
    plot_accuracy(records, png)
    return f"{format_table(records)}\nplot: {png}"
