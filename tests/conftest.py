"""Shared fixtures: small, fast experiment configs on the shipped `digits` data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fedml_ssfl.config import ExperimentConfig, load_config

# One torch thread per process: the tests' models are tiny, several test processes (mpirun, GRPC)
# share two cores, and OpenMP's spinning threads slow a 2-thread step 100x when a core is busy.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

SMALL = [
    "data_args.dataset=digits",
    "data_args.num_server_labels=50",
    "model_args.model=cnn28",
    "model_args.norm=gn",
    "train_args.client_num_in_total=4",
    "train_args.client_num_per_round=4",
    "train_args.comm_round=2",
    "train_args.local_steps=3",
    "train_args.batch_size=32",
    "common_args.compare_with=[]",
    "tracking_args.progress_bar=false",
    "tracking_args.enable_tensorboard=false",
    "tracking_args.checkpoint_every=1",
]


@pytest.fixture
def small_config(tmp_path):
    """Build a small validated config; extra ``section.key=value`` strings override it."""

    def make(*overrides: str) -> ExperimentConfig:
        return load_config(None, [*SMALL, f"common_args.output_dir={tmp_path / 'runs'}", *overrides])

    return make


def assert_same_state(a, b, path: str = "state") -> None:
    """Nested dicts / lists of tensors and plain values are identical (tensors bit for bit)."""
    import math

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.layout == b.layout, path
        assert torch.equal(a.to_dense() if a.is_sparse else a, b.to_dense() if b.is_sparse else b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple, set)) and not isinstance(a, set):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, path


def resume_matches_uninterrupted(cfg: ExperimentConfig, tmp_path, stop_after: int = 2) -> tuple[dict, dict]:
    """Run ``cfg`` whole and as ``stop_after`` rounds + ``--resume``; assert the final checkpoints'
    algorithm and client states are identical; return both checkpoints (full, resumed)."""
    from fedml_ssfl.checkpoint import load_checkpoint
    from fedml_ssfl.runtime.local import run_local

    full = run_local(cfg, run_dir=tmp_path / "full")
    run_local(cfg, run_dir=tmp_path / "part", stop_after=stop_after)
    resumed = run_local(cfg, run_dir=tmp_path / "part", resume=True)
    assert resumed.rounds_completed == full.rounds_completed and resumed.final_acc == full.final_acc
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "part" / "checkpoints" / "last.pt")
    assert_same_state(a["algorithm"], b["algorithm"], "algorithm")
    assert_same_state(a["client_states"], b["client_states"], "client_states")
    return a, b


def one_line_error(err: str, prefix: str) -> str:
    """The error ``err`` (captured stderr) ends with: one line starting ``prefix``, and no traceback.

    Returns that line, for the caller to check what it names.
    """
    assert "Traceback" not in err, err
    assert prefix in err, err
    tail = err[err.index(prefix) :]
    assert tail.count("\n") <= 1 and tail.strip(), err
    return tail.strip()


BOUND_HEADROOM = 400 * 2**20
"""How much address space a bounded run (:func:`run_bounded`) may add once its modules are imported."""


@dataclass
class Bounded:
    """What one call of a :func:`run_bounded` child did: exit status, stderr, and its peak resident growth."""

    code: int
    err: str
    peak_growth: int  # bytes of resident memory above the level before the call
    seconds: float = 0.0  # the call's wall time


def run_bounded(preload: list[str], calls: list[str], headroom: int = BOUND_HEADROOM) -> list[Bounded]:
    """Run each of ``calls`` (Python expressions giving an exit status) in one fresh interpreter under ``RLIMIT_AS``.

    The ``preload`` modules are imported first (torch alone maps 3 GiB of address space); from then on
    the address space may grow by ``headroom`` bytes at most, so a reader that allocated what a file
    claims dies of a MemoryError (caught and reported as that call's failure) instead of passing. Each
    call's stderr is captured, and its peak resident growth measured (``/proc/self/clear_refs`` resets
    the high-water mark before it).
    """
    source = textwrap.dedent(
        f"""
        import contextlib, importlib, io, json, resource, sys, time, traceback
        for name in {preload!r}:
            importlib.import_module(name)
        def status(key):
            with open("/proc/self/status") as fh:
                return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key))
        limit = status("VmSize:") + {headroom}
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        results = []
        for call in {calls!r}:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            base, err, start = status("VmRSS:"), io.StringIO(), time.perf_counter()
            with contextlib.redirect_stderr(err):
                try:
                    code = eval(call)
                except BaseException:
                    traceback.print_exc()
                    code = -1
            results.append([code, err.getvalue(), status("VmHWM:") - base, time.perf_counter() - start])
        print("results " + json.dumps(results))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDML_SSFL_")}
    root = str(Path(__file__).resolve().parent.parent)
    env.update(PYTHONPATH=root, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2", PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in res.stdout.splitlines() if line.startswith("results ")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    return [Bounded(*r) for r in json.loads(lines[-1][len("results ") :])]


def write_png(path: Path, width: int, height: int, cut: int = 0, palette: bool = False) -> Path:
    """A grayscale PNG of zeros, compressed as it is written (a 12000x12000 one takes 140 KB and 0.4 s).

    ``cut`` > 0 drops that many bytes from the end: a truncated file whose header is whole. ``palette``
    writes a palette image (Pillow's mode P) instead.
    """
    import struct
    import zlib

    comp = zlib.compressobj(6)
    row = b"\0" * (width + 1)  # filter byte + pixels
    data = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 3 if palette else 0, 0, 0, 0)
    colours = chunk(b"PLTE", b"\x10\x20\x30") if palette else b""
    path.parent.mkdir(parents=True, exist_ok=True)
    whole = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + colours + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    path.write_bytes(whole[: len(whole) - cut])
    return path


