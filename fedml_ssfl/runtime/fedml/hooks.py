"""fedml_ssfl's FedML ``ClientTrainer`` and ``ServerAggregator``, for a FedML script's ``FedMLRunner``.

A FedML user's cross-silo script runs any registered algorithm on ITS model and ITS data::

    import fedml
    from fedml import FedMLRunner
    from fedml_ssfl.runtime.fedml.hooks import SSFLAggregator, SSFLTrainer

    args = fedml.init()                       # reads --cf, --rank, --role (mpirun: the MPI rank)
    device = fedml.device.get_device(args)
    dataset = my_fedml_list(args)             # FedML's 8-entry list: fedml.data.load(args) or your own
    model = MyNet()                           # any nn.Module: images (N, C, H, W) -> logits (N, classes)
    trainer, aggregator = SSFLTrainer(model, args), SSFLAggregator(model, args)
    FedMLRunner(args, device, dataset, model, trainer, aggregator).run()

Each process is one party (FedML's cross-silo deployment): rank 0 the server, rank k + 1 silo k,
each reading only its own process's list (:mod:`fedml_ssfl.data.fedml_lists` says which entries,
where the server's labels come from and how a silo's labels are hidden). ``mpirun -np K + 1`` for K
silos (``train_args.client_num_in_total``), of which the algorithm trains C_k a round; the others
are told to stay idle. The model FedMLRunner gets is the one trained: every copy the algorithm
makes is a deep copy of it (checked first: :func:`~fedml_ssfl.models.script.script_model_factory`),
and on the server it holds the global model after every round. The config keeps it as
``model_args.model: script:<class name>``, the data as ``data_args.local_data`` / ``server_data`` /
``test_data``: ``FedMLRunner`` (:data:`~fedml_ssfl.config.SCRIPT_DATA`).

``deploy/fedml_runner.py`` is the same script on files instead: a deployment config written by
``fedml-ssfl partition --export`` (``data_args.local_data`` etc. naming files), with
:func:`load_data` / :func:`create_model` as the placeholders FedMLRunner wants (each rank then
reads its own file, the model comes from ``model_args.model``).

``fedml.init``
    Importing this module replaces ``fedml.init`` with :func:`init`, which takes the same arguments,
    because FedML's own does three things a fedml_ssfl job cannot have: it asks FedML's cloud for
    its MQTT/S3 configs and checks its network connections (the package runs offline), and it
    counts ``device_args.worker_num + 1`` MPI processes (FedML's worker count, by default
    ``client_num_per_round``), where here every silo is a process (K + 1). :func:`init` loads the
    YAML as a fedml_ssfl config (FedML's keys accepted or named: :mod:`fedml_ssfl.fedml_compat`;
    ``--set section.key=value`` on the script's command line as in ``fedml-ssfl run``), sets
    FedML's counts to the K silos, and then calls FedML's init offline. After it, an error on any
    rank ends the whole job at once with one line, ``fedml-ssfl: error: rank N: ...``
    (``--debug`` on the command line adds the traceback): MPI ranks call ``MPI_Abort``, GRPC
    processes exit 1.

``FedMLRunner``'s run
    The wrapped ``FedMLCrossSiloServer`` / ``FedMLCrossSiloClient`` (below) run this process's
    party with :func:`~fedml_ssfl.runtime.fedml.run.run_fedml`, the function ``fedml-ssfl run``
    calls (:func:`run_script`): the package's managers and transports (under GRPC mutual TLS and
    the job key of ``comm_args``), round, connection and outage limits, the run folder,
    ``--resume RUN_DIR`` / ``--stop-after N`` from the script's command line, a progress line per
    round and a closing line naming the run folder. ``comm_args.fedml_stock_transport: true`` keeps
    FedML's own managers and transport instead (these two classes inside them, with a warning).

Importing this module imports FedML (``import fedml_ssfl`` does not).

Deviations
----------
* FedML's ``FedMLCrossSiloServer`` / ``FedMLCrossSiloClient`` (the classes ``FedMLRunner`` builds,
  whose constructors run FedML's whole job) are wrapped: given this module's aggregator / trainer
  they check the list and model and run the party on the package's runtime instead of FedML's
  managers (FedML's ``ServerAggregator`` sees the dataset only through ``test``, and its managers
  have no TLS, outage budget or resume); with ``comm_args.fedml_stock_transport`` they hand the
  list and model to this module's classes and run FedML's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

with warnings.catch_warnings():  # requests' version check and pkg_resources, at FedML's import
    warnings.simplefilter("ignore")

from ... import envvars
from ...config import SCRIPT_DATA, ConfigError, ExperimentConfig, derived_run_name, load_config, load_raw
from ...errors import error_line
from ...experiment import deployed, script_data
from ..common import RunFailed, RunResult
from .adapters import (  # the classes' home; public here
    DOWN_TYPES,
    UP_TYPES,
    UPLOAD_KEY,
    ConfigModel,
    FilesPlaceholder,
    ScriptPieces,
    SSFLAggregator,
    SSFLTrainer,
    check_dataset,
    config_of,
    script_data_name,
    server_runtime,
    unwrap,
    with_script_model,
)
from .launch import _fedml_offline, grpc_rank, mpi_rank, worker_count
from .wire import WireMeter

log = logging.getLogger(__name__)


def cli_settings(argv: list[str]) -> list[str]:
    """The ``--set section.key=value`` items of a script's command line (FedML's parser leaves them)."""
    out, it = [], iter(argv)
    for word in it:
        if word == "--set":
            value = next(it, None)
            if value is None:
                raise ConfigError("--set needs section.key=value, e.g. --set common_args.run_name=trial")
            out.append(value)
        elif word.startswith("--set="):
            out.append(word[len("--set=") :])
    return out


@dataclasses.dataclass
class ScriptFlags:
    """What a script's command line asks of the run, beside FedML's own flags and ``--set``."""

    resume: str | None = None
    stop_after: int | None = None


def script_flags(argv: list[str]) -> ScriptFlags:
    """``--resume RUN_DIR`` and ``--stop-after N`` on a script's command line (as in ``fedml-ssfl run``)."""
    flags, it = ScriptFlags(), iter(argv)
    for word in it:
        name, eq, value = word.partition("=")
        if name not in ("--resume", "--stop-after"):
            continue
        if not eq:
            value = next(it, None)
        if not value:
            raise ConfigError(f"{name} needs a value: --resume RUN_DIR (a run folder), --stop-after N (rounds)")
        if name == "--resume":
            flags.resume = value
            continue
        try:
            flags.stop_after = int(value)
        except ValueError:
            raise ConfigError(f"--stop-after {value}: give a number of rounds >= 1") from None
        if flags.stop_after < 1:
            raise ConfigError(f"--stop-after {value}: give a number of rounds >= 1")
    return flags


