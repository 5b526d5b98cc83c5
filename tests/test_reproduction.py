"""``fedml-ssfl reproduce``: the listed paper rows, a smoke run on tiny real-format files, resume, errors."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedml_ssfl import reproduction
from fedml_ssfl.cli import main
from fedml_ssfl.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
ROW = "semifl-cifar10-4000"


def _write_cifar10(root: Path, per_batch: int = 12, test: int = 20) -> None:
    """CIFAR-10's python pickle batches (the published format), tiny: 5 x ``per_batch`` + ``test`` images."""
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)

    def dump(name: str, n: int) -> None:
        labels = [i % 10 for i in range(n)]
        data = rng.integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8)
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels}, f)

    for i in range(1, 6):
        dump(f"data_batch_{i}", per_batch)
    dump("test_batch", test)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f)


def test_list_names_paper_numbers_configs_and_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    for row in reproduction.ROWS:
        assert (ROOT / row.config).is_file(), row.config
        assert f"{row.key}: {row.number:.2f}%" in out
        assert f"config:  {row.config}" in out
        assert f"--rows {row.key}" in out
    # numbers from the papers' tables, not from the module
    assert "semifl-cifar10-4000: 93.10%" in out and "zhang-emnist-grouping: 81.63%" in out
    assert "fedmatch-cifar10-noniid-server: 44.17%" in out and "fedseal-fmnist-iid: 84.28%" in out


def test_each_config_header_names_its_row_number() -> None:
    for row in reproduction.ROWS:
        head = "".join(line for line in (ROOT / row.config).read_text().splitlines(True) if line.startswith("#"))
        number = f"{row.number:.2f}".rstrip("0").rstrip(".") if row.key.startswith("semifl") else f"{row.number:.2f}"
        assert f"{number}%" in head, (row.key, row.config)


def test_gap_is_ours_minus_the_paper() -> None:
    assert reproduction.gap(90.5, 93.1) == -2.6
    assert reproduction.gap(95.0, 94.36) == 0.64
    assert reproduction.gap(None, 93.1) is None


def test_the_gap_is_taken_from_the_final_accuracy_as_the_papers_report(tmp_path: Path) -> None:
    from fedml_ssfl.runtime.common import RunResult

    row = reproduction.select_rows(["zhang-svhn-fedavg"])[0]
    result = RunResult(run_dir=tmp_path, algorithm="ssfl", final_acc=0.9012, best_acc=0.9521, rounds_completed=7)
    record = reproduction.result_record(row, result, "paper", "cuda", 12.34, resumed=False)
    assert record["ours"] == 90.12 and record["best"] == 95.21
    assert record["gap"] == -4.24  # 90.12 - 94.36
    assert record["seconds"] == 12.3 and record["rounds"] == 7 and record["budget"] == "paper"
    page = reproduction.format_page({row.key: record})
    line = next(x for x in page.splitlines() if x.startswith(f"| {row.key} |"))
    assert "| 94.36 | 90.12 | -4.24 |" in line
    never = page.split("## Never run at paper scale")[1]
    assert f"`{row.key}`" not in never and f"{len(reproduction.ROWS) - 1} of {len(reproduction.ROWS)}" in never


def test_smoke_run_writes_the_table_and_a_second_run_skips_the_done_row(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _write_cifar10(data)
    work, page = tmp_path / "work", tmp_path / "reproduction.md"
    args = ["reproduce", "--data-dir", str(data), "--device", "cpu", "--rows", ROW, "--budget", "smoke"]
    args += ["--work", str(work), "--out", str(page)]
    proc = subprocess.run([sys.executable, "-m", "fedml_ssfl", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((work / "results" / f"{ROW}.json").read_text())
    assert record["budget"] == "smoke" and record["rounds"] == 2 and record["device"] == "cpu"
    assert record["gap"] == round(record["ours"] - 93.1, 2)
    text = page.read_text()
    line = next(x for x in text.splitlines() if x.startswith(f"| {ROW} |"))
    assert f"| 93.10 | {record['ours']:.2f} | {record['gap']:+.2f} |" in line and "smoke (2/800)" in line
    assert "| semifl-cifar10-250 |" in text and "not run" in text
    never = text.split("## Never run at paper scale")[1]
    assert f"`{ROW}`" in never and f"{len(reproduction.ROWS)} of {len(reproduction.ROWS)} rows" in never
    # the second invocation skips the done row: nothing trains, the result file is untouched
    before = (work / "results" / f"{ROW}.json").stat().st_mtime_ns
    proc = subprocess.run([sys.executable, "-m", "fedml_ssfl", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{ROW}: done before" in proc.stdout and "ran 0, skipped 1" in proc.stdout
    assert (work / "results" / f"{ROW}.json").stat().st_mtime_ns == before
    assert sorted(p.name for p in (work / "runs").iterdir()) == [ROW]


def test_a_missing_dataset_folder_is_one_line_naming_it_and_the_fix(tmp_path: Path) -> None:
    args = ["reproduce", "--data-dir", str(tmp_path), "--device", "cpu", "--rows", ROW]
    args += ["--work", str(tmp_path / "work"), "--out", str(tmp_path / "page.md")]
    proc = subprocess.run([sys.executable, "-m", "fedml_ssfl", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(tmp_path / "cifar-10-batches-py") in lines[0] and "--data-dir" in lines[0]
    assert "CIFAR-10's python batches" in lines[0]
    assert not (tmp_path / "work").exists() and not (tmp_path / "page.md").exists()
    svhn = reproduction.select_rows(["semifl-svhn-1000"])[0]
    with pytest.raises(ConfigError, match=r"dataset file .*train_32x32\.mat not found; put SVHN's"):
        reproduction.check_data(svhn, tmp_path)


def test_a_stopped_row_resumes_from_its_run_folder(tmp_path: Path) -> None:
    data, work = tmp_path / "data", tmp_path / "work"
    _write_cifar10(data)
    row = reproduction.select_rows([ROW])[0]
    sets = reproduction.row_overrides(row, data, "cpu", work, "smoke")
    assert main(["run", row.config, "--no-compare", "--stop-after", "1", *[f"--set={s}" for s in sets]]) == 0
    assert (work / "runs" / ROW / "checkpoints" / "last.pt").exists()
    assert not (work / "results" / f"{ROW}.json").exists()  # stopped: no result yet
    record = reproduction.run_row(row, data, "cpu", work, "smoke")
    assert record is not None and record["resumed"] is True and record["rounds"] == 2
    assert sorted(p.name for p in (work / "runs").iterdir()) == [ROW]  # continued in place, no ROW-2
