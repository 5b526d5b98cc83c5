"""Shared fixtures: small, fast experiment configs on the shipped `digits` data."""

from __future__ import annotations

import pytest
import torch

from fedml_ssfl.config import ExperimentConfig, load_config

torch.set_num_threads(2)

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