def stock_transport(cfg: ExperimentConfig) -> bool:
    """Whether the script asked for FedML's own managers and transport (``comm_args.fedml_stock_transport``)."""
    return bool(cfg.comm_args.fedml_stock_transport)


def run_script(args, dataset: Any, model: Any) -> RunResult | None:
    """A FedML script's party on the package's runtime: :func:`~.run.run_fedml` with the script's pieces.

    What ``FedMLRunner(...).run()`` does with :class:`SSFLTrainer` / :class:`SSFLAggregator` (unless
    ``comm_args.fedml_stock_transport: true``): the same managers, transports (under GRPC mutual TLS
    and the job key from ``comm_args``, or ``insecure: true`` for plaintext envelopes), run folder,
    ``--resume RUN_DIR`` / ``--stop-after N`` and progress lines as ``fedml-ssfl run``. The dataset
    list and module are the data and model (a config naming data files: its files and
    ``model_args.model``). The server logs a line per round and, at the end, one line with the
    result and the run folder; the script's model then holds the global model.
    """
    from .run import run_fedml

    cfg = config_of(args)
    flags = script_flags(sys.argv[1:])
    pieces = None
    if script_data(cfg):
        cfg = with_script_model(cfg, model)
        pieces = ScriptPieces(dataset, model)
    if cfg.comm_args.backend == "MPI":
        rank, role = None, None
    else:
        rank, role = int(args.rank), getattr(args, "role", None)
    server = int(args.rank) == 0
    if server:
        _progress_lines()
    result = run_fedml(
        cfg,
        rank=rank,
        role=role,
        run_dir=Path(flags.resume) if flags.resume else None,
        resume=flags.resume is not None,
        stop_after=flags.stop_after,
        script=pieces,
    )
    if result is not None:
        s = result.summary
        acc = f"final test acc {100 * result.final_acc:.2f}% (best {100 * result.best_acc:.2f}%)"
        log.info(
            "%s [FedML %s]: %s after round %d of %d: %s; outputs: %s",
            result.algorithm,
            cfg.comm_args.backend,
            s.get("status", "completed"),
            result.rounds_completed,
            cfg.train_args.comm_round,
            acc,
            result.run_dir,
        )
    return result


