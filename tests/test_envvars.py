"""Environment variables (issue 29): each one the package reads is validated when read, in one line naming it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedml_ssfl import envvars
from fedml_ssfl.errors import ConfigError

PACKAGE = Path(__file__).resolve().parent.parent / "fedml_ssfl"


class Refused(str):
    """The text the error must contain."""


# (reader call, value, the result, or Refused(the text of the error))
CASES = [
    (lambda: envvars.seconds("X_T", 30.0), "", 30.0),
    (lambda: envvars.seconds("X_T", 30.0), " 2.5 ", 2.5),
    (lambda: envvars.seconds("X_T", 30.0), "1e3", 1000.0),
    (lambda: envvars.seconds("X_T", 30.0), "abc", Refused("X_T='abc': expected a number of seconds > 0")),
    (lambda: envvars.seconds("X_T", 30.0), "-5", Refused("X_T='-5': expected a finite number of seconds > 0")),
    (lambda: envvars.seconds("X_T", 30.0), "0", Refused("X_T='0': expected a finite number of seconds > 0")),
    (lambda: envvars.seconds("X_T", 30.0), "inf", Refused("X_T='inf': expected a finite number of seconds")),
    (lambda: envvars.seconds("X_T", 30.0, allow_minimum=True), "0", 0.0),
    (lambda: envvars.nbytes("X_B", 7), "", 7),
    (lambda: envvars.nbytes("X_B", 7), "4294967296", 2**32),
    (lambda: envvars.nbytes("X_B", 7), "4GiB", 2**32),
    (lambda: envvars.nbytes("X_B", 7), "512 MiB", 2**29),
    (lambda: envvars.nbytes("X_B", 7), "1e9", 10**9),
    (lambda: envvars.nbytes("X_B", 7), "2G", 2 * 10**9),
    (lambda: envvars.nbytes("X_B", 7), "abc", Refused("X_B='abc': expected a size in bytes")),
    (lambda: envvars.nbytes("X_B", 7), "-1", Refused("X_B='-1': expected a size in bytes")),
    (lambda: envvars.nbytes("X_B", 7), "3 parsecs", Refused("X_B='3 parsecs': expected a size in bytes")),
    (lambda: envvars.nbytes("X_B", 7, minimum=2**20), "100", Refused("X_B='100': expected a size in bytes from 1")),
    (lambda: envvars.integer("X_I", None, minimum=0), "", None),
    (lambda: envvars.integer("X_I", None, minimum=0), "3", 3),
    (lambda: envvars.integer("X_I", None, minimum=0), "-1", Refused("X_I='-1': expected a whole number >= 0")),
    (lambda: envvars.integer("X_I", None, minimum=0), "1.5", Refused("X_I='1.5': expected a whole number >= 0")),
    (lambda: envvars.integer("X_I", None, minimum=0), "9" * 5000, Refused("X_I='99999")),
    (lambda: envvars.flag("X_F"), "", False),
    (lambda: envvars.flag("X_F"), "1", True),
    (lambda: envvars.flag("X_F"), "False", False),
    (lambda: envvars.flag("X_F"), "On", True),
    (lambda: envvars.flag("X_F"), "maybe", Refused("X_F='maybe': expected 1 or 0")),
    (lambda: envvars.text("X_S", max_length=5), "abc", "abc"),
    (lambda: envvars.text("X_S", max_length=5), "abcdefgh", Refused("X_S='abcdefgh': expected at most 5 printable")),
    (lambda: envvars.text("X_S"), "a\nb", Refused("expected at most 4096 printable characters")),
]


@pytest.mark.parametrize("read, value, expected", CASES)
def test_each_reader_converts_or_refuses_in_one_line_naming_the_variable(monkeypatch, read, value, expected):
    for name in ("X_T", "X_B", "X_I", "X_F", "X_S"):
        monkeypatch.setenv(name, value)
    if not isinstance(expected, Refused):
        assert read() == expected
        return
    with pytest.raises(ConfigError) as info:
        read()
    message = str(info.value)
    assert expected in message and "\n" not in message and "unset it" in message, message
    assert len(message) < 200, message  # a 5,000-character value is cut short in the message


def test_a_path_variable_must_name_a_file_in_an_existing_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("X_P", str(tmp_path / "log.txt"))
    assert envvars.file_path("X_P") == tmp_path / "log.txt"
    monkeypatch.setenv("X_P", str(tmp_path))
    with pytest.raises(ConfigError, match="X_P=.*: expected the path of a file, not a folder"):
        envvars.file_path("X_P")
    monkeypatch.setenv("X_P", str(tmp_path / "missing" / "log.txt"))
    with pytest.raises(ConfigError, match="expected a file in an existing folder"):
        envvars.file_path("X_P")


def _package_reads() -> list[str]:
    """``file:line`` of each read of the environment in the package outside envvars.py."""
    read = re.compile(r"os\.environ\.get\(|os\.environ\[|os\.getenv\(|in os\.environ\b|environ\.get\(")
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "envvars.py" and path.parent == PACKAGE:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if read.search(line):
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    return hits


def test_the_package_reads_the_environment_only_through_envvars():
    assert _package_reads() == []


# every variable the package reads, set to junk, refused where the package reads it
def _timeouts():
    from fedml_ssfl.runtime.fedml.launch import timeouts

    return timeouts()


def _max_message():
    from fedml_ssfl.runtime.fedml.wire import max_message_bytes

    return max_message_bytes()


def _input_limit():
    from fedml_ssfl.limits import input_limit

    return input_limit()


def _allow_network():
    from fedml_ssfl.runtime import offline

    return offline.install()


def _smoke():
    from fedml_ssfl.config import apply_smoke_settings

    return apply_smoke_settings({}, [])


PACKAGE_VARIABLES = [
    ("FEDML_SSFL_ROUND_TIMEOUT", "-5", _timeouts),
    ("FEDML_SSFL_ROUND_TIMEOUT", "abc", _timeouts),
    ("FEDML_SSFL_CONNECT_TIMEOUT", "0", _timeouts),
    ("FEDML_SSFL_FINISH_GRACE", "nan", _timeouts),
    ("FEDML_SSFL_HEARTBEAT_INTERVAL", "-1", _timeouts),
    ("FEDML_SSFL_OUTAGE_BUDGET", "inf", _timeouts),
    ("FEDML_SSFL_IDLE_TIMEOUT", "soon", _timeouts),
    ("FEDML_SSFL_MAX_MESSAGE_BYTES", "abc", _max_message),
    ("FEDML_SSFL_MAX_MESSAGE_BYTES", "-5", _max_message),
    ("FEDML_SSFL_MAX_INPUT_BYTES", "lots", _input_limit),
    ("FEDML_SSFL_ALLOW_NETWORK", "perhaps", _allow_network),
    ("FEDML_SSFL_SET", "train_args.comm_round=2\nx", _smoke),
]


@pytest.mark.parametrize("name, value, read", PACKAGE_VARIABLES)
def test_every_package_variable_is_refused_when_read_with_junk(monkeypatch, name, value, read):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        read()
    assert str(info.value).startswith(f"{name}=") and "\n" not in str(info.value), str(info.value)


def test_the_client_rank_and_the_run_id_from_fedml_launch_are_checked(monkeypatch, capsys):
    from fedml_ssfl.cli import main

    monkeypatch.setenv("FEDML_CURRENT_RUN_ID", "x" * 300)
    assert main(["run", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedml-ssfl: error: FEDML_CURRENT_RUN_ID='xxx") and "at most 256" in err, err
    monkeypatch.setenv("FEDML_CURRENT_RUN_ID", "run-7")
    assert main(["run", "--print-config"]) == 0
    assert "run_id: run-7" in capsys.readouterr().out

    from fedml_ssfl.config import load_config
    from fedml_ssfl.runtime.fedml.launch import grpc_rank

    cfg = load_config(None, ["common_args.training_type=cross_silo", "comm_args.backend=GRPC"])
    monkeypatch.setenv("FEDML_CLIENT_RANK", "-2")
    with pytest.raises(ConfigError, match=r"FEDML_CLIENT_RANK='-2': expected a whole number >= 0"):
        grpc_rank(cfg, None, None)
