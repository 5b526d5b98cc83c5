"""Build everything a run needs from a validated config: data, split, model, algorithm.

Both runtimes call :func:`build_experiment`, so they see identical data, partitions and
initial models for the same config.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from . import seeding
from .algorithms import registry
from .algorithms.base import Algorithm, ClientData, DataInfo, ServerData, TrainSettings
from .atomic import atomic_write
from .config import SCRIPT_DATA, ConfigError, ExperimentConfig, partition_options
from .contract import epoch_steps
from .data import ImageDataset, Split, build_split, load_dataset
from .data.placement import place_dataset, place_images
from .models import build_model
from .models.layout import apply_layout
from .models.precision import apply_precision, check_autocast_device
from .stacked import refuse_random_layers

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
    """The torch device named by ``device_args``, with a clear error when CUDA is absent or the device
    cannot run ``device_args.autocast`` (:func:`~fedml_ssfl.models.precision.check_autocast_device`)."""
    if cfg.device_args.device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device_args.device: 'cuda' was asked for but no CUDA device is visible; use 'cpu'")
        device = torch.device("cuda", cfg.device_args.gpu_id)
    else:
        device = torch.device("cpu")
    problem = check_autocast_device(cfg.device_args.autocast, device)
    if problem is not None:
        raise ConfigError(problem)
    return device


def deployed(cfg: ExperimentConfig) -> bool:
    """Whether ``cfg`` runs FedML's deployment mode (every process reads only its own files)."""
    return cfg.comm_args.mode == "deployment"


_REUSABLE_DATASETS = ("mnist5k", "digits", "synthetic")
"""Datasets built from shipped or generated data only: the same arrays for the same options every time."""

_last_dataset: list[tuple[tuple, ImageDataset]] = []


def load_experiment_dataset(cfg: ExperimentConfig) -> ImageDataset:
    """The dataset named in ``data_args`` (shipped, synthetic or from ``data_cache_dir``).

    In deployment mode: the server's own data (``data_args.server_data`` / ``server_val_data`` /
    ``test_data``), never a silo's. A shipped or synthetic dataset is loaded once per process: the
    last one is kept and handed out again for the same options (``fedml-ssfl run`` then loads the
    main job's data once for the run and its ``compare_with`` baselines). Its tensors are shared, so
    they must not be modified in place (nothing in the package does).
    """
    d = cfg.data_args
    if not deployed(cfg) and d.dataset in _REUSABLE_DATASETS:
        key = (d.dataset, cfg.common_args.random_seed, d.synthetic_num_samples, d.synthetic_num_classes)
        key += (tuple(d.synthetic_shape),)
        if _last_dataset and _last_dataset[0][0] == key:
            return _last_dataset[0][1]
        dataset = _load_experiment_dataset(cfg)
        _last_dataset[:] = [(key, dataset)]
        return dataset
    return _load_experiment_dataset(cfg)


def script_data(cfg: ExperimentConfig) -> bool:
    """Whether ``cfg``'s data is the dataset list a FedML script passes to ``FedMLRunner`` (not files)."""
    return deployed(cfg) and cfg.data_args.local_data == SCRIPT_DATA


def _refuse_script_data(cfg: ExperimentConfig, key: str) -> None:
    if getattr(cfg.data_args, key) == SCRIPT_DATA:
        raise ConfigError(
            f"data_args.{key}: {SCRIPT_DATA} means the data is the dataset list a FedML script passes to FedMLRunner, "
            "so only that script can run this config (mpirun -np K+1 python SCRIPT --cf CONFIG); to run it here, "
            "name the files (docs/deploy.md)"
        )