def write_npz_member(zf, key: str, shape: tuple[int, ...], dtype: str = "|u1", data_bytes: int | None = None) -> None:
    """Add ``key.npy`` to an open ``zipfile.ZipFile``: a header declaring ``shape``, then ``data_bytes`` zero bytes
    (default: what the header declares), streamed so that a member of gigabytes costs no memory."""
    import numpy as np

    header = {"descr": dtype, "fortran_order": False, "shape": shape}
    with zf.open(f"{key}.npy", "w", force_zip64=True) as fh:
        np.lib.format.write_array_header_1_0(fh, header)
        left = (int(np.prod(shape)) * np.dtype(dtype).itemsize) if data_bytes is None else data_bytes
        block = bytes(min(left, 2**22))
        while left > 0:
            fh.write(block[: min(left, len(block))])
            left -= len(block)


@pytest.fixture
def small_disk(tmp_path):
    """``mount(size)``: a tmpfs of that size under ``tmp_path`` (a real full disk); ``resize(disk, size)``."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        disk = tmp_path / f"d29disk{len(mounted)}"
        disk.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "d29disk", str(disk)], capture_output=True)
        if res.returncode != 0:
            pytest.skip(f"a full disk here is a small tmpfs, and mounting one needs root ({res.stderr.strip()!r})")
        mounted.append(disk)
        return disk

    yield mount
    for disk in mounted:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # detached even if a file is still open


def resize_disk(disk: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True, capture_output=True)


def disk_used(disk: Path) -> int:
    st = os.statvfs(disk)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.fixture
def make_lab(tmp_path):
    """``make_lab(hosts)``: a network lab (tests/netlab.py) torn down after the test, whatever happens.

    Skips, naming why, only where this machine refuses network namespaces (``ip netns add`` fails).
    """
    from tests.netlab import Lab, NamespacesRefused, terminate_as_interrupt

    labs = []

    def make(hosts: list[str], **kwargs):
        lab = Lab(hosts, tmp_path / f"lab{len(labs)}", **kwargs)
        try:
            lab.start()
        except NamespacesRefused as exc:
            pytest.skip(f"network namespaces refused: {exc}")
        labs.append(lab)
        return lab

    with terminate_as_interrupt():
        try:
            yield make
        finally:
            for lab in labs:
                lab.close()
