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
    assert (tmp_path / "digits_semifl" / "compare" / "server_only" / "summary.json").is_file()


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
    run_dir = tmp_path / "digits_semifl"
    out = tmp_path / "edge"
    assert main(["export", str(run_dir), "--out", str(out), "--no-int8"]) == 0
    report = __import__("json").loads((out / "export_report.json").read_text())
    assert report["status"] == "ok", report
    assert main(["export", str(tmp_path / "missing"), "--out", str(out)]) == 1
    capsys.readouterr()
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert main(["export", str(run_dir), "--out", str(blocker), "--no-int8"]) == 1
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
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
    assert main(["report", str(tmp_path / "digits_semifl"), "--out", str(tmp_path / "cmp.png")]) == 0
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
        line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
        assert text_ in line, line
    assert not (tmp_path / "edge").exists()


def test_output_dir_that_is_a_file_is_refused_naming_it(tmp_path, capsys):
    blocker = tmp_path / "outputs"
    blocker.write_text("an older file of the user's\n")
    for out in (blocker, blocker / "deeper"):
        assert main(["run", *sets(*SMALL, f"common_args.output_dir={out}")]) == 2
        line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
        assert f"common_args.output_dir: cannot create the run folder {out}/digits_semifl" in line, line
        assert f"{blocker} is a file, not a folder: move it away or rename it" in line, line
        assert "or set common_args.output_dir to another folder" in line
    assert main(["partition", *sets(*SMALL, f"common_args.output_dir={blocker}")]) == 2
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
    assert f"{blocker} is a file, not a folder" in line, line
    assert blocker.read_text() == "an older file of the user's\n"


def _read_only_line(tmp_path, capsys) -> str:
    ro = tmp_path / "ro"
    assert main(["run", *sets(*SMALL, f"common_args.output_dir={ro}")]) == 2
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
    assert f"cannot create the run folder {ro}/digits_semifl: {ro} is not writable (permission denied)" in line, line
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
            hook(tmp_path / "digits_semifl")
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
    run_dir = tmp_path / "digits_semifl"
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
    what = "replaced by a file (left untouched)" if how != "removed" else "removed"
    assert f"round 2: the run folder {run_dir} was {what} while the run was running" in line, line
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
    run_dir = tmp_path / "digits_semifl"
    ckpt = run_dir / "checkpoints" / "last.pt"
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
    assert f"round 2: cannot write in the run folder {run_dir}: {ckpt.parent} is not writable" in line, line
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
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
    assert "RuntimeError: an unforeseen state" in line and "--debug" in line
    with pytest.raises(RuntimeError, match="an unforeseen state"):
        main(["--debug", "run"])


# ---------------------------------------------------------------------------------------------
# run folders (issue 14)

TINY = [
    "model_args.norm=gn",
    "train_args.client_num_in_total=2",
    "train_args.client_num_per_round=2",
    "train_args.comm_round=1",
    "train_args.local_steps=1",
    "train_args.batch_size=16",
    "validation_args.eval_batch_size=500",
    "tracking_args.progress_bar=false",
    "tracking_args.enable_tensorboard=false",
]


def test_the_run_folder_is_named_after_the_dataset_and_algorithm_run(tmp_path, capsys):
    """docs/edge.md's first command: the main job's file says mnist5k_semifl, the command runs fedavg_ssl."""
    args = sets(
        "data_args.dataset=mnist5k", "ssfl_args.algorithm=fedavg_ssl", *TINY, f"common_args.output_dir={tmp_path}"
    )
    assert main(["run", *args, "--no-compare"]) == 0
    assert f"outputs: {tmp_path / 'mnist5k_fedavg_ssl'}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnist5k_fedavg_ssl"]
    assert (tmp_path / "mnist5k_fedavg_ssl" / "summary.json").is_file()


def test_partition_writes_beside_the_run_folder_so_the_next_run_gets_its_name(tmp_path, capsys):
    args = sets(*SMALL, f"common_args.output_dir={tmp_path}")
    assert main(["partition", *args]) == 0
    png = tmp_path / "digits_semifl.partition.png"
    assert f"heat-map: {png}" in capsys.readouterr().out
    assert png.stat().st_size > 1000 and not (tmp_path / "digits_semifl").exists()
    assert main(["run", *args, *sets("train_args.comm_round=1")]) == 0
    assert f"outputs: {tmp_path / 'digits_semifl'}\n" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits_semifl", "digits_semifl.partition.png"]


def test_a_run_that_fails_before_writing_anything_leaves_no_folder(tmp_path, capsys, monkeypatch):
    """Data loading, model build and the algorithm's setup fail after the folder is claimed: it goes again,
    so attempts leave no -2, -3 ... folders, and the run that works gets the plain name."""
    from fedml_ssfl.algorithms.semifl import SemiFL

    out = tmp_path / "runs"
    args = sets(*SMALL, f"common_args.output_dir={out}")
    no_data = sets("data_args.dataset=npz", f"data_args.data_cache_dir={tmp_path / 'nothing'}")
    assert main(["run", *args, *no_data, *sets("common_args.run_name=digits_semifl")]) == 1  # data loading
    assert main(["run", *args, *sets("model_args.model=emnist_cnn", "model_args.norm=none")]) == 2  # model build

    def broken_setup(self):
        raise RuntimeError("setup broke")

    monkeypatch.setattr(SemiFL, "setup", broken_setup)
    assert main(["run", *args]) == 1  # the algorithm's setup
    err = capsys.readouterr().err
    assert "npz" in err and "emnist_cnn" in err and "setup broke" in err, err
    assert list(out.iterdir()) == []
    monkeypatch.undo()
    assert main(["run", *args, *sets("train_args.comm_round=1")]) == 0
    assert [p.name for p in out.iterdir()] == ["digits_semifl"]


