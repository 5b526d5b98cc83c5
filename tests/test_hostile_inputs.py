"""Hostile and misleading inputs (issue 38, items 3 and 6): each ends in one line naming the input and the fix.

Item 3: a config whose aliases expand without end, a file that is a device or 1 GiB, a number past any sane
bound, a byte the YAML or CSV reader refuses; item 6: inputs that were answered with a misleading cause or
accepted silently. Each row runs the command (or the reader a command calls) on a real file and asserts the
one error line, and where a command could have started work, that it did not (no run folder). The alias
bomb runs in a subprocess with a time-out, so a loader that expands the aliases fails the test instead of
hanging it.
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fedml_ssfl.cli import main
from fedml_ssfl.config import ConfigError
from tests.conftest import SMALL
from tests.test_inputs import _grpc_job, _sets

ROOT = Path(__file__).resolve().parent.parent


def _one_line(err: str) -> str:
    """The error line of a command's stderr: the last line, checked to be the only error and no traceback."""
    line = err.strip().splitlines()[-1]
    assert line.startswith("fedml-ssfl: error: ") and "Traceback" not in err, err
    assert "please report it" not in err and err.count("fedml-ssfl: error") == 1, err
    return line


# ---------------------------------------------------------------------------------------------
# YAML: aliases, characters, bytes

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")
)
"""Billion laughs: 9 levels of 9 aliases each, 9**9 values once expanded, in 350 bytes."""

BOMB_RUN = """
import sys, time
import fedml_ssfl.cli, fedml_ssfl.algorithms.registry  # imports are not the loader's time
from fedml_ssfl.cli import main
start = time.process_time()
code = main(["run", sys.argv[1], "--print-config"])
print("cpu", time.process_time() - start, "code", code)
"""


def test_a_billion_laughs_config_is_refused_at_once_naming_the_file(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB + "train_args:\n  comm_round: *i\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [sys.executable, "-c", BOMB_RUN, str(bomb)], capture_output=True, text=True, env=env, timeout=120
    )  # unbounded, the duplicate-key check walks 9**9 alias visits: the time-out fails the test
    cpu, code = res.stdout.split()[1], res.stdout.split()[3]
    assert code == "2", res.stdout + res.stderr
    line = _one_line(res.stderr)
    assert line == (
        f"fedml-ssfl: error: {bomb}, line 6: its aliases (*name) expand to more than 100,000 values; a config holds "
        "a few hundred values: write them out, without nested aliases"
    )
    assert float(cpu) < 1.0, cpu  # measured linear in the file (0.01 s), not in the expansion


YAML_CASES = [
    # (id, config bytes, --set items, text the one error line must hold)
    (
        "an alias inside its own value",
        b"train_args: &t\n  comm_round: [*t]\n",
        [],
        "config.yaml, line 1: an alias refers to a value that contains it (it would expand for ever)",
    ),
    (
        "aliases nested 20 deep",
        b"a: &a0 [1]\n" + b"".join(b"a%d: &a%d [*a%d]\n" % (i, i, i - 1) for i in range(1, 20)),
        [],
        "its aliases (*name) expand to more than 16 levels of nesting",
    ),
    (
        "a NUL byte in the file",
        b"train_args:\n  comm_round: 3\x00\n",
        [],
        "config.yaml, line 2, column 16: a NUL byte, which YAML does not allow; a config is text: remove it",
    ),
    (
        "a control character in a --set value",
        b"",
        ["--set", "train_args.comm_round=3\x01"],
        "--set 'train_args.comm_round=3\\x01', line 1, column 2: the control character U+0001, which YAML does not",
    ),
    (
        "a byte that is not UTF-8",
        b"train_args:\n  comm_round: 3\xff\n",
        [],
        "config.yaml: not a text file (line 2, column 16: byte 0xff is not UTF-8); pass a YAML config",
    ),
    ("malformed YAML names the file", b"train_args:\n  comm_round: [3\n", [], 'in "'),
]


@pytest.mark.parametrize("data, argv, expected", [c[1:] for c in YAML_CASES], ids=[c[0] for c in YAML_CASES])
def test_bytes_yaml_refuses_are_named_with_file_and_position(tmp_path, capsys, data, argv, expected):
    cfg = tmp_path / "config.yaml"
    cfg.write_bytes(data)
    assert main(["run", str(cfg), "--print-config", *argv]) == 2
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert expected in line and "\n" not in line.strip(), line
    assert not out  # nothing printed: no config resolved
    if "malformed" in expected:
        assert f'"{cfg}", line 2' in line and "<unicode string>" not in line, line


