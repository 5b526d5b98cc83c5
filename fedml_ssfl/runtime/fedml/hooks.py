"""fedml_ssfl's FedML ``ClientTrainer`` and ``ServerAggregator``, public for FedML's own ``FedMLRunner``.

FedML's cross-silo examples build a trainer and an aggregator and hand them to ``FedMLRunner``
with FedML's stock managers; ``deploy/fedml_runner.py`` does exactly that with these classes::

    args = hooks.init()                        # fedml.init() without its call to FedML's cloud
    device = fedml.device.get_device(args)
    dataset, model = hooks.load_data(args), hooks.create_model(args)
    trainer, aggregator = SSFLTrainer(model, args), SSFLAggregator(model, args)
    FedMLRunner(args, device, dataset, model, trainer, aggregator).run()

The payloads are fedml_ssfl's: the aggregator runs any registered algorithm's server side
(:class:`~fedml_ssfl.runtime.fedml.server.DeployedServerRuntime`) and sends each rank the
payload of its own silo; the trainer is one silo
(:class:`~fedml_ssfl.runtime.fedml.worker.SiloWorker`): it reads only its own file
(``data_args.local_data``) once the server's metadata arrives, and keeps its client state.
``fedml-ssfl run`` drives the same two classes with FedML's managers subclassed for fault
handling; use it for what the stock path lacks (see docs/deploy.md): round and connection
timeouts that end the job with the culprit's name, ``--resume``, ``--stop-after``, wire-byte
counts, the simulation mode.

Importing this module imports FedML (``import fedml_ssfl`` does not).

Deviations
----------
* FedML's runner wants a dataset tuple and a model before the run starts; in a deployment no
  process holds more than its own part, so :func:`load_data` returns placeholders and
  :func:`create_model` an identity module. The real model is built inside the algorithm from
  the server's metadata.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from fedml.core import ClientTrainer, ServerAggregator
from fedml.cross_silo.server.message_define import MyMessage

from ...config import ConfigError, ExperimentConfig, load_config
from ...experiment import build_experiment, deployed
from ..common import RunResult, fresh_run_dir, hold_run_folder
from .launch import _fedml_offline, _with_device, check_server_counts, grpc_rank, mpi_rank, worker_count
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


class SSFLAggregator(ServerAggregator):
    """The server: FedML's ``ServerAggregator`` around a fedml_ssfl server runtime.

    ``get_model_params`` / ``aggregate`` return ``{silo: payload}``; FedML sends each worker the
    entry of the silo it serves (in deployment mode silo k is rank k + 1).

    Parameters
    ----------
    model : torch.nn.Module
        What FedML holds as the model (unused: the algorithm owns its models).
    args : namespace
        FedML's args; without ``runtime``, ``args.ssfl_config`` (set by :func:`init`) says what
        to run, and the runtime (the server's data, the algorithm, the run folder) is built on
        the first call.
    runtime : ServerRuntime, optional
        A runtime built by the caller (``fedml-ssfl run`` passes its own).
    meter : WireMeter, optional
        Counts the bytes on the wire per round (``fedml-ssfl run``'s transports fill it).
    """

    def __init__(self, model, args, runtime: ServerRuntime | None = None, meter: WireMeter | None = None):
        super().__init__(model, args)
        self._runtime = runtime
        self.meter = meter if meter is not None else getattr(args, "ssfl_meter", None)
        self.owns_runtime = runtime is None  # then nobody else ends the run: this object writes the summary
        self._marks = (0, 0)
        self.result: RunResult | None = None

    @property
    def runtime(self) -> ServerRuntime:
        if self._runtime is None:
            self._runtime = server_runtime(config_of(self.args))
        return self._runtime

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
        self.runtime.finish_round(uploads, **wire)
        if self.runtime.done and self.owns_runtime and self.result is None:
            self.result = self.runtime.result()
        return self._payloads()

    def on_after_aggregation(self, aggregated_model_or_grad):
        return aggregated_model_or_grad

    def test(self, test_data, device, args):
        row = self.runtime.last_row
        return row.get("test_acc"), row.get("test_loss"), None, None


class SSFLTrainer(ClientTrainer):
    """A worker: FedML's ``ClientTrainer`` around a fedml_ssfl worker.

    Parameters
    ----------
    model : torch.nn.Module
        What FedML holds as the model (unused).
    args : namespace
        FedML's args; without ``worker``, this rank becomes the deployed silo ``args.rank - 1``
        of ``args.ssfl_config`` (set by :func:`init`).
    worker : SiloWorker or ClientWorker, optional
        A worker built by the caller (``fedml-ssfl run`` passes its own).
    """

    def __init__(self, model, args, worker=None):
        super().__init__(model, args)
        self._worker = worker
        self.payload: Any = None
        self.upload: Any = None

    @property
    def worker(self):
        if self._worker is None:
            cfg = config_of(self.args)
            self._worker = SiloWorker(_with_device(cfg, int(self.args.rank)), int(self.args.rank))
        return self._worker

    def get_model_params(self):
        return self.upload

    def set_model_params(self, model_parameters):
        self.payload = model_parameters

    def update_dataset(self, local_train_dataset, local_test_dataset, local_sample_number):
        pass  # a silo reads its own file; a simulation worker is told its silo by the payload

    def train(self, train_data, device, args):
        self.upload = {UPLOAD_KEY: encode(self.worker.handle(decode(self.payload)))}

    def test(self, test_data, device, args):
        pass


# ---- FedMLRunner's inputs ---------------------------------------------------------------------


def config_of(args) -> ExperimentConfig:
    """The fedml_ssfl config :func:`init` put on FedML's args (an error naming the fix otherwise)."""
    cfg = getattr(args, "ssfl_config", None)
    if cfg is None:
        raise ConfigError(
            "FedML's args carry no fedml_ssfl config: make them with fedml_ssfl.runtime.fedml.hooks.init()"
        )
    return cfg


def server_runtime(cfg: ExperimentConfig) -> DeployedServerRuntime:
    """The server's part of a fresh deployment run: its own data only, a new run folder."""
    exp = build_experiment(_with_device(cfg, 0))
    check_server_counts(cfg, exp)
    exp.algorithm.setup()
    run_dir = fresh_run_dir(cfg.run_dir())
    lock = hold_run_folder(run_dir)
    runtime = DeployedServerRuntime(cfg, exp, run_dir, None, worker_count(cfg), None, cfg.comm_args.backend)
    runtime.folder_lock = lock  # held while the runtime lives (released when the process ends)
    return runtime


def init(args=None) -> SimpleNamespace:
    """``fedml.init()`` for a fedml_ssfl deployment, offline.

    FedML parses the command line as in its own examples (``--cf``, ``--rank``, ``--role``,
    ``--run_id``; MPI ranks from ``mpirun``); the same YAML is loaded as a fedml_ssfl config
    (FedML's keys accepted as in ``fedml-ssfl run``) and kept as ``args.ssfl_config``. FedML's
    call to its cloud for configs (``fetch_config``) is replaced; its client counts are set to
    the K silos, each rank serving its own silo.

    Under MPI, FedML's messages then travel through :mod:`~fedml_ssfl.runtime.wire` instead of
    pickle (``MPI.pickle`` is replaced for the process). Under GRPC FedML's stock transport still
    unpickles what reaches its port, with no TLS and no job key: the stock path runs over GRPC only
    with ``comm_args.insecure: true`` (on a network you trust); ``fedml-ssfl run``'s GRPC transport
    has the codec, TLS and the job key.

    Raises
    ------
    ConfigError
        The config is not a deployment (``comm_args.mode: deployment``) over MPI or GRPC, or asks for
        GRPC without ``comm_args.insecure: true``.
    """
    with _fedml_offline() as fedml:
        if args is None:
            from fedml.arguments import load_arguments

            args = load_arguments(fedml._global_training_type, fedml._global_comm_backend)
        path = getattr(args, "yaml_config_file", "") or ""
        if not path:
            raise ConfigError("pass the deployment config with --cf CONFIG (fedml-ssfl partition --export writes one)")
        cfg = load_config(Path(path), [])
        if getattr(args, "run_id", None) not in (None, "", "0"):
            cfg.common_args.run_id = str(args.run_id)
        if not deployed(cfg) or cfg.comm_args.backend not in ("MPI", "GRPC"):
            raise ConfigError(
                f"{path}: FedMLRunner runs the deployment mode over MPI or GRPC (comm_args.mode: deployment, "
                "comm_args.backend: MPI|GRPC); the simulation mode runs with `fedml-ssfl run`"
            )
        K = worker_count(cfg)
        if cfg.comm_args.backend == "MPI":
            mpi_rank(cfg, None, None)  # the process count, before FedML asserts it
            from fedml.core.distributed.communication.message import Message as FedMessage
            from mpi4py import MPI

            meter = WireMeter(FedMessage)  # FedML's MPI messages through the codec, not pickle, counted
            MPI.pickle.__init__(meter.dumps, meter.loads)
        else:
            if not cfg.comm_args.insecure:
                raise ConfigError(
                    f"{path}: FedML's stock GRPC transport unpickles what reaches its port and has no TLS or job "
                    "key: run this deployment with `fedml-ssfl run` (TLS, job key, no pickle), or set "
                    "comm_args.insecure: true to accept that on a network you trust"
                )
            log.warning("FedML's stock GRPC transport: plaintext, unauthenticated, and it unpickles what it receives")
            grpc_rank(cfg, int(args.rank), getattr(args, "role", None))
        t, d = cfg.train_args, cfg.device_args
        for key, value in {
            "training_type": "cross_silo",
            "backend": cfg.comm_args.backend,
            "scenario": "horizontal",
            "federated_optimizer": "FedAvg",
            "using_mlops": False,
            "enable_wandb": False,
            "client_num_in_total": K,  # FedML's counts are the silos; the algorithm samples C_k of them
            "client_num_per_round": K,
            "worker_num": K,
            "comm_round": t.comm_round,
            "frequency_of_the_test": 1,
            "test_on_clients": "no",
            "using_gpu": d.device == "cuda",
            "skip_log_model_net": True,
        }.items():
            setattr(args, key, value)
        with contextlib.redirect_stdout(io.StringIO()):
            args = fedml.init(args, check_env=False, should_init_logs=False)
        args.ssfl_config = cfg
        if cfg.comm_args.backend == "MPI":
            args.ssfl_meter = meter  # the aggregator records each round's wire bytes from it
        return args


def load_data(args) -> list:
    """FedML's dataset tuple, as placeholders: each rank reads only its own files, itself.

    ``[train_num, test_num, train_global, test_global, local_num_dict, train_local_dict,
    test_local_dict, class_num]`` with one ``None`` entry per silo (FedML indexes them by silo).
    """
    K = worker_count(config_of(args))
    silos = {k: None for k in range(K)}
    return [0, 0, None, None, {k: 0 for k in range(K)}, silos, dict(silos), 0]


def create_model(args) -> torch.nn.Module:
    """What FedML holds as the model: an identity module (the algorithm builds its own models)."""
    config_of(args)
    return torch.nn.Identity()


__all__ = ["SSFLAggregator", "SSFLTrainer", "config_of", "create_model", "init", "load_data", "server_runtime"]
