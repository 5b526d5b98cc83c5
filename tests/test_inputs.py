"""Every input bounded and named (issue 29): the bad inputs of the issue, one row each.

Each row runs the real command (``fedml-ssfl ...`` in this process, or the edge labeller) on a real
file and asserts the exit status and the one error line (what is named and the fix); the rows
whose input could exhaust memory run in a subprocess under an address-space limit
(:func:`run_bounded`), so a reader that allocated what the file claims would fail the row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedml_ssfl.cli import main
from fedml_ssfl.config import ConfigError
from tests.conftest import disk_used, resize_disk, run_bounded, write_npz_member, write_png

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
    (  # read as a number (a string would be "expected a number"), then held to its bound
        "1e30 is a number",
        "train_args:\n  weight_decay: 1e30\n",
        [],
        2,
        "train_args.weight_decay: 1e+30 is out of range; it must be >= 0.0 and <= 1000000",
    ),
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


# ---------------------------------------------------------------------------------------------
# data files: one value must not exhaust memory (each run under an address-space limit)

PRELOAD = [
    "fedml_ssfl.cli",
    "fedml_ssfl.runtime.local",
    "fedml_ssfl.experiment",
    "fedml_ssfl.data",
    "PIL.Image",
    "PIL.PngImagePlugin",
]


def _npz(path: Path, images: np.ndarray, labels: np.ndarray, **extra) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, images=images, labels=labels, **extra)
    return path


def _pixels(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, 8, 8), dtype=np.uint8)


def _label_1e9(root: Path) -> None:
    _npz(root / "train.npz", _pixels(3), np.array([0, 1, 10**9]))
    _npz(root / "test.npz", _pixels(2), np.array([0, 1]))


def _label_minus_1_as_uint32(root: Path) -> None:
    _npz(root / "train.npz", _pixels(3), np.array([0, 1, -1]).astype(np.uint32))
    _npz(root / "test.npz", _pixels(2), np.array([0, 1]))


def _zip_bomb(root: Path) -> None:
    """256 MiB of zeros in a 260 KB archive (a deflated npz, as np.savez_compressed writes)."""
    import zipfile

    root.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(root / "train.npz", "w", zipfile.ZIP_DEFLATED) as zf:
        write_npz_member(zf, "images", (4096, 256, 256))
        write_npz_member(zf, "labels", (4096,), "<i8")
    _npz(root / "test.npz", _pixels(2), np.array([0, 1]))


def _header_claims_5_8_tib(root: Path) -> None:
    import zipfile

    root.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(root / "train.npz", "w") as zf:
        write_npz_member(zf, "images", (400_000, 2000, 2000, 4), data_bytes=64)
        write_npz_member(zf, "labels", (400_000,), "<i8", data_bytes=64)
    _npz(root / "test.npz", _pixels(2), np.array([0, 1]))


def _png_12000(root: Path) -> None:
    write_png(root / "train" / "a" / "big.png", 12000, 12000)
    write_png(root / "test" / "a" / "small.png", 8, 8)


def _png_400_megapixels(root: Path) -> None:
    write_png(root / "train" / "a" / "huge.png", 20000, 20000)
    write_png(root / "test" / "a" / "small.png", 8, 8)


def _deployed_server_label_1e9(root: Path) -> list[str]:
    """Deployment mode: without class_names the server's class count comes from the labels present."""
    _npz(root / "server.npz", _pixels(3), np.array([0, 1, 10**9]))
    _npz(root / "test.npz", _pixels(2), np.array([0, 1]))
    _npz(root / "silo.npz", _pixels(2), np.array([-1, -1]))
    sets = {
        "common_args.training_type": "cross_silo",
        "comm_args.backend": "MPI",
        "comm_args.mode": "deployment",
        "data_args.server_data": root / "server.npz",
        "data_args.test_data": root / "test.npz",
        "data_args.local_data": root / "silo.npz",
    }
    return ["partition", *(x for k, v in sets.items() for x in ("--set", f"{k}={v}"))]