def test_an_alias_within_the_bounds_is_a_value_as_before(tmp_path, capsys):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("train_args:\n  comm_round: &r 3\n  local_steps: *r\n")
    assert main(["run", str(cfg), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "comm_round: 3" in out and "local_steps: 3" in out


# ---------------------------------------------------------------------------------------------
# numbers: every key bounded


BOUND_CASES = [
    (
        ["device_args.num_threads=100000"],
        "device_args.num_threads: 100000 is out of range; it must be >= 0 and <= 1024",
    ),
    (["device_args.gpu_id=5000"], "device_args.gpu_id: 5000 is out of range; it must be >= 0 and <= 1023"),
    (["train_args.comm_round=10000000"], "train_args.comm_round: 10000000 is out of range; it must be >= 1 and <= 10"),
    (["train_args.batch_size=1000000"], "train_args.batch_size: 1000000 is out of range; it must be >= 1 and <= 1000"),
    (["train_args.epochs=100000000"], "train_args.epochs: 100000000 is out of range"),
    (["train_args.learning_rate=1e9"], "train_args.learning_rate: 1000000000.0 is out of range"),
    (["validation_args.eval_batch_size=1000000"], "validation_args.eval_batch_size: 1000000 is out of range"),
    (["device_args.state_memory_mb=1e12"], "device_args.state_memory_mb: 1000000000000.0 is out of range"),
    (["ssfl_args.threshold=1e9"], "ssfl_args.threshold: 1000000000.0 is out of range; it must lie within +-10,000,000"),
    (
        ["ssfl_args.algorithm=fedavg_fixmatch", "ssfl_args.unlabeled_batch_size=10000000"],
        "ssfl_args.unlabeled_batch_size: 10000000 is out of range; it must lie within +-100,000",
    ),
]


@pytest.mark.parametrize("items, expected", BOUND_CASES, ids=[c[0][-1].split("=")[0] for c in BOUND_CASES])
def test_a_number_past_its_bound_is_refused_naming_the_key(capsys, items, expected):
    assert main(["run", "--print-config", *(x for item in items for x in ("--set", item))]) == 2
    line = _one_line(capsys.readouterr().err)
    assert expected in line, line


def test_every_numeric_key_of_the_sections_has_a_finite_bound():
    """A new int or float key without an upper bound in RANGES fails here (num_threads had none: SIGSEGV)."""
    import dataclasses
    import typing

    from fedml_ssfl import config

    bounds = {key: hi for key, _, hi, _ in config.RANGES}
    for section, cls in config.SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float):
                key = f"{section}.{f.name}"
                assert bounds.get(key) is not None, f"{key} has no upper bound in config.RANGES"


# ---------------------------------------------------------------------------------------------
# files read with a size limit, and named for what they are


@pytest.fixture(scope="module")
def grpc_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("job")
    certs, job = _grpc_job(tmp)
    big = tmp / "big.pem"
    with big.open("wb") as fh:
        fh.truncate(2**30)  # 1 GiB, sparse: costs no disk
    os.mkfifo(tmp / "fifo")
    (tmp / "folder").mkdir()
    junk = tmp / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n")
    encrypted = tmp / "encrypted.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(certs / "rank0.key"), "-aes256", "-passout", "pass:x", "-out", str(encrypted)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return tmp, certs, job


def _ipconfig(tmp: Path, name: str, data: bytes) -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


GOOD_ROWS = b"eid,rank,grpc_server_ip,grpc_server_port\n0,0,127.0.0.1,18990\n1,1,127.0.0.1,18991\n"


def _file_cases(tmp: Path, certs: Path) -> list[tuple[list[str], str]]:
    fix = "make a test CA with deploy/make_test_certs.sh, or point the key at your PEM file"
    csv_fix = "an ipconfig is a CSV text file with columns eid,rank,grpc_server_ip[,grpc_server_port]"
    binary = _ipconfig(tmp, "binary.csv", bytes(range(256)))
    nul = _ipconfig(tmp, "nul.csv", GOOD_ROWS.replace(b"18991", b"189\x0091"))
    twice = _ipconfig(tmp, "twice.csv", GOOD_ROWS + b"1,1,127.0.0.1,18992\n")
    short = _ipconfig(tmp, "short.csv", GOOD_ROWS + b"2\n")
    big, fifo, folder = tmp / "big.pem", tmp / "fifo", tmp / "folder"
    return [
        (["comm_args.tls_cert=/dev/zero"], "comm_args.tls_cert: /dev/zero is not a regular file (a device, pipe or "),
        ([f"comm_args.tls_cert={big}"], f"comm_args.tls_cert: {big} is larger than 1.0 MiB"),
        ([f"comm_args.tls_ca={fifo}"], f"comm_args.tls_ca: {fifo} is not a regular file"),
        ([f"comm_args.tls_key={folder}"], f"comm_args.tls_key: {folder} is a folder, not a file; {fix}"),
        (["comm_args.job_key_file=/dev/zero"], "comm_args.job_key_file: /dev/zero is not a regular file"),
        ([f"comm_args.job_key_file={big}"], f"comm_args.job_key_file: {big} is larger than"),
        (["comm_args.grpc_ipconfig_path=/dev/zero"], "comm_args.grpc_ipconfig_path: /dev/zero is not a regular file"),
        (
            [f"comm_args.grpc_ipconfig_path={binary}"],
            f"{binary}, line 2, column 118: byte 0x80 is not UTF-8 text; {csv_fix}",
        ),
        ([f"comm_args.grpc_ipconfig_path={nul}"], f"{nul}, line 3, column 18: a NUL byte; {csv_fix}"),
        ([f"comm_args.grpc_ipconfig_path={twice}"], f"{twice}: rank 1 has two rows; give each rank one row"),
        ([f"comm_args.grpc_ipconfig_path={short}"], f"{short}: the row '2' has fewer fields than the header"),
        (
            [f"comm_args.tls_cert={tmp / 'junk.pem'}"],
            f"comm_args.tls_cert: {tmp / 'junk.pem'} is not a certificate OpenSSL can read",
        ),
        (
            [f"comm_args.tls_key={tmp / 'encrypted.key'}"],
            f"comm_args.tls_key: {tmp / 'encrypted.key'} is an encrypted private key",
        ),
    ]


def test_a_grpc_jobs_hostile_files_are_refused_unread_in_one_line(grpc_job, capsys):
    tmp, certs, job = grpc_job
    for extra, expected in _file_cases(tmp, certs):
        assert main(["run", *_sets(*job, *extra), "--rank", "0"]) == 2, extra
        line = _one_line(capsys.readouterr().err)
        assert expected in line, (extra, line)
    assert not (tmp / "runs").exists()  # refused before a run folder was made


def test_a_gpu_mapping_that_is_a_device_or_a_bomb_is_refused(tmp_path):
    from fedml_ssfl.runtime.fedml.launch import gpu_for_rank

    with pytest.raises(ConfigError, match=r"device_args\.gpu_mapping_file: /dev/zero is not a regular file"):
        gpu_for_rank("/dev/zero", "mapping", 0, 2)
    bomb = tmp_path / "gpu_mapping.yaml"
    bomb.write_text(BOMB)
    with pytest.raises(ConfigError, match=r"expand to more than 100,000 values"):
        gpu_for_rank(bomb, "mapping", 0, 2)


# ---------------------------------------------------------------------------------------------
# data, checkpoints, edge files: misleading causes


def _npy_member(zf: zipfile.ZipFile, name: str, shape: tuple[int, ...], dtype: str = "|u1") -> None:
    header = f"{{'descr': '{dtype}', 'fortran_order': False, 'shape': {shape!r}, }}"
    header += " " * (63 - (len(header) + 10) % 64) + "\n"
    zf.writestr(name, b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + bytes(64))


def test_a_negative_npz_shape_is_named_with_the_file(tmp_path):
    from fedml_ssfl.data.local_files import read_npz
    from mobile_export.edge_label import EdgeInputError, load_images

    path = tmp_path / "neg.npz"
    with zipfile.ZipFile(path, "w") as zf:
        _npy_member(zf, "images.npy", (-2, 8, 8))
        _npy_member(zf, "labels.npy", (2,), "<i8")
    expected = "key 'images''s header claims shape (-2, 8, 8), with a negative size: the file is damaged"
    with pytest.raises(ValueError) as info:
        read_npz(path)
    assert str(info.value).startswith(str(path)) and expected in str(info.value), info.value
    with pytest.raises(EdgeInputError) as info:
        load_images(path)
    assert str(info.value).startswith(str(path)) and expected in str(info.value), info.value


def test_float_idx_pixels_are_refused_as_npz_pixels_are(tmp_path):
    from fedml_ssfl.data.datasets import DataFormatError, load_dataset

    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = np.random.default_rng(0).random((4, 28, 28)).astype(">f4")
    for split in ("train", "t10k"):
        header = struct.pack(">BBBB", 0, 0, 0x0D, 3) + struct.pack(">3i", 4, 28, 28)
        (raw / f"{split}-images-idx3-ubyte").write_bytes(header + images.tobytes())
        labels = struct.pack(">BBBB", 0, 0, 0x08, 1) + struct.pack(">i", 4) + bytes([0, 1, 2, 3])
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(labels)
    with pytest.raises(DataFormatError, match=r"train-images-idx3-ubyte: holds float32 pixels, not 8-bit \(uint8"):
        load_dataset("mnist", root=tmp_path)


class Unsafe:
    """A class PyTorch's safe unpickler refuses (a pickle could name any callable instead)."""


def test_a_pickle_or_a_folder_as_the_checkpoint_is_named_for_what_it_is(tmp_path, capsys):
    import torch

    pickle_ckpt = tmp_path / "pickle.pt"
    torch.save({"format": 1, "state": Unsafe()}, pickle_ckpt)
    assert main(["export", str(pickle_ckpt), "--no-int8"]) != 0
    line = _one_line(capsys.readouterr().err)
    assert f"{pickle_ckpt} is not a fedml_ssfl checkpoint: it holds pickled Python objects" in line, line
    assert "(tests.test_hostile_inputs.Unsafe) beyond tensors" in line and "is refused" in line, line
    assert "weights_only" not in line, line
    run = tmp_path / "run"
    (run / "checkpoints" / "last.pt").mkdir(parents=True)
    assert main(["run", "--resume", str(run), "--set", f"common_args.output_dir={tmp_path}"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert f"{run / 'checkpoints' / 'last.pt'} is a folder, not a checkpoint file" in line, line
    assert not (run / "summary.json").exists() and not (run / "metrics.jsonl").exists()  # nothing ran


def test_edge_inputs_that_are_folders_or_lack_images_are_refused(tmp_path):
    from mobile_export.edge_label import EdgeInputError, EdgeLabeler, load_images

    with pytest.raises(EdgeInputError, match=r"model file .* is a folder; pass the model\.onnx / model\.ort in it"):
        EdgeLabeler(tmp_path)
    other = tmp_path / "other.npz"
    np.savez(other, pixels=np.zeros((2, 1, 8, 8), np.uint8))
    with pytest.raises(EdgeInputError, match=r"other\.npz: an \.npz needs an 'images' array \(found pixels\)"):
        load_images(other)


# ---------------------------------------------------------------------------------------------
# silent values: refused, or warned where legal but ignored

SILENT_CASES = [
    ("data_args.norm_std=[0]", "data_args.norm_std: [0.0] holds 0; every channel's std divides the pixels"),
    ("data_args.num_classes=1", "data_args.num_classes: 1 class leaves nothing to classify"),
    ("data_args.norm_mean=[0.1,0.2]", "data_args.norm_mean: [0.1, 0.2] has 2 values; give one per channel"),
]


@pytest.mark.parametrize("item, expected", SILENT_CASES, ids=[c[0].split("=")[0] for c in SILENT_CASES])
def test_a_value_that_cannot_work_is_refused(capsys, item, expected):
    assert main(["run", "--print-config", "--set", item]) == 2
    assert expected in _one_line(capsys.readouterr().err)


def test_deployment_only_keys_in_a_simulation_are_warned_as_ignored(capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="fedml_ssfl.config"):
        assert main(["run", "--print-config", "--set", "data_args.norm_mean=[0.1,0.2,0.3]"]) == 0
    assert "data_args.norm_mean: read only in comm_args.mode deployment; dataset mnist5k brings" in caplog.text


def test_a_script_list_normalised_with_the_wrong_channel_count_is_refused():
    import torch

    from fedml_ssfl.data.fedml_lists import server_dataset

    images = torch.zeros(8, 1, 8, 8, dtype=torch.uint8)
    batches = [(images, torch.arange(8) % 2)]
    dataset = [8, 8, batches, batches, {0: 8}, {0: batches}, {0: batches}, 2]
    with pytest.raises(ConfigError, match=r"need one value per channel of the script's images \(1\), got \[0\.1, 0\.2"):
        server_dataset(dataset, num_server_labels=4, num_server_val=0, seed=0, mean=[0.1, 0.2, 0.3], std=[1, 1, 1])


def test_an_invalid_variable_is_refused_before_the_data_loads(tmp_path, monkeypatch, capsys):
    from fedml_ssfl import envvars

    monkeypatch.setenv("FEDML_SSFL_MAX_MESSAGE_BYTES", "lots")
    sets = [x for item in (*SMALL, f"common_args.output_dir={tmp_path}") for x in ("--set", item)]
    assert main(["run", *sets]) == 2  # read late, the small run would have run (the simulator sends no message)
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("fedml-ssfl: error: FEDML_SSFL_MAX_MESSAGE_BYTES='lots': expected a size in bytes"), line
    assert not list(tmp_path.iterdir())  # nothing ran: no run folder
    listed = set(__import__("re").findall(r"FEDML_[A-Z_]+", envvars.__doc__))
    assert listed == set(envvars.CHECKS), listed ^ set(envvars.CHECKS)
