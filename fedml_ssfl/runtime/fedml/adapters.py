"""The FedML classes a FedML job runs in: ``SSFLAggregator`` / ``SSFLTrainer`` and what they build from.

FedML's ``ServerAggregator`` and ``ClientTrainer`` around the package's server runtime and silo
worker, the dataset-list and model pieces of a FedML script (:class:`ScriptPieces`), and the checks
on them. :mod:`.hooks` is their public place (``from fedml_ssfl.runtime.fedml.hooks import
SSFLAggregator, SSFLTrainer``) and adapts FedML on import; :mod:`.run` and :mod:`.managers` take
them from here, so that the door in :mod:`.hooks` can call :func:`~.run.run_fedml` without a cycle.

Imports FedML.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import torch

with warnings.catch_warnings():  # requests' version check and pkg_resources, at FedML's import
    warnings.simplefilter("ignore")
    from fedml.core import ClientTrainer, ServerAggregator
    from fedml.cross_silo.server.message_define import MyMessage

from ...config import ConfigError, ExperimentConfig
from ...data import ImageDataset
from ...experiment import build_experiment, script_data
from ..common import RunFailed, RunResult, fresh_run_dir, hold_run_folder
from .launch import _with_device, check_server_counts, worker_count
from .payloads import decode, encode
from .protocol import Finish
from .server import DeployedServerRuntime, ServerRuntime
from .wire import WireMeter
from .worker import SiloWorker

DOWN_TYPES = (MyMessage.MSG_TYPE_S2C_INIT_CONFIG, MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT)
UP_TYPES = (MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER,)
UPLOAD_KEY = "ssfl"
"""A worker's upload rides in ``{UPLOAD_KEY: Reply | Failure}``: FedML's server treats a model upload
that is not a dict as a state dict to move to its device."""


def unwrap(upload: Any) -> Any:
    """The protocol record inside a worker's upload (the upload itself when it is not wrapped)."""
    return upload.get(UPLOAD_KEY, upload) if isinstance(upload, dict) else upload


log = logging.getLogger(__name__)


class FilesPlaceholder(list):
    """:func:`load_data`'s list: FedML's eight entries, empty; each rank reads its own files instead."""


class ConfigModel(torch.nn.Identity):
    """:func:`create_model`'s module: the model is ``model_args.model``, built inside the algorithm."""


