"""Shared fixtures: small, fast experiment configs on the shipped `digits` data."""

from __future__ import annotations

import os

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
