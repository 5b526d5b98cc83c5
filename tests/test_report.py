"""``fedml-ssfl report``: one table and one accuracy-vs-round plot comparing run directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedml_ssfl.report import accuracy_figure, collect_runs, format_duration, report_runs
from tests.test_plots import assert_legend_outside_the_axes


def _fake_run(
    path: Path,
    algorithm: str,
    accs: list[float],
    labels: int = 50,
    seed: int = 0,
    summary: bool = True,
    bytes_up: int = 2**20,
) -> Path:
    path.mkdir(parents=True)
    cfg = {
        "common_args": {"random_seed": seed, "run_name": path.name},
        "data_args": {"dataset": "mnist5k", "num_server_labels": labels},
        "model_args": {"model": "cnn28", "norm": "bn"},
        "train_args": {"client_num_in_total": 10, "client_num_per_round": 10, "comm_round": len(accs)},
        "ssfl_args": {"algorithm": algorithm},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"round": r, "bytes_up": bytes_up, "seconds": 2.0, "test_acc": a} for r, a in enumerate(accs, start=1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary:
        (path / "summary.json").write_text(
            json.dumps(
                {
                    "status": "completed",
                    "algorithm": algorithm,
                    "dataset": "mnist5k",
                    "model": "cnn28-bn",
                    "final_test_acc": accs[-1],
                    "best_test_acc": max(accs),
                    "bytes_up_per_round": float(bytes_up),
                    "seconds_per_round": 2.0,
                    "rounds_completed": len(accs),
                    "wall_seconds": 2.5 * len(accs),
                }
            )
        )
    return path


def test_report_includes_baselines_from_the_same_split(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "semi", "semifl", [0.6, 0.8, 0.92])
    _fake_run(run / "compare" / "server_only", "server_only", [0.5, 0.7, 0.8], bytes_up=0)
    out = tmp_path / "cmp.png"
    text = report_runs([run], out)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["method", "dataset", "model"]
    rows = {line.split()[0]: line for line in lines[2:4]}
    assert list(rows) == ["server_only", "semifl"]  # baseline first, as the papers' tables
    assert "92.00%" in rows["semifl"] and "+12.00 pts" in rows["semifl"]
    assert "80.00%" in rows["server_only"] and "pts" not in rows["server_only"]
    assert "1.00" in rows["semifl"] and "3/3" in rows["semifl"]
    assert lines[-1] == f"plot: {out}"
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_compares_several_runs_and_marks_duplicates(tmp_path: Path) -> None:
    a = _fake_run(tmp_path / "a", "fedseal", [0.7, 0.85])
    b = _fake_run(tmp_path / "b", "semifl", [0.7, 0.9])
    c = _fake_run(tmp_path / "c", "semifl", [0.6, 0.88], summary=False)  # still running: metrics only
    _fake_run(a / "compare" / "server_only", "server_only", [0.6, 0.75])
    text = report_runs([a, b, c, a], tmp_path / "plots")  # a directory gets a default file name
    assert (tmp_path / "plots" / "accuracy_vs_round.png").is_file()
    records = collect_runs([a, b, c])
    assert [r.label for r in records] == ["server_only", "fedseal", "semifl [b]", "semifl [c]"]
    assert records[3].final_acc == pytest.approx(0.88) and records[3].status == "running"
    # every run from the same split is measured against the one server-only run
    assert "+10.00 pts" in text and "+15.00 pts" in text and "+13.00 pts" in text
    assert text.count("fedseal  ") == 1  # the directory given twice appears once


def test_report_default_plot_path_and_errors(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "r", "semifl", [0.5])
    text = report_runs([run], None)
    assert (run / "plots" / "compare_accuracy.png").is_file()
    assert text.endswith(str(run / "plots" / "compare_accuracy.png"))
    other = _fake_run(tmp_path / "other_split", "server_only", [0.4], labels=250)
    assert "pts" not in report_runs([other, run], tmp_path / "x.png").splitlines()[3]  # different split
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        report_runs([tmp_path / "missing"], None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        report_runs([tmp_path / "empty"], None)
    with pytest.raises(ValueError):
        report_runs([], None)


def test_report_table_has_runtime_and_a_readable_status_never_nan(tmp_path: Path) -> None:
    done = _fake_run(tmp_path / "done", "semifl", [0.6, 0.8])
    summary = json.loads((done / "summary.json").read_text())
    (done / "summary.json").write_text(json.dumps({**summary, "wall_seconds": 125.0}))
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "config.yaml").write_text((done / "config.yaml").read_text())
    (failed / "summary.json").write_text(json.dumps({"status": "failed", "error": "boom", "wall_seconds": 3.0}))
    running = _fake_run(tmp_path / "running", "fedseal", [0.5], summary=False)
    text = report_runs([done, failed, running], tmp_path / "x.png")
    assert "nan" not in text.lower(), text
    head, _, *rows = text.splitlines()[:5]
    assert head.split()[-2:] == ["runtime", "status"]
    by_dir = {line.split()[1].strip("[]"): line.split() for line in rows if "[" in line}
    assert by_dir["done"][-2:] == ["2m05s", "completed"]
    assert by_dir["failed"][-2:] == ["3.0s", "failed"]
    assert by_dir["failed"][-6:-2] == ["-"] * 4  # final and best accuracy, MiB up, s/round
    running_row = next(line.split() for line in rows if line.startswith("fedseal"))
    assert running_row[-2:] == ["-", "running"]  # no summary.json yet: no runtime
    assert [format_duration(s) for s in (42.0, 3727.0, float("nan"))] == ["42.0s", "1h02m", "-"]


def test_report_plot_has_one_line_per_run_named_after_it_and_integer_rounds(tmp_path: Path) -> None:
    a = _fake_run(tmp_path / "mnist5k_semifl", "semifl", [0.6, 0.8, 0.9])
    _fake_run(a / "compare" / "server_only", "server_only", [0.5, 0.6, 0.7])
    b = _fake_run(tmp_path / "other", "fedseal", [0.4, 0.7, 0.75])
    failed = tmp_path / "broken"
    failed.mkdir()
    (failed / "summary.json").write_text(json.dumps({"status": "failed", "algorithm": "semifl"}))
    fig = accuracy_figure(collect_runs([a, b, failed]))
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == [
        "mnist5k_semifl/server_only (local, seed 0): 70.00%",
        "mnist5k_semifl (local, seed 0): 90.00%",
        "other (fedseal, local, seed 0): 75.00%",
        "broken (semifl, local): failed, no evaluated round",
    ]
    assert assert_legend_outside_the_axes(fig) == labels  # no class count in these summaries: no chance line
    assert list(ax.get_lines()[1].get_xdata()) == [1, 2, 3]
    lo, hi = ax.get_xlim()
    ticks = [float(t) for t in ax.get_xticks() if lo <= t <= hi]
    assert ticks and all(t.is_integer() for t in ticks), ticks
    assert ax.get_title() == "mnist5k_semifl, other, broken: test accuracy\non mnist5k"


def _set(run: Path, summary: dict | None = None, **sections: dict) -> Path:
    """Merge ``sections`` into the run's config.yaml and ``summary`` into its summary.json."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    if summary:
        (run / "summary.json").write_text(json.dumps({**json.loads((run / "summary.json").read_text()), **summary}))
    return run