class SSFLAggregator(ServerAggregator):
    """The server: FedML's ``ServerAggregator`` around a fedml_ssfl server runtime.

    ``get_model_params`` / ``aggregate`` return ``{silo: payload}``; FedML sends each worker the
    entry of the silo it serves (rank k + 1 serves silo k).

    Parameters
    ----------
    model : torch.nn.Module
        The script's model (trained: see the module docstring), or :func:`create_model`'s placeholder.
    args : namespace
        FedML's args from ``fedml.init()`` (:func:`init`); without ``runtime`` the server's part is
        built on the first call, from the dataset list and model ``FedMLRunner`` hands over.
    runtime : ServerRuntime, optional
        A runtime built by the caller (``fedml-ssfl run`` passes its own).
    meter : WireMeter, optional
        Counts the bytes on the wire per round (``fedml-ssfl run``'s transports fill it).
    """

    def __init__(self, model, args, runtime: ServerRuntime | None = None, meter: WireMeter | None = None):
        super().__init__(model, args)
        if runtime is None:
            config_of(args)  # made by fedml.init(): say so now, not inside FedML's first round
        self._runtime = runtime
        self.meter = meter if meter is not None else getattr(args, "ssfl_meter", None)
        self.owns_runtime = runtime is None  # then nobody else ends the run: this object writes the summary
        self.dataset: Any = None
        self._marks = (0, 0)
        self.result: RunResult | None = None

    def receive(self, dataset: Any, model: torch.nn.Module) -> None:
        """What ``FedMLRunner`` hands the server: its dataset list and model (checked here, used at round 1)."""
        self.dataset, self.model = dataset, model
        if self.owns_runtime:
            check_dataset(config_of(self.args), dataset, model, 0)

    @property
    def runtime(self) -> ServerRuntime:
        if self._runtime is None:
            self._runtime = self._build_runtime()
        return self._runtime

    def _build_runtime(self) -> DeployedServerRuntime:
        cfg = config_of(self.args)
        if not script_data(cfg):
            return server_runtime(cfg)
        data, factory = ScriptPieces(self.dataset, self.model).server_data(cfg)
        return server_runtime(with_script_model(cfg, self.model), data, factory)

    def _payloads(self) -> dict[int, Any]:
        if self.runtime.done:
            return {k: Finish() for k in self.runtime.routing()}
        payloads = self.runtime.begin_round()
        if self.meter is not None:
            self._marks = (self.meter.total(self.meter.sent, DOWN_TYPES), self.meter.total(self.meter.recv, UP_TYPES))
        return {k: encode(p) for k, p in payloads.items()}

    def get_model_params(self):
        return self._payloads()

    def set_model_params(self, model_parameters):
        pass  # the server state lives in the algorithm

    def on_before_aggregation(self, raw_client_model_or_grad_list):
        return raw_client_model_or_grad_list, list(range(len(raw_client_model_or_grad_list)))

    def aggregate(self, raw_client_model_or_grad_list):
        uploads = [decode(unwrap(p)) for _, p in raw_client_model_or_grad_list]
        wire = {}
        if self.meter is not None:
            wire = {
                "wire_bytes_up": self.meter.total(self.meter.recv, UP_TYPES) - self._marks[1],
                "wire_bytes_down": self.meter.total(self.meter.sent, DOWN_TYPES) - self._marks[0],
            }
        if not self.owns_runtime:
            self.runtime.finish_round(uploads, **wire)
            return self._payloads()
        try:
            self.runtime.finish_round(uploads, **wire)
        except (RunFailed, RuntimeError) as exc:  # a silo failed, or a reply broke the protocol
            raise self.runtime.fail(exc) from None  # summary.json says failed; the job ends (init's hook)
        self._hold_global_model()
        if self.runtime.done and self.result is None:
            self.result = self.runtime.result()
        return self._payloads()

    def _hold_global_model(self) -> None:
        """The script's model object holds the global model after every round, as FedML's aggregator's does."""
        if isinstance(self.model, ConfigModel) or not isinstance(self.model, torch.nn.Module):
            return
        with torch.no_grad():
            self.model.load_state_dict(self.runtime.exp.algorithm.global_model().state_dict())

    def on_after_aggregation(self, aggregated_model_or_grad):
        return aggregated_model_or_grad

    def test(self, test_data, device, args):
        row = self.runtime.last_row
        return row.get("test_acc"), row.get("test_loss"), None, None


class SSFLTrainer(ClientTrainer):
    """A silo: FedML's ``ClientTrainer`` around a fedml_ssfl worker.

    Parameters
    ----------
    model : torch.nn.Module
        The script's model (every copy the algorithm trains is a deep copy of it), or
        :func:`create_model`'s placeholder.
    args : namespace
        FedML's args from ``fedml.init()`` (:func:`init`); without ``worker``, this rank becomes silo
        ``args.rank - 1``, training ``train_data_local_dict[args.rank - 1]`` of the list
        ``FedMLRunner`` hands over (or ``data_args.local_data``'s file).
    worker : SiloWorker or ClientWorker, optional
        A worker built by the caller (``fedml-ssfl run`` passes its own).
    """

    def __init__(self, model, args, worker=None):
        super().__init__(model, args)
        if worker is None:
            config_of(args)
        self._worker = worker
        self.dataset: Any = None
        self.payload: Any = None
        self.upload: Any = None

    def receive(self, dataset: Any, model: torch.nn.Module) -> None:
        """What ``FedMLRunner`` hands the silo: its dataset list and model (checked here, read at round 1)."""
        self.dataset, self.model = dataset, model
        if self._worker is None:
            check_dataset(config_of(self.args), dataset, model, int(self.args.rank))

    @property
    def worker(self):
        if self._worker is None:
            cfg, rank = config_of(self.args), int(self.args.rank)
            source = None
            if script_data(cfg):
                cfg = with_script_model(cfg, self.model)
                source = ScriptPieces(self.dataset, self.model).silo_source(cfg, rank)
            self._worker = SiloWorker(_with_device(cfg, rank), rank, source=source)
        return self._worker

    def get_model_params(self):
        return self.upload

    def set_model_params(self, model_parameters):
        self.payload = model_parameters

    def update_dataset(self, local_train_dataset, local_test_dataset, local_sample_number):
        pass  # the silo's data is read once, from the list FedMLRunner handed over (or its file)

    def train(self, train_data, device, args):
        self.upload = {UPLOAD_KEY: encode(self.worker.handle(decode(self.payload)))}

    def test(self, test_data, device, args):
        pass


