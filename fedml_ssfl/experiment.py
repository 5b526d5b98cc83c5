"""Build everything a run needs from a validated config: data, split, model, algorithm.

Both runtimes call :func:`build_experiment`, so they see identical data, partitions and
initial models for the same config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from . import seeding
from .algorithms import registry
from .algorithms.base import Algorithm, ClientData, DataInfo, ServerData, TrainSettings
from .config import ConfigError, ExperimentConfig, partition_options
from .data import ImageDataset, Split, build_split, load_dataset
from .models import build_model

log = logging.getLogger(__name__)


@dataclass
class Experiment:
    """A run's ingredients."""

    config: ExperimentConfig
    dataset: ImageDataset
    split: Split
    data_info: DataInfo
    algorithm: Algorithm
    device: torch.device

    def client_data(self, client_id: int, round_idx: int | None = None) -> ClientData:
        """Client ``client_id``'s index arrays into the shared training tensor, as seen at ``round_idx``.

        With a streaming partition (``streaming_noniid``) and a round given, the unlabeled indices
        are only the stages released by that round (:meth:`~fedml_ssfl.data.Split.unlabeled_at`,
        a pure function of the round, so both runtimes and resumed runs see the same data);
        ``round_idx=None`` gives all of them. The labeled indices never depend on the round.
        """
        return ClientData(
            client_id=client_id,
            images=self.dataset.train_images,
            labels=self.dataset.train_labels,
            unlabeled_idx=self.split.unlabeled_at(client_id, round_idx),
            labeled_idx=self.split.client_labeled[client_id],
            num_classes=self.dataset.num_classes,
        )


def resolve_device(cfg: ExperimentConfig) -> torch.device:
    """The torch device named by ``device_args``, with a clear error when CUDA is absent."""
    if cfg.device_args.device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device_args.device: 'cuda' was asked for but no CUDA device is visible; use 'cpu'")
        return torch.device("cuda", cfg.device_args.gpu_id)
    return torch.device("cpu")


def load_experiment_dataset(cfg: ExperimentConfig) -> ImageDataset:
    """The dataset named in ``data_args`` (shipped, synthetic or from ``data_cache_dir``)."""
    d = cfg.data_args
    options = {}
    if d.dataset == "synthetic":
        options = {
            "num_samples": d.synthetic_num_samples,
            "num_classes": d.synthetic_num_classes,
            "shape": tuple(d.synthetic_shape),
        }
    try:
        return load_dataset(
            d.dataset,
            root=Path(d.data_cache_dir).expanduser(),
            download=d.download,
            seed=cfg.common_args.random_seed,
            **options,
        )
    except ValueError as exc:
        raise ConfigError(f"data_args.dataset: {exc}") from exc


def make_split(cfg: ExperimentConfig, dataset: ImageDataset) -> Split:
    """The server/client split for ``cfg`` (a pure function of the data config and seed)."""
    d, t = cfg.data_args, cfg.train_args
    try:
        split = build_split(
            dataset.train_labels,
            dataset.num_classes,
            num_clients=t.client_num_in_total,
            seed=cfg.common_args.random_seed,
            scenario=d.label_scenario,
            num_server_labels=d.num_server_labels,
            num_server_val=d.num_server_val,
            method=d.partition_method,
            non_iid_r=d.non_iid_r,
            alpha=d.partition_alpha,
            labels_per_class_client=d.labels_per_class_client,
            **partition_options(d),
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if split.streaming:
        last = (split.num_stages - 1) * split.rounds_per_stage
        if last >= t.comm_round:
            log.warning(
                "streaming partition: the last of the %d stages is released at round %d, but the run has only "
                "train_args.comm_round=%d rounds (rounds 0..%d); raise comm_round or lower data_args.num_stages / "
                "rounds_per_stage to see all the unlabeled data",
                split.num_stages,
                last,
                t.comm_round,
                t.comm_round - 1,
            )
    return split


def model_factory(cfg: ExperimentConfig, dataset: ImageDataset):
    """A zero-argument callable building the configured model."""
    try:
        build_model(
            cfg.model_args.model,
            num_classes=dataset.num_classes,
            in_channels=dataset.in_channels,
            image_size=dataset.image_size,
            norm=cfg.model_args.norm,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return partial(
        build_model,
        cfg.model_args.model,
        num_classes=dataset.num_classes,
        in_channels=dataset.in_channels,
        image_size=dataset.image_size,
        norm=cfg.model_args.norm,
    )


def train_settings(cfg: ExperimentConfig) -> TrainSettings:
    t = cfg.train_args
    return TrainSettings(
        local_steps=t.local_steps,
        batch_size=t.batch_size,
        learning_rate=t.learning_rate,
        momentum=t.momentum,
        weight_decay=t.weight_decay,
        comm_round=t.comm_round,
        lr_schedule=t.lr_schedule,
        lr_cosine_c=t.lr_cosine_c,
        lr_warmup_rounds=t.lr_warmup_rounds,
        lr_floor=t.lr_floor,
        num_clients=t.client_num_in_total,
    )


def build_experiment(cfg: ExperimentConfig, dataset: ImageDataset | None = None) -> Experiment:
    """Load data, partition it, and construct the algorithm (server side not yet set up)."""
    if cfg.device_args.num_threads:
        torch.set_num_threads(cfg.device_args.num_threads)
    device = resolve_device(cfg)
    dataset = dataset or load_experiment_dataset(cfg)
    split = make_split(cfg, dataset)
    info = DataInfo(
        num_classes=dataset.num_classes,
        in_channels=dataset.in_channels,
        image_size=dataset.image_size,
        mean=tuple(dataset.mean),
        std=tuple(dataset.std),
        flip=dataset.flip,
    )
    server = ServerData(
        images=dataset.train_images,
        labels=dataset.train_labels,
        labeled_idx=split.server_labeled,
        val_idx=split.server_val,
        num_classes=dataset.num_classes,
        label_scenario=cfg.data_args.label_scenario,
    )
    factory = model_factory(cfg, dataset)

    def model_fn() -> nn.Module:
        # Initialisation draws from torch's global stream; forking it keeps every model build (the
        # initial model, scratch models built lazily in whichever round first needs them) from
        # shifting the dropout masks that later draws in the same stream would see.
        with torch.random.fork_rng(devices=[]):
            return factory()

    seeding.seed_everything(cfg.common_args.random_seed)
    algo = registry.create(
        cfg.algorithm,
        config=cfg.ssfl_args,
        model_fn=model_fn,
        server_data=server,
        data_info=info,
        train=train_settings(cfg),
        device=device,
        seed=cfg.common_args.random_seed,
    )
    return Experiment(config=cfg, dataset=dataset, split=split, data_info=info, algorithm=algo, device=device)