def _progress_lines() -> None:
    """The server's round lines and summary reach stderr where the script configured no logging (FedML's
    init does not): the package's INFO lines only, not FedML's."""
    ours = logging.getLogger("fedml_ssfl")
    if ours.handlers or logging.getLogger().handlers:
        if ours.level == logging.NOTSET:
            ours.setLevel(logging.INFO)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def script_config(path: str, run_id: Any = None, argv: list[str] | None = None) -> ExperimentConfig:
    """A FedML script's YAML as a fedml_ssfl deployment config (each process one party).

    FedMLRunner runs FedML's cross-silo deployment: ``common_args.training_type`` is ``cross_silo``
    (``simulation``, which FedML's own MPI cross-silo example gives, is read as ``cross_silo``: FedML's
    simulators would ignore custom trainers), ``comm_args.mode`` is ``deployment``, and a config
    that names no data files takes its data from the script (:data:`~fedml_ssfl.config.SCRIPT_DATA`).
    ``--set`` items on the command line apply as in ``fedml-ssfl run``.

    Raises
    ------
    ConfigError
        No config, ``comm_args.mode: simulation``, or anything the
        config's validation refuses.
    """
    if not path:
        raise ConfigError("pass the config with --cf CONFIG (a FedML fedml_config.yaml, or a fedml_ssfl config)")
    raw = load_raw(path)
    common, comm, data = (
        raw.get(s) if isinstance(raw.get(s), dict) else {} for s in ("common_args", "comm_args", "data_args")
    )
    if common.get("training_type") == "simulation":  # FedML's own MPI cross-silo example says it
        log.info(
            "%s: common_args.training_type simulation read as cross_silo: FedMLRunner with SSFLTrainer / "
            "SSFLAggregator runs FedML's cross-silo deployment, each process one party (FedML's simulators would "
            "ignore the trainer); `fedml-ssfl run --cf CONFIG` runs the simulation",
            path,
        )
    if comm.get("mode", "deployment") != "deployment":
        raise ConfigError(
            f"{path}: FedMLRunner runs the deployment mode over MPI or GRPC (comm_args.mode: deployment, "
            "comm_args.backend: MPI|GRPC); the simulation mode runs with `fedml-ssfl run`"
        )
    forced = ["common_args.training_type=cross_silo", "comm_args.mode=deployment"]
    from_script = not any(data.get(k) for k in ("local_data", "server_data", "test_data"))
    if from_script:
        forced += [f"data_args.{k}={SCRIPT_DATA}" for k in ("local_data", "server_data", "test_data")]
    settings = cli_settings(sys.argv[1:] if argv is None else argv)
    cfg = load_config(Path(path), [*forced, *settings])
    if from_script:
        given = {f"{s}.{k}" for s in ("data_args", "model_args") for k in (raw.get(s) or {})}
        given |= {text.split("=", 1)[0].strip() for text in settings}
        for key in sorted(given & set(UNUSED_WITH_SCRIPT_DATA)):
            log.warning("%s is not used: %s", key, UNUSED_WITH_SCRIPT_DATA[key])
        named = "run_name" in common or "common_args.run_name" in given
        if not named and script_data_name(cfg.data_args.dataset) != cfg.data_args.dataset:  # not the YAML's mnist
            cfg.common_args.run_name = derived_run_name(script_data_name(cfg.data_args.dataset), cfg.algorithm)
    if run_id not in (None, "", "0"):
        cfg.common_args.run_id = str(run_id)
    if not deployed(cfg) or cfg.comm_args.backend not in ("MPI", "GRPC"):
        raise ConfigError(
            f"{path}: FedMLRunner runs the deployment mode over MPI or GRPC (comm_args.mode: deployment, "
            "comm_args.backend: MPI|GRPC); the simulation mode runs with `fedml-ssfl run`"
        )
    return cfg