@dataclasses.dataclass
class _ScriptSilo:
    """A silo's data and model from its FedML script, built once the server's metadata is known."""

    cfg: ExperimentConfig
    dataset: Any
    model: torch.nn.Module
    rank: int

    def __call__(self, meta) -> tuple[Any, Any]:
        from ...data.fedml_lists import silo_data
        from ...models.script import script_model_factory

        d = self.cfg.data_args
        data, shape = silo_data(
            self.dataset,
            self.rank - 1,
            scenario=d.label_scenario,
            num_classes=meta.num_classes,
            seed=self.cfg.common_args.random_seed,
            client_label_ratio=d.client_label_ratio,
            labels_per_class_client=d.labels_per_class_client,
        )
        factory = script_model_factory(
            self.model, meta.num_classes, meta.in_channels, meta.image_size, shape, self.cfg.model_args.logits
        )
        return data, factory


@dataclasses.dataclass
class ScriptPieces:
    """A FedML script's dataset list and model, as :func:`~.run.run_fedml` takes them (its ``script``)."""

    dataset: Any
    model: torch.nn.Module

    def server_data(self, cfg: ExperimentConfig) -> tuple[ImageDataset, Any]:
        """The server's labeled, validation and test sets from the list, and the model factory."""
        from ...data.fedml_lists import server_dataset
        from ...models.script import script_model_factory

        d = cfg.data_args
        data, shape = server_dataset(
            self.dataset,
            num_server_labels=d.num_server_labels,
            num_server_val=d.num_server_val,
            seed=cfg.common_args.random_seed,
            mean=d.norm_mean,
            std=d.norm_std,
            flip=d.flip,
            name=script_data_name(d.dataset),
        )
        factory = script_model_factory(
            self.model, data.num_classes, data.in_channels, data.image_size, shape, cfg.model_args.logits
        )
        return data, factory

    def silo_source(self, cfg: ExperimentConfig, rank: int) -> _ScriptSilo:
        """Rank ``rank``'s silo (``rank - 1``) from the list, built once the server's metadata arrives."""
        return _ScriptSilo(cfg, self.dataset, self.model, rank)


# ---- FedMLRunner's inputs ---------------------------------------------------------------------


def config_of(args) -> ExperimentConfig:
    """The fedml_ssfl config :func:`init` put on FedML's args (an error naming the fix otherwise)."""
    cfg = getattr(args, "ssfl_config", None)
    if cfg is None:
        raise ConfigError(
            "FedML's args carry no fedml_ssfl config: import fedml_ssfl.runtime.fedml.hooks before calling "
            "fedml.init() (or call hooks.init()), so that init reads the YAML as a fedml_ssfl config"
        )
    return cfg


def with_script_model(cfg: ExperimentConfig, model: torch.nn.Module) -> ExperimentConfig:
    """``cfg`` naming the script's own model (``model_args.model: script:<class>``) and, where it is one of the
    config's kinds, its normalisation layers (``model_args.norm``): what the run trained."""
    from ...models.script import norm_kind, script_model_name

    name, norm = script_model_name(model), norm_kind(model)
    norm = norm if norm in ("bn", "gn", "none") else cfg.model_args.norm
    if (cfg.model_args.model, cfg.model_args.norm) == (name, norm):
        return cfg
    return dataclasses.replace(cfg, model_args=dataclasses.replace(cfg.model_args, model=name, norm=norm))


