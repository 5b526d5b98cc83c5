"""A run's progress: a tqdm bar on a terminal, one log line per round where output is a file or a pipe.

Both tests run ``fedml-ssfl run`` in a child process, as a user (or a batch job) does: once with its
output piped (what a log file, ``nohup`` or mpirun's forwarding gets) and once on a pseudo-terminal.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from tests.conftest import SMALL

ROOT = Path(__file__).resolve().parents[1]
ROUND_LINE = re.compile(r"^INFO fedml_ssfl\.runtime\.common: semifl: round (\d+)/3: test acc \d+\.\d\d%, ")


def run_command(tmp_path: Path) -> list[str]:
    sets = [*SMALL, "train_args.comm_round=3", "tracking_args.progress_bar=true", f"common_args.output_dir={tmp_path}"]
    return [sys.executable, "-m", "fedml_ssfl.cli", "run", *(x for s in sets for x in ("--set", s))]


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "100", "LINES": "30"}


def test_piped_output_has_a_line_per_round_and_no_carriage_returns(tmp_path: Path) -> None:
    res = subprocess.run(run_command(tmp_path), capture_output=True, env=child_env(), timeout=300)
    err = res.stderr.decode()  # bytes: text mode would turn every \r into \n
    assert res.returncode == 0, err
    assert b"\r" not in res.stdout + res.stderr, err  # no tqdm frames in a log file
    rounds = [int(m.group(1)) for line in err.split("\n") if (m := ROUND_LINE.match(line))]
    assert rounds == [1, 2, 3], err
    last = next(line for line in err.split("\n") if ROUND_LINE.match(line) and "round 3/3" in line)
    assert re.search(r"\d+\.\ds \(\d+\.\ds so far, about 0\.0s left\)$", last), last


def test_a_terminal_gets_the_bar_and_no_round_lines(tmp_path: Path) -> None:
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # rows, columns: a real size
    proc = subprocess.Popen(
        run_command(tmp_path), stdin=subprocess.DEVNULL, stdout=child, stderr=child, env=child_env(), close_fds=True
    )
    os.close(child)
    chunks = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 1.0)
        if ready:
            try:
                data = os.read(main, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(main)
    assert proc.wait(timeout=60) == 0
    out = b"".join(chunks).decode("utf-8", "replace")
    assert "\r" in out and "3/3" in out and "round/s" in out, out  # tqdm's bar, at its end
    assert "acc=" in out  # the bar's postfix: the last test accuracy
    assert not any(ROUND_LINE.match(line.strip("\r")) for line in out.splitlines()), out