_LIST = "the data is the dataset list the script passes to FedMLRunner, split into silos by its train_data_local_dict"
_MODEL = "the model is the nn.Module the script passes to FedMLRunner"
UNUSED_WITH_SCRIPT_DATA: dict[str, str] = {
    **{
        f"data_args.{k}": _LIST
        for k in (
            "data_cache_dir",
            "download",
            "partition_method",
            "partition_alpha",
            "non_iid_r",
            "classes_per_client",
            "imbalance_strength",
            "num_stages",
            "rounds_per_stage",
            "rich_client_fraction",
            "rich_label_ratio",
            "poor_label_ratio",
            "synthetic_num_samples",
            "synthetic_num_classes",
            "synthetic_shape",
            "num_classes",
        )
    },
    "model_args.model": _MODEL,
    "model_args.norm": _MODEL,
}
"""Config keys a FedML script's run does not use when its data and model come from the script: one
warning each (``data_args.dataset`` names the run; the label keys and ``norm_mean`` / ``norm_std`` /
``flip`` apply to the list)."""

_ORIGINAL_INIT: Any = None


def init(args=None, check_env: bool = True, should_init_logs: bool = True) -> Any:
    """``fedml.init`` for a fedml_ssfl job (importing this module makes it ``fedml.init``; same arguments).

    FedML parses the command line as in its own examples (``--cf``, ``--rank``, ``--role``,
    ``--run_id``; MPI ranks from ``mpirun``); the YAML is loaded as a fedml_ssfl config
    (:func:`script_config`) and kept as ``args.ssfl_config``. FedML's counts become the K silos
    (``worker_num``, ``client_num_in_total``, ``client_num_per_round``, ``client_id_list``), its
    algorithm FedAvg (the one FedML's cross-silo classes run custom aggregators under); its call to
    its cloud is replaced, its environment report (``check_env``, which tests network connections)
    and its log files (``should_init_logs``) are skipped. From here on an error on this rank ends the
    job with one line (module docstring).

    Under MPI, FedML's messages then travel through :mod:`~fedml_ssfl.runtime.fedml.wire` instead of
    pickle (``MPI.pickle`` is replaced for the process). ``FedMLRunner`` then runs on the package's
    runtime (:func:`run_script`); only with ``comm_args.fedml_stock_transport: true`` on FedML's own
    managers and transport, which under GRPC unpickles what reaches its port, with no TLS and no job
    key: then it runs only with ``comm_args.insecure: true`` as well (on a network you trust).

    Called with FedML args that name no YAML (``fedml-ssfl run``'s own), it is FedML's init unchanged.

    Raises
    ------
    ConfigError
        No config, a config FedMLRunner cannot run (:func:`script_config`), the wrong process count
        (naming the right ``-np``), a bad ``--resume`` / ``--stop-after``, or FedML's stock GRPC
        transport (``comm_args.fedml_stock_transport``) without ``comm_args.insecure: true``.
    """
    original = _ORIGINAL_INIT
    if args is not None and not getattr(args, "yaml_config_file", ""):
        return original(args, check_env=check_env, should_init_logs=should_init_logs)
    with _fedml_offline() as fedml:
        script = args is None or _under_mpirun()  # a script's process (tests call init with args of their own)
        if args is None:
            from fedml.arguments import load_arguments

            args = load_arguments(fedml._global_training_type, fedml._global_comm_backend)
        backend = "MPI" if _under_mpirun() else "GRPC"
        rank = _mpi_rank() if backend == "MPI" else int(getattr(args, "rank", 0) or 0)
        if script:
            exit_on_error(rank, backend, starting=True)
        with _warnings_on_rank_zero(rank if backend == "MPI" else 0):  # one copy of each config warning
            cfg = script_config(getattr(args, "yaml_config_file", "") or "", getattr(args, "run_id", None))
        path = args.yaml_config_file
        K = worker_count(cfg)
        stock = stock_transport(cfg)
        script_flags(sys.argv[1:] if script else [])  # a bad --resume / --stop-after named now
        if cfg.comm_args.backend == "MPI":
            mpi_rank(cfg, None, None)  # the process count, before FedML asserts it
            from fedml.core.distributed.communication.message import Message as FedMessage
            from mpi4py import MPI

            meter = WireMeter(FedMessage)  # FedML's MPI messages through the codec, not pickle, counted
            MPI.pickle.__init__(meter.dumps, meter.loads)
        else:
            if stock and not cfg.comm_args.insecure:
                raise ConfigError(
                    f"{path}: comm_args.fedml_stock_transport: FedML's stock GRPC transport unpickles what reaches "
                    "its port and has no TLS or job key: remove the key (the script then runs on fedml_ssfl's "
                    "transport: TLS, job key, no pickle), or also set comm_args.insecure: true to accept that on a "
                    "network you trust"
                )
            grpc_rank(cfg, int(args.rank), getattr(args, "role", None))
        if stock and rank == 0:
            log.warning(
                "comm_args.fedml_stock_transport: FedML's own managers and transport run this job: no outboxes, "
                "heartbeats, outage budget, --resume or progress lines%s",
                "; under GRPC plaintext, unauthenticated, and it unpickles what it receives"
                if cfg.comm_args.backend == "GRPC"
                else "",
            )
        if script:
            exit_on_error(rank, cfg.comm_args.backend)
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
            "client_id_list": None,  # FedML's init lists ranks 1..K on the server, the rank itself on a client
            "comm_round": t.comm_round,
            "frequency_of_the_test": 1,
            "test_on_clients": "no",
            "dataset": cfg.data_args.dataset,
            "using_gpu": d.device == "cuda",
            "skip_log_model_net": True,
            "sys_perf_profiling": False,
        }.items():
            setattr(args, key, value)
        with contextlib.redirect_stdout(io.StringIO()):
            args = original(args, check_env=False, should_init_logs=False)
        args.ssfl_config = cfg
        if cfg.comm_args.backend == "MPI":
            args.ssfl_meter = meter  # the aggregator records each round's wire bytes from it
        return args