def test_report_labels_tell_runs_apart_by_runtime_seed_and_what_else_differs(tmp_path: Path) -> None:
    """Issue 30: an MPI run and a GRPC run of one config had the same legend entry."""
    mpi = _set(_fake_run(tmp_path / "mpi" / "mnist5k_semifl", "semifl", [0.5, 0.6]), {"runtime": "fedml-MPI"})
    grpc = _set(_fake_run(tmp_path / "grpc" / "mnist5k_semifl", "semifl", [0.5, 0.61]), comm_args={"backend": "GRPC"})
    seed1 = _fake_run(tmp_path / "seed1", "semifl", [0.4, 0.62], seed=1)
    strict = _set(_fake_run(tmp_path / "strict", "semifl", [0.3, 0.5]), ssfl_args={"threshold": 0.99})
    for run in (mpi, grpc, seed1):
        _set(run, ssfl_args={"threshold": 0.9})
    for run in (mpi, grpc):  # what the runtime implies, and what changes no result, is not a difference
        _set(run, common_args={"training_type": "cross_silo"}, device_args={"num_threads": 2})
    other = _set(_fake_run(tmp_path / "fedseal", "fedseal", [0.3, 0.4]), ssfl_args={"threshold": 0.5})
    labels = [
        line.get_label() for line in accuracy_figure(collect_runs([mpi, grpc, seed1, strict, other])).axes[0].lines
    ]
    assert labels == [
        "mnist5k_semifl (fedml-MPI, seed 0, threshold=0.9): 60.00%",  # the runtime summary.json names
        "mnist5k_semifl (fedml-GRPC, seed 0, threshold=0.9): 61.00%",  # or the config's backend
        "seed1 (semifl, local, seed 1, threshold=0.9): 62.00%",
        "strict (semifl, local, seed 0, threshold=0.99): 50.00%",
        "fedseal (local, seed 0): 40.00%",  # its own threshold is another algorithm's setting: no difference
    ]


def test_report_plot_runs_from_0_to_100_with_each_class_counts_chance_line(tmp_path: Path) -> None:
    ten = _set(_fake_run(tmp_path / "ten", "semifl", [0.395, 0.405]), {"num_classes": 10})
    hundred = _set(
        _fake_run(tmp_path / "hundred", "semifl", [0.2, 0.3]), {"num_classes": 100}, data_args={"dataset": "cifar100"}
    )
    fig = accuracy_figure(collect_runs([ten, hundred]))
    ax = fig.axes[0]
    assert ax.get_ylim() == (0.0, 100.0)  # a 1-point span stays a 1-point span
    chance = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines() if line.get_label().startswith("chance")}
    assert chance == {"chance (1/10): 10.0%": pytest.approx(10.0), "chance (1/100): 1.0%": pytest.approx(1.0)}
    assert assert_legend_outside_the_axes(fig)[-2:] == ["chance (1/10): 10.0%", "chance (1/100): 1.0%"]
    assert ax.get_title() == "ten, hundred: test accuracy\non mnist5k, cifar100"


def test_report_title_names_a_users_data_by_its_folder_and_shortens_many_names(tmp_path: Path) -> None:
    runs = [
        _set(_fake_run(tmp_path / f"a_rather_long_run_name_{i}", "semifl", [0.5]), data_args={"dataset": d, **extra})
        for i, (d, extra) in enumerate(
            [("npz", {"data_cache_dir": "/data/shoes"}), ("folder", {"data_cache_dir": "~/pics/"}), ("mnist5k", {})]
        )
    ]
    title = accuracy_figure(collect_runs(runs)).axes[0].get_title()
    assert title == "a_rather_long_run_name_0 and 2 other runs: test accuracy\non npz shoes, folder pics, mnist5k"