MEMORY_CASES = [
    # (id, dataset (None: the maker returns the command), make the files under ROOT, exit status, the error's text)
    ("a label of 10**9", "npz", _label_1e9, 2, "label 1000000000 appears, but only 3 distinct labels do"),
    ("-1 saved as uint32", "npz", _label_minus_1_as_uint32, 2, "holds 4294967295, the largest uint32: -1 (unlabeled)"),
    ("a zip bomb", "npz", _zip_bomb, 2, "would take 256.0 MiB decoded, more than the"),
    ("a header claiming 5.8 TiB", "npz", _header_claims_5_8_tib, 2, "header claims shape (400000, 2000, 2000, 4)"),
    ("a 12000x12000 PNG of 140 KB", "folder", _png_12000, 2, "big.png: 12000x12000 pixels; an image here may have"),
    ("a 400-megapixel PNG", "folder", _png_400_megapixels, 2, "huge.png: more pixels than Pillow opens"),
    (
        "a deployed server's label of 10**9",
        None,
        _deployed_server_label_1e9,
        2,
        "server.npz: label 1000000000 appears, but only 3 distinct labels do (no sample has label 2)",
    ),
]


def test_no_data_file_can_exhaust_memory(tmp_path):
    """`fedml-ssfl run` on each file with 400 MiB of address space to spare: refused from the headers, in one line.

    One child process runs the whole table (importing torch once); each row is its own call.
    """
    calls = []
    for n, (_, dataset, make, _, _) in enumerate(MEMORY_CASES):
        data = tmp_path / f"data{n}"
        made = make(data)
        argv = made or ["run", "--set", f"data_args.dataset={dataset}", "--set", f"data_args.data_cache_dir={data}"]
        argv += ["--set", f"common_args.output_dir={tmp_path / 'runs'}", "--set", "tracking_args.progress_bar=false"]
        calls.append(f"__import__('fedml_ssfl.cli').cli.main({argv!r})")
    for (name, _, _, code, expected), res in zip(MEMORY_CASES, run_bounded(PRELOAD, calls)):
        line = res.err.strip().splitlines()[-1] if res.err.strip() else ""
        assert res.code == code, (name, res.err[-3000:])
        assert line.startswith("fedml-ssfl: error: ") and expected in line, (name, res.err[-3000:])
        assert "Traceback" not in res.err and "MemoryError" not in res.err, (name, res.err[-3000:])
        assert 0 <= res.peak_growth < 64 * 2**20, (name, res.peak_growth)  # refused before anything was decoded


def _test_label_outside_training(root: Path) -> None:
    _npz(root / "train.npz", _pixels(3), np.array([0, 1, 2]))
    _npz(root / "test.npz", _pixels(2), np.array([0, 3]))


def _named_class_without_training_sample(root: Path) -> None:
    names = np.array(["ant", "bee", "cat", "dog"])
    _npz(root / "train.npz", _pixels(3), np.array([0, 1, 2]), class_names=names)
    _npz(root / "test.npz", _pixels(2), np.array([0, 3]), class_names=names)


def _empty_class_folder(root: Path) -> None:
    write_png(root / "train" / "a" / "x.png", 8, 8)
    (root / "train" / "b").mkdir(parents=True)
    write_png(root / "test" / "a" / "y.png", 8, 8)


def _truncated_png(root: Path) -> None:
    write_png(root / "train" / "a" / "cut.png", 64, 64, cut=30)
    write_png(root / "test" / "a" / "y.png", 64, 64)


DATA_CASES = [
    (
        "a test label outside the training classes",
        "npz",
        _test_label_outside_training,
        "class 'class_3' (label 3) has no training sample; 1 test sample(s) have it",
    ),
    (
        "a named class without training samples",
        "npz",
        _named_class_without_training_sample,
        "class 'dog' (label 3) has no training sample; 1 test sample(s) have it",
    ),
    ("an empty class folder", "folder", _empty_class_folder, "class 'b' (label 1) has no training sample (its folder"),
    ("a truncated image", "folder", _truncated_png, "cut.png: unreadable or corrupt image"),
]