def script_data_name(dataset: str) -> str:
    """What a run on a script's dataset list calls its data: the config's ``data_args.dataset`` when that is a
    name of the user's own, :data:`~fedml_ssfl.data.fedml_lists.SCRIPT_DATASET_NAME` when it names one of the
    package's datasets (``mnist`` in FedML's example YAML: not what the script's list holds)."""
    from ...data import available_datasets
    from ...data.fedml_lists import SCRIPT_DATASET_NAME

    return SCRIPT_DATASET_NAME if not dataset or dataset in available_datasets() else dataset


def check_dataset(cfg: ExperimentConfig, dataset: Any, model: Any, rank: int) -> None:
    """Refuse, before FedML indexes it, a dataset list or model this rank cannot run (one line naming the fix).

    Raises
    ------
    ConfigError
        Files named in the config but a list passed (or the reverse); a list FedML would fail on:
        not eight entries, no entry for this rank's silo in ``train_data_local_dict`` (or in
        ``train_data_local_num_dict`` / ``test_data_local_dict``, which FedML indexes too); a model
        that is not an ``nn.Module``.
    """
    if not script_data(cfg):
        if not isinstance(dataset, FilesPlaceholder) or not isinstance(model, ConfigModel):
            raise ConfigError(
                f"{cfg.data_args.local_data}: the config names data files (data_args.local_data / server_data / "
                "test_data), but the script passes its own dataset and model to FedMLRunner: remove those keys "
                "(each process then trains on the list it passes), or pass hooks.load_data(args) and "
                "hooks.create_model(args)"
            )
        return
    if isinstance(dataset, FilesPlaceholder):
        raise ConfigError(
            "the config names no data files (data_args.local_data), so FedMLRunner's dataset is the data, but the "
            "script passed hooks.load_data's placeholders: pass FedML's dataset list (fedml.data.load(args) or your "
            "own), or name the files (fedml-ssfl partition --export writes them)"
        )
    if not isinstance(model, torch.nn.Module) or isinstance(model, ConfigModel):
        raise ConfigError(
            f"FedMLRunner's model must be your torch nn.Module (images -> class logits), got {type(model).__name__}"
        )
    from ...data.fedml_lists import fields

    data = fields(dataset)
    if rank == 0:
        return
    silo = rank - 1
    for key in ("train_data_local_dict", "train_data_local_num_dict", "test_data_local_dict"):
        table = data[key]
        if table is None and key != "train_data_local_dict":
            continue
        try:
            table[silo]
        except (KeyError, IndexError, TypeError):
            raise ConfigError(
                f"the dataset list's {key} has no entry {silo}: under FedMLRunner rank k + 1 is silo k "
                f"and FedML reads entry k of train_data_local_dict, train_data_local_num_dict and "
                "test_data_local_dict (the last two may be None)"
            ) from None


def server_runtime(cfg: ExperimentConfig, dataset: ImageDataset | None = None, factory=None) -> DeployedServerRuntime:
    """The server's part of a fresh deployment run: its own data only, a new run folder.

    ``dataset`` / ``factory``: the server's data and model from a FedML script's list and module
    (the config's files and ``model_args.model`` otherwise).
    """
    exp = build_experiment(_with_device(cfg, 0), dataset, factory)
    if dataset is None:
        check_server_counts(cfg, exp)
    exp.algorithm.setup()
    run_dir = fresh_run_dir(cfg.run_dir())
    lock = hold_run_folder(run_dir)
    runtime = DeployedServerRuntime(cfg, exp, run_dir, None, worker_count(cfg), None, cfg.comm_args.backend)
    runtime.folder_lock = lock  # held while the runtime lives (released when the process ends)
    return runtime
