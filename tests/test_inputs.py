"""Every input bounded and named (issue 29): the bad inputs of the issue, one row each.

Each row runs the real command (``fedml-ssfl ...`` in this process, or the edge labeller) on a real
file and asserts the exit status and the one error line (what is named and the fix); the rows
whose input could exhaust memory run in a subprocess under an address-space limit
(:func:`run_bounded`), so a reader that allocated what the file claims would fail the row.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedml_ssfl.cli import main

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------
# config files, --set and the command line


def _nested(depth: int) -> str:
    return "train_args: " + "[" * depth + "]" * depth + "\n"


CONFIG_CASES = [
    # (id, config text or None, extra argv, exit status, text the error line (or the output) must hold)
    (
        "seed 2**70",
        "common_args:\n  random_seed: 1180591620717411303424\n",
        [],
        2,
        "common_args.random_seed: 1180591620717411303424 is out of range",
    ),
    (
        "seed -1",
        "common_args:\n  random_seed: -1\n",
        [],
        2,
        "common_args.random_seed: -1 is out of range; it must be >= 0 and <= 9223372036854775807",
    ),
    (
        "300-character run_name",
        "common_args:\n  run_name: " + "a" * 300 + "\n",
        [],
        2,
        "is 300 bytes long; a folder name may take 200 here: shorten it",
    ),
    ("nesting 5000 deep", _nested(5000), [], 2, "config.yaml, line 1: nested more than 16 levels deep"),
    (
        "a 5,000-digit integer",
        "train_args:\n  comm_round: " + "9" * 5000 + "\n",
        [],
        2,
        "config.yaml, line 2: an integer of 5000 digits (999999999999...)",
    ),
    (
        "duplicate key",
        "train_args:\n  comm_round: 3\n  local_steps: 2\n  comm_round: 4\n",
        [],
        2,
        "config.yaml: key 'train_args.comm_round' is given twice, on line 2 and line 4",
    ),
    (
        "duplicate section",
        "train_args:\n  comm_round: 3\nmodel_args:\n  norm: gn\ntrain_args:\n  local_steps: 2\n",
        [],
        2,
        "config.yaml: key 'train_args' is given twice, on line 1 and line 5",
    ),
    ("1e-3 is a number", "train_args:\n  learning_rate: 1e-3\n", [], 0, "learning_rate: 0.001"),
    ("1e30 is a number", "train_args:\n  weight_decay: 1e30\n", [], 0, "weight_decay: 1.0e+30"),
    ("1e2 is a whole number", "train_args:\n  comm_round: 1e2\n", [], 0, "comm_round: 100"),
    ("1.5 is no integer", "train_args:\n  comm_round: 1.5\n", [], 2, "train_args.comm_round: expected an integer"),
    ("infinity", "train_args:\n  weight_decay: .inf\n", [], 2, "train_args.weight_decay: inf is not a finite number"),
    ("a UTF-8 byte-order mark", "\ufefftrain_args:\n  comm_round: 7\n", [], 0, "comm_round: 7"),
    ("a null section and --set", "train_args:\n", ["--set", "train_args.comm_round=9"], 0, "comm_round: 9"),
    (
        "a string section and --set",
        "train_args: fast\n",
        ["--set", "train_args.comm_round=9"],
        2,
        "train_args: the config gives it the value 'fast', not a mapping of keys",
    ),
    (
        "num_classes 10**9",
        "data_args:\n  num_classes: 1000000000\n",
        [],
        2,
        "data_args.num_classes: 1000000000 is out of range; it must be >= 0 and <= 100000",
    ),
    (
        "10**12 clients",
        "train_args:\n  client_num_in_total: 1000000000000\n",
        [],
        2,
        "train_args.client_num_in_total: 1000000000000 is out of range",
    ),
    (
        "a huge synthetic image",
        "data_args:\n  synthetic_shape: [3, 1000000, 1000000]\n",
        [],
        2,
        "data_args.synthetic_shape: [3, 1000000, 1000000] is not [channels, height, width]",
    ),
    ("--debug after the subcommand", "train_args:\n  comm_round: 5\n", ["--debug", "-v"], 0, "comm_round: 5"),
]


@pytest.mark.parametrize("text, argv, code, expected", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_a_config_is_refused_in_one_line_naming_the_key_or_accepted(tmp_path, capsys, text, argv, code, expected):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text, encoding="utf-8")
    assert main(["run", str(cfg), "--print-config", *argv]) == code
    out, err = capsys.readouterr()
    if code == 0:
        assert expected in out and not err.strip().startswith("fedml-ssfl: error"), (out, err)
        return
    line = err.strip()
    assert line.startswith("fedml-ssfl: error: ") and "\n" not in line and "Traceback" not in err, err
    assert expected in line and len(line) < 400, line


def test_a_folder_a_device_or_a_huge_file_as_the_config_is_named_for_what_it_is(tmp_path, capsys):
    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"# " + b"x" * (2**20 + 10) + b"\n")
    cases = [
        (tmp_path, f"{tmp_path} is a folder, not a config file; pass the YAML file"),
        (Path("/dev/zero"), "/dev/zero is not a regular file (a device, pipe or socket)"),
        (huge, f"{huge}: larger than 1 MiB, not a config"),
        (tmp_path / "missing.yaml", f"config file not found: {tmp_path / 'missing.yaml'}"),
    ]
    for path, expected in cases:
        assert main(["run", str(path), "--print-config"]) == 2, path
        err = capsys.readouterr().err
        assert err.startswith("fedml-ssfl: error: ") and err.count("\n") == 1 and expected in err, err


def test_debug_after_the_subcommand_shows_the_traceback(monkeypatch, capsys):
    """The hint of an unexpected error, `fedml-ssfl run --debug`, is a command the parser takes."""
    import fedml_ssfl.cli as cli

    def broken(args):
        raise RuntimeError("an unforeseen state")

    monkeypatch.setitem(cli.COMMANDS, "run", broken)
    assert main(["run"]) == 1
    assert "--debug" in capsys.readouterr().err
    for argv in (["run", "--debug"], ["--debug", "run"]):
        with pytest.raises(RuntimeError, match="an unforeseen state"):
            main(argv)