@pytest.mark.parametrize("dataset, make, expected", [c[1:] for c in DATA_CASES], ids=[c[0] for c in DATA_CASES])
def test_a_class_without_training_samples_is_named_not_blamed_on_num_server_labels(
    tmp_path, capsys, dataset, make, expected
):
    make(tmp_path / "data")
    argv = ["run", "--set", f"data_args.dataset={dataset}", "--set", f"data_args.data_cache_dir={tmp_path / 'data'}"]
    assert main([*argv, "--set", f"common_args.output_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith("fedml-ssfl: error: data_args.dataset: ") and expected in line, err
    assert "num_server_labels" not in line and "Traceback" not in err


def channel_stats_of_128_mib() -> int:
    """Run in a bounded child: 0 when the statistics of 128 MiB of half-black, half-white images are right."""
    import torch

    from fedml_ssfl.data.datasets import _channel_stats

    x = torch.zeros(2048, 2, 128, 128, dtype=torch.uint8)
    x[::2] = 255
    mean, std = _channel_stats(x)
    n = x.numel() // 2
    return 0 if mean == (0.5, 0.5) and all(abs(s - (0.25 * n / (n - 1)) ** 0.5) < 1e-12 for s in std) else 1


def test_channel_statistics_take_a_bounded_working_set():
    """Mean and std of 128 MiB of images with 400 MiB of headroom (a float64 copy alone would take 1 GiB)."""
    call = "__import__('tests.test_inputs').test_inputs.channel_stats_of_128_mib()"
    (res,) = run_bounded(["torch", "tests.test_inputs"], [call])
    assert res.code == 0, res.err[-3000:]
    # the images (128 MiB) and one chunk's working set (int64: 64 MiB and a 32 MiB product); a float64 copy: 1 GiB
    assert res.peak_growth < 256 * 2**20, res.peak_growth


# ---------------------------------------------------------------------------------------------
# a full disk: one line, and a `failed` summary where one can be written


def _sets(*items: str) -> list[str]:
    return [x for item in items for x in ("--set", item)]


def test_a_full_disk_at_the_second_checkpoint_is_one_line_a_failed_summary_and_resumable(
    small_disk, capsys, monkeypatch
):
    """The issue's case: torch.save's `RuntimeError: [enforce fail at inline_container.cc]`, no summary.json."""
    import fedml_ssfl.runtime.local as local
    from fedml_ssfl.checkpoint import load_checkpoint
    from tests.conftest import SMALL

    disk = small_disk("64m")
    run_dir, real = disk / "digits_semifl", local.run_round
    ckpt = run_dir / "checkpoints" / "last.pt"

    def run_round(exp, r, client_states):
        row = real(exp, r, client_states)
        if r == 1:  # round 2's outputs come next: leave room for its metrics, not for a second checkpoint
            resize_disk(disk, disk_used(disk) + ckpt.stat().st_size // 2)
        return row

    monkeypatch.setattr(local, "run_round", run_round)
    args = _sets(*SMALL, f"common_args.output_dir={disk}")  # 2 rounds, a checkpoint after each
    assert main(["run", *args]) == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert f"round 2: cannot write in the run folder {run_dir}: {ckpt}: No space left on device" in line, err
    assert f"last good checkpoint: {ckpt}" in line and f"`fedml-ssfl run --resume {run_dir}`" in line
    assert "Traceback" not in err and "RuntimeError" not in err and "please report it" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] in line and summary["rounds_completed"] == 2
    assert load_checkpoint(ckpt)["round"] == 0 and not list(ckpt.parent.glob("*.tmp"))  # nothing saved was lost
    monkeypatch.undo()
    resize_disk(disk, 64 * 2**20)  # space freed: the run continues where it stopped
    assert main(["run", *args, "--resume", str(run_dir)]) == 0
    assert load_checkpoint(ckpt)["round"] == 1
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("size", ["4k", "8k"])
def test_a_disk_too_small_for_the_first_round_is_one_line_naming_the_file(small_disk, size):
    """The command in its own process (TensorBoard's writer thread fails too: its traceback must stay off stderr)."""
    from tests.conftest import SMALL

    disk = small_disk(size)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "fedml_ssfl", "run", *_sets(*SMALL, f"common_args.output_dir={disk}")]
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    err = "\n".join(x for x in res.stderr.splitlines() if not x.startswith(("INFO ", "WARNING ")))
    line = err.strip().splitlines()[-1]
    assert res.returncode == 1 and err.strip() == line, res.stderr  # one line: no thread's traceback beside it
    assert line.startswith("fedml-ssfl: error: ") and "please report it" not in err, err
    assert f"cannot write in the run folder {disk / 'digits_semifl'}: {disk / 'digits_semifl'}/" in line, line
    assert "No space left on device" in line and "(summary.json was not written: " in line, line
    # no checkpoint yet: --resume would be refused, so the line advises what works (issue 38)
    assert "no checkpoint was written yet, so there is nothing to resume" in line and "--resume" not in line, line


TENSORBOARD_ON_A_FULL_DISK = """
import sys, threading
from pathlib import Path
from fedml_ssfl.tracking import RunTracker
tracker = RunTracker(Path(sys.argv[1]), tensorboard=True)
try:
    tracker._writer()  # TensorBoard's writer writes its first event from its own thread
except OSError as exc:
    print("refused:", exc.strerror)
for thread in threading.enumerate():
    if thread is not threading.main_thread():
        thread.join(10)
"""


def test_a_tensorboard_writer_thread_failing_on_a_full_disk_prints_no_traceback(small_disk):
    """The run reports the error in one line; the writer thread re-raises it and Python would print its traceback."""
    disk = small_disk("4k")
    (disk / "filler").write_bytes(b"x" * 4096)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-c", TENSORBOARD_ON_A_FULL_DISK, str(disk / "run")]
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "refused: No space left on device", (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "Exception in thread" not in res.stderr, res.stderr


def test_a_write_outside_the_run_folder_is_named_as_such(tmp_path, capsys, monkeypatch):
    """A spill folder elsewhere (device_args.state_spill_dir) that fills up is not blamed on the run folder."""
    import errno

    import fedml_ssfl.runtime.common as common
    from tests.conftest import SMALL

    spill = tmp_path / "spill" / "states.pt"

    def full(path, payload):
        raise OSError(errno.ENOSPC, "No space left on device", str(spill))

    monkeypatch.setattr(common, "save_checkpoint", full)
    assert main(["run", *_sets(*SMALL, f"common_args.output_dir={tmp_path / 'runs'}")]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    run_dir = tmp_path / "runs" / "digits_semifl"
    assert f"round 1: cannot write {spill} (outside the run folder {run_dir}): {spill}: No space left" in line, line
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


def test_a_full_disk_under_the_heat_map_is_one_line_naming_it(small_disk, capsys):
    disk = small_disk("4k")
    (disk / "filler").write_bytes(b"x" * 4096)
    out = disk / "split.png"
    assert main(["partition", "--set", "data_args.dataset=digits", "--out", str(out)]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"fedml-ssfl: error: {out}: No space left on device; free disk space there (or write the outputs elsewhere) "
        "and run the command again"
    )
    assert not out.exists() and not list(disk.glob("*.tmp"))


# ---------------------------------------------------------------------------------------------
# a GRPC job's files: each named for what is wrong with it, not as a port in use


def _grpc_job(tmp: Path, *, ip: str = "127.0.0.1", bom: bool = False) -> tuple[Path, list[str]]:
    """A 2-process GRPC job's ipconfig and test certificates (deploy/make_test_certs.sh) as --set items."""
    certs = tmp / "certs"
    script = ROOT / "deploy" / "make_test_certs.sh"
    subprocess.run(["bash", str(script), str(certs), "2"], check=True, timeout=60, capture_output=True)
    ipconfig = tmp / "ipconfig.csv"
    text = f"eid,rank,grpc_server_ip,grpc_server_port\n0,0,{ip},18990\n1,1,127.0.0.1,18991\n"
    ipconfig.write_bytes(("\ufeff" if bom else "").encode() + text.encode())
    return certs, [
        "common_args.training_type=cross_silo",
        "comm_args.backend=GRPC",
        f"comm_args.grpc_ipconfig_path={ipconfig}",
        "train_args.client_num_in_total=1",
        "train_args.client_num_per_round=1",
        f"comm_args.tls_ca={certs / 'ca.pem'}",
        f"comm_args.tls_cert={certs / 'rank{rank}.pem'}",
        f"comm_args.tls_key={certs / 'rank{rank}.key'}",
        f"comm_args.job_key_file={certs / 'job.key'}",
        f"common_args.output_dir={tmp / 'runs'}",
    ]


def test_a_grpc_jobs_bad_files_are_named_before_any_port_is_bound(tmp_path, capsys):
    certs, job = _grpc_job(tmp_path)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    (tmp_path / "bad.pem").write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    cases = [
        (
            [f"comm_args.tls_ca={tmp_path / 'junk.pem'}"],
            f"comm_args.tls_ca: {tmp_path / 'junk.pem'} holds no PEM certificate",
        ),
        (
            [f"comm_args.tls_ca={tmp_path / 'bad.pem'}"],
            f"comm_args.tls_ca: {tmp_path / 'bad.pem'} is not a certificate OpenSSL can read",
        ),
        (
            [f"comm_args.tls_cert={certs / 'rank0.key'}", f"comm_args.tls_key={certs / 'rank0.pem'}"],
            f"comm_args.tls_cert {certs / 'rank0.key'} holds a private key and comm_args.tls_key "
            f"{certs / 'rank0.pem'} a certificate: the two are swapped",
        ),
        (
            [f"comm_args.tls_key={certs / 'rank1.key'}"],
            f"comm_args.tls_key {certs / 'rank1.key'} is not the private key of comm_args.tls_cert "
            f"{certs / 'rank0.pem'}",
        ),
    ]
    for extra, expected in cases:
        assert main(["run", *_sets(*job, *extra), "--rank", "0"]) == 2, extra
        err = capsys.readouterr().err
        line = err.strip().splitlines()[-1]
        assert line.startswith("fedml-ssfl: error: ") and expected in line, err
        assert "in use" not in line and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # refused before a run folder was made


def test_an_ipconfig_address_that_is_no_address_is_named_and_a_byte_order_mark_is_no_header(tmp_path, capsys):
    from fedml_ssfl.runtime.fedml.launch import read_ipconfig

    _, job = _grpc_job(tmp_path, ip="999.1.1.1")
    with pytest.raises(ConfigError, match=r"rank 0's grpc_server_ip '999\.1\.1\.1' is not an IP address"):
        read_ipconfig(tmp_path / "ipconfig.csv")
    assert main(["run", *_sets(*job), "--rank", "0"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "ipconfig.csv: rank 0's grpc_server_ip '999.1.1.1' is not an IP address or a host name" in line, line
    _grpc_job(tmp_path / "bom", bom=True)
    table = read_ipconfig(tmp_path / "bom" / "ipconfig.csv")
    assert table == {0: ("127.0.0.1", 18990), 1: ("127.0.0.1", 18991)}
    _grpc_job(tmp_path / "named", ip="silo-0.example.org")
    assert read_ipconfig(tmp_path / "named" / "ipconfig.csv")[0] == ("silo-0.example.org", 18990)


def test_a_model_too_large_for_one_onnx_file_is_refused_before_export(tmp_path):
    """3 GiB of weights (on the meta device: nothing allocated) cannot be one ONNX file; named before exporting."""
    import torch

    from mobile_export.export import EdgeMetadata, ExportError, export_model

    big = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3 * 2**22, device="meta"))
    meta = EdgeMetadata(class_names=["a", "b"], mean=[0.5], std=[0.5], in_channels=1, image_size=8, thresholds=[0.9])
    with pytest.raises(ExportError, match=r"the model's weights take 3\.05 GiB, more than the 2 GiB one ONNX file"):
        export_model(big, tmp_path / "edge", meta, test_images=np.zeros((2, 1, 8, 8), np.uint8), quantize=False)
    assert not (tmp_path / "edge" / "model.onnx").exists()


def test_a_negative_thread_count_is_named(capsys):
    assert main(["bench", "--threads", "-2"]) == 2
    line = capsys.readouterr().err.strip()
    assert line == "fedml-ssfl: error: --threads -2: give a number of torch threads >= 1, or 0 for torch's default"
