"""The command line: run with a comparison table, partition report, clear config errors."""

from __future__ import annotations

from fedml_ssfl.cli import main
from tests.conftest import SMALL


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
