"""The command line: run with a comparison table, partition report, clear config errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedml_ssfl.cli import main
from tests.conftest import SMALL, one_line_error


def sets(*items):
    out = []
    for item in items:
        out += ["--set", item]
    return out


def test_run_prints_server_only_beside_the_method(tmp_path, capsys):
    args = sets(
        *[s for s in SMALL if not s.startswith("common_args.compare_with")],
        "common_args.compare_with=[server_only]",
        f"common_args.output_dir={tmp_path}",
        "train_args.comm_round=1",
    )
    assert main(["run", *args]) == 0
    out = capsys.readouterr().out
    assert "server_only" in out and "semifl" in out and "same split" in out  # the main job's method
    assert (tmp_path / "mnist5k_semifl" / "compare" / "server_only" / "summary.json").is_file()


def test_config_typo_exits_2_and_names_the_key(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train_args:\n  comm_rounds: 3\n")
    assert main(["run", "--cf", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "train_args.comm_rounds" in err and "comm_round" in err


def test_partition_reports_r_and_saves_heatmap(tmp_path, capsys):
    out_png = tmp_path / "part.png"
    code = main(
        [
            "partition",
            *sets("data_args.partition_method=r", "data_args.non_iid_r=0.6", "train_args.client_num_in_total=10"),
            "--out",
            str(out_png),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "0.6" in text and "measured" in text
    assert out_png.stat().st_size > 1000


def test_print_config_shows_resolved_yaml(capsys):
    assert main(["run", "--print-config", "--set", "train_args.comm_round=4"]) == 0
    assert "comm_round: 4" in capsys.readouterr().out


def test_export_subcommand_writes_a_verified_onnx_model(tmp_path, capsys):
    args = sets(*SMALL, f"common_args.output_dir={tmp_path}", "train_args.comm_round=1")
    assert main(["run", *args]) == 0
    run_dir = tmp_path / "mnist5k_semifl"
    out = tmp_path / "edge"
    assert main(["export", str(run_dir), "--out", str(out), "--no-int8"]) == 0
    report = __import__("json").loads((out / "export_report.json").read_text())
    assert report["status"] == "ok", report
    assert main(["export", str(tmp_path / "missing"), "--out", str(out)]) == 1
    capsys.readouterr()
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert main(["export", str(run_dir), "--out", str(blocker), "--no-int8"]) == 1
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl export: error:")
    assert f"output folder {blocker}: {blocker} is a file, not a folder" in line, line


def test_report_compares_runs_in_one_table(tmp_path, capsys):
    args = sets(
        *SMALL,
        f"common_args.output_dir={tmp_path}",
        "train_args.comm_round=1",
        "common_args.compare_with=[server_only]",
    )
    assert main(["run", *args]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "mnist5k_semifl"), "--out", str(tmp_path / "cmp.png")]) == 0
    out = capsys.readouterr().out
    assert "semifl" in out and "server_only" in out
    assert (tmp_path / "cmp.png").stat().st_size > 1000


def test_bad_config_inputs_exit_2_with_one_line_naming_the_input(tmp_path, capsys):
    binary = tmp_path / "config.yaml"
    binary.write_bytes(b"common_args:\n  run_name: \xf0\x28\x8c\x28\n")
    cases = [
        (["run", "--cf", str(binary)], f"{binary}: not a text file"),
        (["run", "--set", "ssfl_args.algorithm=nope"], "ssfl_args.algorithm: unknown algorithm 'nope'"),
        (["run", "--set", "trainargs"], "--set 'trainargs': expected section.key=value"),
    ]
    for argv, text in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert text in err and "Traceback" not in err, err


def test_export_refuses_a_file_or_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    from fedml_ssfl.checkpoint import save_checkpoint

    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    truncated = save_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt", {"round": 0, "algorithm": {}})
    truncated.write_bytes(truncated.read_bytes()[:200])
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"\x08\x07")
    folder = tmp_path / "just_a_folder"
    folder.mkdir()
    cases = [
        (text, f"{text} is not a fedml_ssfl checkpoint"),
        (truncated, f"{truncated} is not a fedml_ssfl checkpoint"),
        (onnx, f"{onnx} is an exported model, not a checkpoint; pass the run folder"),
        (folder, f"{folder} is not a run folder (it has no config.yaml and no checkpoints/last.pt)"),
    ]
    for source, text_ in cases:
        assert main(["export", str(source), "--out", str(tmp_path / "edge")]) == 1, source
        line = one_line_error(capsys.readouterr().err, "fedml-ssfl export: error:")
        assert text_ in line, line
    assert not (tmp_path / "edge").exists()


def test_output_dir_that_is_a_file_is_refused_naming_it(tmp_path, capsys):
    blocker = tmp_path / "outputs"
    blocker.write_text("an older file of the user's\n")
    for out in (blocker, blocker / "deeper"):
        assert main(["run", *sets(*SMALL, f"common_args.output_dir={out}")]) == 2
        line = one_line_error(capsys.readouterr().err, "fedml-ssfl run: error:")
        assert f"common_args.output_dir: cannot create the run folder {out}/mnist5k_semifl" in line, line
        assert f"{blocker} is a file, not a folder: move it away or rename it" in line, line
        assert "or set common_args.output_dir to another folder" in line
    assert main(["partition", *sets(*SMALL, f"common_args.output_dir={blocker}")]) == 2
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl partition: error:")
    assert f"{blocker} is a file, not a folder" in line, line
    assert blocker.read_text() == "an older file of the user's\n"


def _read_only_line(tmp_path, capsys) -> str:
    ro = tmp_path / "ro"
    assert main(["run", *sets(*SMALL, f"common_args.output_dir={ro}")]) == 2
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl run: error:")
    assert f"cannot create the run folder {ro}/mnist5k_semifl: {ro} is not writable (permission denied)" in line, line
    assert "make it writable; or set common_args.output_dir to another folder" in line
    return line


def test_read_only_output_dir_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    """Simulated: root (the test runner here) may write into a read-only folder."""
    import errno

    ro = tmp_path / "ro"
    ro.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, mode=0o777, *args, **kwargs):
        if Path(path).parent == ro and not Path(path).exists():
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_mkdir(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    _read_only_line(tmp_path, capsys)


def _run_with_round_1_hook(tmp_path, monkeypatch, hook) -> int:
    """A 3-round run whose round 1 calls ``hook(run_dir)`` before its outputs are written."""
    import fedml_ssfl.runtime.local as local

    real = local.run_round

    def run_round(exp, r, client_states):
        row = real(exp, r, client_states)
        if r == 1:
            hook(tmp_path / "mnist5k_semifl")
        return row

    monkeypatch.setattr(local, "run_round", run_round)
    args = sets(*SMALL, f"common_args.output_dir={tmp_path}", "train_args.comm_round=3")
    return main(["run", *args])


@pytest.mark.parametrize("how", ["replaced_by_a_file", "removed"])
def test_run_folder_replaced_or_removed_mid_run_stops_in_one_line(tmp_path, capsys, monkeypatch, how):
    import shutil

    def hook(run_dir: Path) -> None:
        if how == "removed":
            shutil.rmtree(run_dir)
        else:
            shutil.move(run_dir, tmp_path / "moved")
            run_dir.write_text("the user's file\n")

    assert _run_with_round_1_hook(tmp_path, monkeypatch, hook) == 1
    run_dir = tmp_path / "mnist5k_semifl"
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl run: error:")
    what = "replaced by a file (left untouched)" if how != "removed" else "removed"
    assert f"round 1: the run folder {run_dir} was {what} while the run was running" in line, line
    assert f"continue with `fedml-ssfl run --resume {run_dir}`" in line
    if how == "removed":
        assert not run_dir.exists()  # not re-created half-empty by the checkpoint writer
    else:
        assert run_dir.read_text() == "the user's file\n"
        from fedml_ssfl.checkpoint import load_checkpoint

        assert load_checkpoint(tmp_path / "moved" / "checkpoints" / "last.pt")["round"] == 0


def test_an_unwritable_checkpoint_mid_run_keeps_what_was_saved(tmp_path, capsys, monkeypatch):
    import errno

    import fedml_ssfl.runtime.common as common
    from fedml_ssfl.checkpoint import load_checkpoint

    def read_only(run_dir: Path) -> None:
        def refuse(path, payload):
            raise PermissionError(errno.EACCES, "Permission denied", f"{path}.x.tmp")

        monkeypatch.setattr(common, "save_checkpoint", refuse)

    assert _run_with_round_1_hook(tmp_path, monkeypatch, read_only) == 1
    run_dir = tmp_path / "mnist5k_semifl"
    ckpt = run_dir / "checkpoints" / "last.pt"
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl run: error:")
    assert f"round 1: cannot write in the run folder {run_dir}: {ckpt.parent} is not writable" in line, line
    assert f"last good checkpoint: {ckpt}" in line and f"--resume {run_dir}`" in line
    assert load_checkpoint(ckpt)["round"] == 0
    monkeypatch.undo()
    args = sets(*SMALL, f"common_args.output_dir={tmp_path}", "train_args.comm_round=3")
    assert main(["run", *args, "--resume", str(run_dir)]) == 0
    assert load_checkpoint(ckpt)["round"] == 2


def test_an_unexpected_error_is_one_line_unless_debug(monkeypatch, capsys):
    import fedml_ssfl.cli as cli

    def broken(args):
        raise RuntimeError("an unforeseen state")

    monkeypatch.setitem(cli.COMMANDS, "run", broken)
    assert main(["run"]) == 1
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl run: error:")
    assert "RuntimeError: an unforeseen state" in line and "--debug" in line
    with pytest.raises(RuntimeError, match="an unforeseen state"):
        main(["--debug", "run"])