@contextlib.contextmanager
def _warnings_on_rank_zero(rank: int):
    """MPI ranks load the same config: only rank 0 logs what loading it says."""
    if rank == 0:
        yield
        return
    quiet = logging.getLogger("fedml_ssfl")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        yield
    finally:
        quiet.setLevel(level)


def load_data(args) -> FilesPlaceholder:
    """FedML's dataset list as placeholders, for a config that names data files: each rank reads its own.

    ``[train_num, test_num, train_global, test_global, local_num_dict, train_local_dict,
    test_local_dict, class_num]`` with one ``None`` entry per silo (FedML indexes them by silo).
    """
    K = worker_count(config_of(args))
    silos = {k: None for k in range(K)}
    return FilesPlaceholder([0, 0, None, None, {k: 0 for k in range(K)}, silos, dict(silos), 0])


def create_model(args) -> ConfigModel:
    """The model placeholder for a config that names data files: the algorithm builds ``model_args.model``."""
    config_of(args)
    return ConfigModel()


# ---- ending the job on an error -----------------------------------------------------------------


def _under_mpirun() -> bool:
    return any(envvars.raw(k) for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def _mpi_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


_job: dict[str, Any] = {}


STARTUP_GRACE = 3.0
"""Seconds an MPI rank other than 0 waits before reporting an error during :func:`init`: the config is
the same on every rank, so rank 0 usually reports it and ends the job first (one line, not one per rank)."""


def exit_on_error(rank: int, backend: str, starting: bool = False) -> None:
    """From now on an uncaught error in this process (any thread) ends the job: one line, then MPI_Abort / exit 1.

    A FedML job otherwise hangs on an error: the other MPI ranks wait for this one forever, and this
    process waits for FedML's non-daemon threads at exit. The line is
    ``fedml-ssfl: error: rank N: <error>; ending the <backend> job``; ``--debug`` on the command line
    prints the traceback before it. ``starting``: errors now are likely the same on every rank
    (:data:`STARTUP_GRACE`).
    """
    _job.update(rank=rank, backend=backend, starting=starting)
    if _job.get("installed"):
        return
    _job["installed"] = True
    sys.excepthook = _end_job
    threading.excepthook = lambda a: _end_job(a.exc_type, a.exc_value, a.exc_traceback)


def _end_job(exc_type, exc, tb) -> None:
    if issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
        sys.__excepthook__(exc_type, exc, tb)
        if issubclass(exc_type, SystemExit):
            return
    elif "--debug" in sys.argv:
        traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
    rank, backend = _job.get("rank", "?"), _job.get("backend", "MPI")
    if backend == "MPI" and _job.get("starting") and rank != 0:
        time.sleep(STARTUP_GRACE)  # rank 0 has most likely hit the same error and ends the job meanwhile
    text = str(exc) if isinstance(exc, (ConfigError, RunFailed, OSError)) else f"{exc_type.__name__}: {exc}"
    sys.stderr.write(error_line(f"rank {rank}: {text}; ending the {backend} job") + "\n")
    sys.stderr.flush()
    if backend == "MPI":
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    os._exit(1)


# ---- FedML, adapted on import -------------------------------------------------------------------


def _install() -> None:
    """``fedml.init`` -> :func:`init`; FedMLRunner's cross-silo classes hand our classes their dataset and model."""
    global _ORIGINAL_INIT
    import fedml
    from fedml.cross_silo.fedml_client import FedMLCrossSiloClient
    from fedml.cross_silo.fedml_server import FedMLCrossSiloServer

    if _ORIGINAL_INIT is not None:
        return
    _ORIGINAL_INIT = fedml.init
    fedml.init = init
    server_init, client_init = FedMLCrossSiloServer.__init__, FedMLCrossSiloClient.__init__

    def server(self, args, device, dataset, model, server_aggregator=None):
        if isinstance(server_aggregator, SSFLAggregator):
            server_aggregator.receive(dataset, model)
            if server_aggregator.owns_runtime and not stock_transport(config_of(args)):
                server_aggregator.result = run_script(args, dataset, model)  # FedML's server also runs here
                return
        server_init(self, args, device, dataset, model, server_aggregator)

    def client(self, args, device, dataset, model, model_trainer=None):
        if isinstance(model_trainer, SSFLTrainer):
            model_trainer.receive(dataset, model)
            if model_trainer._worker is None and not stock_transport(config_of(args)):
                run_script(args, dataset, model)
                return
        client_init(self, args, device, dataset, model, model_trainer)

    FedMLCrossSiloServer.__init__, FedMLCrossSiloClient.__init__ = server, client


_install()

__all__ = [
    "DOWN_TYPES",
    "UP_TYPES",
    "UPLOAD_KEY",
    "ConfigModel",
    "FilesPlaceholder",
    "SSFLAggregator",
    "ScriptPieces",
    "SSFLTrainer",
    "check_dataset",
    "config_of",
    "create_model",
    "exit_on_error",
    "init",
    "load_data",
    "run_script",
    "script_config",
    "script_flags",
    "server_runtime",
    "unwrap",
    "with_script_model",
]
