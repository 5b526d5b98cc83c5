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