def test_a_refused_resume_names_each_differing_key_with_both_values(tmp_path, capsys):
    args = sets(*SMALL, f"common_args.output_dir={tmp_path}", "ssfl_args.threshold=0.9")
    assert main(["run", *args, "--stop-after", "1"]) == 0
    run_dir = tmp_path / "digits_semifl"
    (run_dir / "config.yaml").unlink()  # the checkpoint itself keeps the config it was written under
    capsys.readouterr()
    changed = sets("train_args.learning_rate=0.5", "ssfl_args.threshold=0.8")
    assert main(["run", *args, *changed, "--resume", str(run_dir)]) == 1
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
    assert line.startswith("fedml-ssfl: error: resume refused: the config differs from the checkpoint's"), line
    assert "ssfl_args.threshold (checkpoint 0.9, now 0.8); train_args.learning_rate (checkpoint 0.1, now 0.5);" in line
    assert "train_args.comm_round" not in line and "run_name" not in line  # only what differs


# ---------------------------------------------------------------------------------------------
# the command itself (issue 14)


def test_version_prints_the_package_version(capsys):
    from fedml_ssfl import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"fedml-ssfl {__version__}\n"


def test_bare_command_prints_the_help_with_examples(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fedml-ssfl")
    for command in ("run", "partition", "report", "export", "list"):
        assert f"    {command} " in out, command
    assert "examples:\n  fedml-ssfl run " in out


def _listed(out: str) -> dict[str, dict[str, str]]:
    """``fedml-ssfl list`` output as {section: {name: description}}."""
    sections: dict[str, dict[str, str]] = {}
    for block in out.strip().split("\n\n"):
        head, *rows = block.splitlines()
        sections[head.split(" ")[0]] = dict(row.strip().split(None, 1) for row in rows)
    return sections


def test_list_names_every_registry_entry_with_its_docstring_line(capsys, monkeypatch):
    from fedml_ssfl.algorithms import algorithm_description, available_algorithms
    from fedml_ssfl.cli import _plain
    from fedml_ssfl.data import available_datasets, datasets
    from fedml_ssfl.data.partition_methods import METHOD_TABLE
    from fedml_ssfl.models import available_models, model_spec

    def my_loader(root, download, seed):
        """My own images, registered at run time."""

    monkeypatch.setitem(datasets._REGISTRY, "my_data", my_loader)
    assert main(["list"]) == 0
    listed = _listed(capsys.readouterr().out)
    assert list(listed) == ["algorithms", "models", "datasets", "partitions"]
    assert listed["algorithms"] == {n: _plain(algorithm_description(n)) for n in available_algorithms()}
    assert listed["models"] == {n: model_spec(n).description for n in available_models()}
    assert set(listed["datasets"]) == set(available_datasets()) and "my_data" in listed["datasets"]
    assert listed["datasets"]["my_data"] == "My own images, registered at run time."
    assert listed["partitions"] == {m.name: m.description for m in METHOD_TABLE}
    assert all(d for section in listed.values() for d in section.values())  # a description for every entry
    assert main(["list", "partitions"]) == 0
    assert list(_listed(capsys.readouterr().out)) == ["partitions"]


def test_every_error_has_one_prefix_and_one_line(tmp_path, capsys):
    """Usage errors, config errors and failures of every subcommand: `fedml-ssfl: error: ...`, one line."""
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("train_args: [\n  comm_round: 3\n")  # the YAML parser's message has line breaks
    cases = [
        (["nope"], 2),
        (["run", "--bogus"], 2),
        (["run", "--stop-after"], 2),
        (["run", "--set", "trainargs"], 2),
        (["run", str(bad_yaml)], 2),
        (["partition", "--set", "train_args.comm_rounds=1"], 2),
        (["report", str(tmp_path / "missing")], 1),
        (["export", str(tmp_path / "missing"), "--out", str(tmp_path / "edge")], 1),
        (["list", "everything"], 2),
    ]
    for argv, code in cases:
        assert main(argv) == code, argv
        captured = capsys.readouterr()
        assert captured.err.startswith("fedml-ssfl: error: ") and captured.err.count("\n") == 1, (argv, captured.err)
        assert "usage:" not in captured.err and "Traceback" not in captured.err
    assert "(see `fedml-ssfl run --help`)" in (main(["run", "--bogus"]), capsys.readouterr().err)[1]


def test_every_example_in_the_help_parses(capsys):
    """The examples the help shows are commands the parser accepts."""
    import shlex

    from fedml_ssfl.cli import build_parser

    parser = build_parser()
    helps = [parser.format_help()] + [p.format_help() for p in parser.parse_args([]).commands.values()]
    examples = [line.split("  #")[0].strip() for text in helps for line in text.splitlines()]
    examples = [e for e in examples if e.startswith("fedml-ssfl ") and "--help" not in e]
    assert len(examples) >= 20, examples
    for example in examples:
        parser.parse_args(shlex.split(example)[1:])  # SystemExit (a failed test) if not
