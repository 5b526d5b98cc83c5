"""``fedml-ssfl report``: one table and one accuracy-vs-round plot comparing run directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedml_ssfl.report import accuracy_figure, collect_runs, format_duration, report_runs


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
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    a = _fake_run(tmp_path / "mnist5k_semifl", "semifl", [0.6, 0.8, 0.9])
    _fake_run(a / "compare" / "server_only", "server_only", [0.5, 0.6, 0.7])
    b = _fake_run(tmp_path / "other", "fedseal", [0.4, 0.7, 0.75])
    failed = tmp_path / "broken"
    failed.mkdir()
    (failed / "summary.json").write_text(json.dumps({"status": "failed", "algorithm": "semifl"}))
    fig = accuracy_figure(collect_runs([a, b, failed]))
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == [
        "mnist5k_semifl/server_only: 70.00%",
        "mnist5k_semifl: 90.00%",
        "other (fedseal): 75.00%",
        "broken (semifl): failed, no evaluated round",
    ]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
    assert list(ax.get_lines()[1].get_xdata()) == [1, 2, 3]
    lo, hi = ax.get_xlim()
    ticks = [float(t) for t in ax.get_xticks() if lo <= t <= hi]
    assert ticks and all(t.is_integer() for t in ticks), ticks