def _load_experiment_dataset(cfg: ExperimentConfig) -> ImageDataset:
    d = cfg.data_args
    if deployed(cfg):
        from .data.silos import SiloDataError, load_server_dataset

        _refuse_script_data(cfg, "server_data")
        try:
            return load_server_dataset(
                d.server_data,
                d.test_data,
                d.server_val_data,
                num_classes=d.num_classes,
                mean=d.norm_mean,
                std=d.norm_std,
                flip=d.flip,
            )
        except SiloDataError as exc:
            raise ConfigError(str(exc)) from exc
    options: dict = {}
    if d.dataset in ("npz", "folder"):
        options = {"flip": d.flip}
    elif d.dataset == "synthetic":
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
    """The server/client split for ``cfg`` (a pure function of the data config and seed).

    In deployment mode the server's split: its labeled and validation samples, no client data.
    """
    d, t = cfg.data_args, cfg.train_args
    if deployed(cfg):
        from .data.silos import server_split

        return server_split(dataset, t.client_num_in_total, d.label_scenario)
    try:
        split = build_split(
            dataset.train_labels,
            dataset.num_classes,
            partition_options(d),
            num_clients=t.client_num_in_total,
            seed=cfg.common_args.random_seed,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if split.streaming:
        last = (split.num_stages - 1) * split.rounds_per_stage
        if last >= t.comm_round:
            log.warning(
                "streaming partition: the last of the %d stages is released at round %d, but the run has only "
                "train_args.comm_round=%d rounds; raise comm_round or lower data_args.num_stages / "
                "rounds_per_stage to see all the unlabeled data",
                split.num_stages,
                last + 1,
                t.comm_round,
            )
    return split


def model_factory(cfg: ExperimentConfig, info: ImageDataset | DataInfo):
    """A zero-argument callable building the configured model for data shaped like ``info``.

    ``info`` is the dataset, or (deployment mode, on a silo) the :class:`DataInfo` the server sent.

    Raises
    ------
    ConfigError
        The model is not registered, cannot take the data, or is a FedML script's own model
        (``script:<class>``), which only that script can build.
    """
    from .models.script import SCRIPT_MODEL_PREFIX

    if cfg.model_args.model.startswith(SCRIPT_MODEL_PREFIX):
        raise ConfigError(
            f"model_args.model {cfg.model_args.model!r}: this run trained a FedML script's own model, which only that "
            "script builds; run the script (FedMLRunner), or register the model with @register_model "
            "(fedml_ssfl.models) and name it here"
        )
    kwargs = {
        "num_classes": info.num_classes,
        "in_channels": info.in_channels,
        "image_size": info.image_size,
        "norm": cfg.model_args.norm,
        "logits": cfg.model_args.logits,  # a model returning a tuple / dict: which output is the logits
    }
    try:
        build_model(cfg.model_args.model, **kwargs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return partial(build_model, cfg.model_args.model, **kwargs)


def resolve_local_steps(cfg: ExperimentConfig, server_samples: int = 0) -> int:
    """The server's T, its steps per round: ``train_args.local_steps``, or from FedML's local epochs.

    With ``train_args.epochs`` E > 0 (FedML's key; 0 = off), ``T = E x ceil(n / B)`` with ``n`` the
    server's own labeled samples (``server_samples``) and ``B`` ``train_args.batch_size``: E passes over
    its own data, as every client's T is over its own (each client's T is resolved from the data it
    holds, :meth:`fedml_ssfl.algorithms.base.Algorithm.client_train`). It is what an algorithm's server
    trains where its steps default to ``train_args.local_steps``; ``local_steps`` is then not used.

    Parameters
    ----------
    cfg : ExperimentConfig
        The validated config.
    server_samples : int
        The server's labeled samples (0 on a deployed silo, which never trains the server's side).

    Returns
    -------
    int
        T >= 1.
    """
    t = cfg.train_args
    if t.epochs <= 0:
        return t.local_steps
    return epoch_steps(t.epochs, server_samples, t.batch_size)


def train_settings(cfg: ExperimentConfig, server_samples: int = 0) -> TrainSettings:
    """``train_args`` for the algorithm; ``server_samples`` (the server's labels) sizes the server's
    own T for ``train_args.epochs`` (:func:`resolve_local_steps`)."""
    t = cfg.train_args
    if t.epochs > 0:
        log.info(
            "train_args.epochs = %d (FedML's local epochs): each client takes E x ceil(n_k / B) local steps a round "
            "over its own data (docs/algorithms.md, Local epochs); train_args.local_steps is not used",
            t.epochs,
        )
    return TrainSettings(
        local_steps=resolve_local_steps(cfg, server_samples),
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
        idle_clients=t.idle_clients,
        epochs=max(0, t.epochs),
    )


def data_info(dataset: ImageDataset) -> DataInfo:
    """What an algorithm needs to know about ``dataset`` to build its inputs."""
    return DataInfo(
        num_classes=dataset.num_classes,
        in_channels=dataset.in_channels,
        image_size=dataset.image_size,
        mean=tuple(dataset.mean),
        std=tuple(dataset.std),
        flip=dataset.flip,
    )


def make_algorithm(
    cfg: ExperimentConfig,
    info: DataInfo,
    server: ServerData,
    device: torch.device,
    split: Split | None = None,
    factory: Callable[[], nn.Module] | None = None,
) -> Algorithm:
    """The configured algorithm, seeded, with its model factory (server side not yet set up).

    Every process that runs a party of an experiment builds its algorithm here, so the initial
    models are the same wherever it runs (the simulator, a FedML worker, a deployed silo).
    ``factory`` replaces the registry's model (a FedML script's own module:
    :func:`~fedml_ssfl.models.script.script_model_factory`). ``split`` is accepted and not used: with
    ``train_args.epochs`` each client's steps come from its own data at its update, the server's from
    ``server``'s labels (:func:`train_settings`).
    """
    factory = factory or model_factory(cfg, info)
    memory_format = cfg.device_args.memory_format
    autocast = cfg.device_args.autocast

    def model_fn() -> nn.Module:
        # Initialisation draws from torch's global stream; forking it keeps every model build (the
        # initial model, scratch models built lazily in whichever round first needs them) from
        # shifting the dropout masks that later draws in the same stream would see.
        with torch.random.fork_rng(devices=[]):
            model = factory()
        return apply_precision(apply_layout(model, memory_format, device.type), autocast)

    if cfg.train_args.stack_clients:  # refused here, before a run folder exists, not at round 1
        with torch.random.fork_rng(devices=[]):
            refuse_random_layers(factory())
    seeding.seed_everything(cfg.common_args.random_seed)
    return registry.create(
        cfg.algorithm,
        config=cfg.ssfl_args,
        model_fn=model_fn,
        server_data=server,
        data_info=info,
        train=train_settings(cfg, len(server.labeled_idx)),  # the server's own T for train_args.epochs
        device=device,
        seed=cfg.common_args.random_seed,
    )


def build_experiment(
    cfg: ExperimentConfig, dataset: ImageDataset | None = None, factory: Callable[[], nn.Module] | None = None
) -> Experiment:
    """Load data (or take ``dataset``), partition it, and construct the algorithm (server side not yet set up).

    ``factory`` builds the model instead of ``model_args.model`` (a FedML script's own module).
    """
    if cfg.device_args.num_threads:
        torch.set_num_threads(cfg.device_args.num_threads)
    device = resolve_device(cfg)
    dataset = dataset or load_experiment_dataset(cfg)
    split = make_split(cfg, dataset)
    info = data_info(dataset)
    if cfg.device_args.data_on_device:
        dataset = place_dataset(dataset, device)
    server = ServerData(
        images=dataset.train_images,
        labels=dataset.train_labels,
        labeled_idx=split.server_labeled,
        val_idx=split.server_val,
        num_classes=dataset.num_classes,
        label_scenario=cfg.data_args.label_scenario,
    )
    algo = make_algorithm(cfg, info, server, device, split, factory)
    return Experiment(config=cfg, dataset=dataset, split=split, data_info=info, algorithm=algo, device=device)


@dataclass
class SiloExperiment:
    """A deployed silo's ingredients: its algorithm (client side) and its own data, nothing else.

    Built by :func:`build_silo_experiment` from the config and the server's metadata; offers the
    same ``client_data`` / ``algorithm`` / ``device`` / ``config`` a FedML worker uses in simulation.
    """

    config: ExperimentConfig
    silo: int
    data_info: DataInfo
    algorithm: Algorithm
    device: torch.device
    images: torch.Tensor
    labels: torch.Tensor
    unlabeled_idx: torch.Tensor
    labeled_idx: torch.Tensor

    def client_data(self, client_id: int, round_idx: int | None = None) -> ClientData:
        """This silo's data (``client_id`` must be the silo itself; labels -1 are hidden)."""
        if client_id != self.silo:
            raise RuntimeError(f"silo {self.silo} was asked to train silo {client_id}'s data, which it does not hold")
        return ClientData(
            client_id=self.silo,
            images=self.images,
            labels=self.labels,
            unlabeled_idx=self.unlabeled_idx,
            labeled_idx=self.labeled_idx,
            num_classes=self.data_info.num_classes,
        )


def build_silo_experiment(
    cfg: ExperimentConfig, meta, rank: int, data=None, factory: Callable[[], nn.Module] | None = None
) -> SiloExperiment:
    """Silo ``rank - 1``'s experiment: its own file (``data_args.local_data``) checked against ``meta``.

    Parameters
    ----------
    cfg : ExperimentConfig
        The run's config (deployment mode).
    meta : fedml_ssfl.data.silos.SiloMeta
        The server's metadata (class count and names, image shape, normalisation, flips).
    rank : int
        This process's rank (1..K); it serves silo ``rank - 1``.
    data : fedml_ssfl.data.local_files.LocalImages, optional
        The silo's data, already read (a FedML script's list: :func:`fedml_ssfl.data.fedml_lists.silo_data`),
        instead of ``local_data``'s file; checked against ``meta`` all the same.
    factory : callable, optional
        Builds the model instead of ``model_args.model`` (a FedML script's own module).

    Raises
    ------
    fedml_ssfl.data.silos.SiloDataError
        The silo's file is missing, malformed or disagrees with ``meta`` (the message names it).
    """
    from .data.silos import check_silo, load_silo, silo_indices, silo_path

    if cfg.device_args.num_threads:
        torch.set_num_threads(cfg.device_args.num_threads)
    device = resolve_device(cfg)
    if data is None:
        _refuse_script_data(cfg, "local_data")
        data = load_silo(silo_path(cfg.data_args.local_data, rank), meta)
    else:
        check_silo(data, meta)
    unlabeled, labeled = silo_indices(data.labels)
    if cfg.data_args.label_scenario == "server" and labeled.numel():
        log.warning(
            "silo %d: %s has %d labeled samples, but data_args.label_scenario is 'server': they are trained on as "
            "unlabeled samples (their labels feed only the pseudo-label accuracy diagnostic)",
            rank - 1,
            data.source,
            labeled.numel(),
        )
        unlabeled, labeled = torch.arange(len(data.labels)), labeled[:0]
    info = DataInfo(
        num_classes=meta.num_classes,
        in_channels=meta.in_channels,
        image_size=meta.image_size,
        mean=tuple(meta.mean),
        std=tuple(meta.std),
        flip=meta.flip,
    )
    empty = torch.zeros(0, dtype=torch.long)
    nothing = ServerData(
        images=data.images[:0],
        labels=data.labels[:0],
        labeled_idx=empty,
        val_idx=empty,
        num_classes=meta.num_classes,
        label_scenario=cfg.data_args.label_scenario,
    )
    algo = make_algorithm(cfg, info, nothing, device, factory=factory)
    return SiloExperiment(
        config=cfg,
        silo=rank - 1,
        data_info=info,
        algorithm=algo,
        device=device,
        images=place_images(data.images, device) if cfg.device_args.data_on_device else data.images,
        labels=data.labels,
        unlabeled_idx=unlabeled,
        labeled_idx=labeled,
    )


def export_deployment(cfg: ExperimentConfig, out_dir: str | Path, backend: str = "MPI") -> Path:
    """Materialise ``cfg``'s simulation split as deployment files and write the config that runs them.

    Writes, under ``out_dir``: ``silo_{k}.npz`` for every silo, ``server.npz`` (+ ``server_val.npz``)
    and ``test.npz`` (:func:`fedml_ssfl.data.silos.export_split`), and ``deployment.yaml``: ``cfg``
    with ``comm_args.mode: deployment``, the FedML ``backend``, the files' absolute paths
    (``local_data`` with the ``{silo}`` placeholder), the class count and the normalisation of the
    simulated dataset, so that the deployment run sees exactly what the simulator sees.

    Returns
    -------
    Path
        The written ``deployment.yaml``.
    """
    import yaml

    from .data.silos import SiloDataError, export_split

    if backend not in ("MPI", "GRPC"):
        raise ConfigError(f"--backend {backend}: deployment runs under FedML's MPI or GRPC")
    dataset = load_experiment_dataset(cfg)
    split = make_split(cfg, dataset)
    out = Path(out_dir).expanduser().resolve()
    try:
        files = export_split(dataset, split, out)
    except SiloDataError as exc:
        raise ConfigError(str(exc)) from exc
    raw = cfg.to_dict()
    raw["common_args"].update(training_type="cross_silo", run_name=f"{cfg.common_args.run_name}_deployment")
    raw["common_args"]["compare_with"] = []
    raw["comm_args"].update(backend=backend, mode="deployment")
    raw["data_args"].update(
        local_data=str(out / "silo_{silo}.npz"),
        server_data=str(files["server_data"]),
        server_val_data=str(files.get("server_val_data", "")),
        test_data=str(files["test_data"]),
        num_classes=dataset.num_classes,
        norm_mean=[float(v) for v in dataset.mean],
        norm_std=[float(v) for v in dataset.std],
        flip=bool(dataset.flip),
    )
    path = out / "deployment.yaml"
    header = (
        f"# Deployment of {cfg.common_args.run_name}'s split (seed {cfg.common_args.random_seed}), written by\n"
        "# `fedml-ssfl partition --export`: silo k reads only silo_k.npz, the server only server*.npz and test.npz.\n"
    )
    text = (header + yaml.safe_dump(raw, sort_keys=False)).encode("utf-8")
    return atomic_write(path, lambda fh: fh.write(text))
