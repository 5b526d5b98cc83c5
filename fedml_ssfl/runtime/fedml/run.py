"""``run_fedml``: this process's part of a FedML cross-silo job (server on rank 0, a worker elsewhere).

Every door into a FedML job ends here: ``fedml-ssfl run --cf CONFIG`` (the package's datasets and
models) and a FedML script's ``FedMLRunner(...).run()`` with :class:`~.adapters.SSFLTrainer` /
:class:`~.adapters.SSFLAggregator` (its dataset list and ``nn.Module``, passed as :class:`ScriptParts`).
Both get the same managers (:mod:`.managers`), transports (:mod:`.transport`), security, run folder,
``--resume`` / ``--stop-after`` and progress lines; only where the data and the model come from differs.
"""

from __future__ import annotations

import contextlib
import io
import logging
import signal
import sys
from pathlib import Path
from typing import Any, Protocol

import torch

from ...checkpoint import load_checkpoint
from ...config import ConfigError, ExperimentConfig
from ...data import ImageDataset
from ...errors import error_line
from ...experiment import build_experiment, deployed
from .. import offline
from ..common import (
    CHECKPOINT_NAME,
    RunFailed,
    RunResult,
    discard_unwritten,
    fresh_run_dir,
    hold_run_folder,
)
from .diagnose import check_own_certificate
from .launch import (
    _fedml_offline,
    _with_device,
    check_backend,
    check_port_free,
    check_server_counts,
    fedml_args,
    grpc_rank,
    mpi_rank,
    timeouts,
    worker_count,
)
from .security import (
    load_security,
    membership,
)
from .server import DeployedServerRuntime, ServerRuntime
from .tls_files import check_tls_files
from .wire import WireMeter
from .worker import ClientWorker, SiloWorker

log = logging.getLogger(__name__)


class ScriptParts(Protocol):
    """A FedML script's own data and model, as :func:`run_fedml` takes them (:class:`~.adapters.ScriptPieces`)."""

    model: torch.nn.Module

    def server_data(self, cfg: ExperimentConfig) -> tuple[ImageDataset, Any]:
        """The server's data (its labels, validation and test sets) and the model factory."""

    def silo_source(self, cfg: ExperimentConfig, rank: int) -> Any:
        """What :class:`~.worker.SiloWorker` calls for rank ``rank``'s silo data and model factory."""


def run_fedml(
    cfg: ExperimentConfig,
    rank: int | None = None,
    role: str | None = None,
    run_dir: str | Path | None = None,
    resume: bool = False,
    dataset: ImageDataset | None = None,
    stop_after: int | None = None,
    script: ScriptParts | None = None,
) -> RunResult | None:
    """Run this process's part of a FedML cross-silo job (server on rank 0, a worker elsewhere).

    Parameters
    ----------
    cfg : ExperimentConfig
        A validated config with ``comm_args.backend`` MPI or GRPC and ``training_type: cross_silo``.
    rank, role : optional
        GRPC: this process's rank (0 = server) and role; MPI takes the rank from ``mpirun``.
    run_dir, resume, dataset, stop_after
        As in :func:`~fedml_ssfl.runtime.local.run_local` (used by the server).
    script : ScriptParts, optional
        A FedML script's dataset list and model (deployment mode): the server's data and each
        silo's come from the list, every model from the module; on the server the module holds the
        global model at the end. ``cfg`` names the module (``model_args.model: script:<class>``).

    Returns
    -------
    RunResult or None
        The result on the server; None on workers.

    Raises
    ------
    ConfigError
        Wrong process count (naming the right ``-np``), missing/mismatched GRPC rank or ipconfig,
        bad GPU mapping -- before anything starts.
    RunFailed
        A worker failed or died, or a round timed out (names rank and silo; checkpoints intact).
    """
    check_backend(cfg)
    backend = cfg.comm_args.backend
    limits = timeouts()
    comm, peers, table = None, [], None
    if backend == "MPI":
        rank, comm = mpi_rank(cfg, rank, role)
        security = None
    else:
        rank, table = grpc_rank(cfg, rank, role)
        peers = [ip for ip, _ in table.values()]
        security = load_security(cfg, rank)
        check_tls_files(cfg, rank)  # a junk or swapped PEM named here, not as a port in use at the bind
        if security.tls is not None:
            host = table[rank][0]
            name = security.tls.server_name or host
            if name not in ("0.0.0.0", "::", ""):
                check_own_certificate(security.tls, name, rank)
        if rank == 0 or not cfg.comm_args.connect_out:  # a connect-out client listens nowhere
            check_port_free(rank, *table[rank])
    claimed = None  # a new run folder: removed on an error before anything was written into it
    lock = None  # the server holds its run folder for the run's life (a second run of it is refused)
    try:
        is_server = rank == 0
        state = None
        if is_server:
            base = Path(run_dir) if run_dir is not None else cfg.run_dir()
            run_dir = base if resume else fresh_run_dir(base)
            claimed = None if resume else run_dir
            lock = hold_run_folder(run_dir, resume)
            ckpt = run_dir / "checkpoints" / CHECKPOINT_NAME
            state = load_checkpoint(ckpt, cfg.fingerprint(), cfg.to_dict()) if resume else None
        dev_cfg = _with_device(cfg, rank)
        guarded = not offline.installed() and offline.install(peers)  # uninstalled below only if ours
        meter = WireMeter()
        mpi_pickle = None
        with _fedml_offline() as fedml:
            from fedml.core.distributed.communication.message import Message as FedMessage

            meter.message_class = FedMessage
            args = fedml_args(cfg, rank)
            args.comm, args.ssfl_grpc_table, args.ssfl_security = comm, table, security
            args.ssfl_membership = membership(cfg)
            args.ssfl_connect_out = cfg.comm_args.connect_out
            args.ssfl_job = security.job if security is not None else cfg.common_args.run_id
            with contextlib.redirect_stdout(io.StringIO()):
                args = fedml.init(args, check_env=False, should_init_logs=False)
            if backend == "MPI":
                from mpi4py import MPI

                mpi_pickle = MPI.pickle
                MPI.pickle.__init__(meter.dumps, meter.loads)
            from . import (
                connect_out,  # noqa: F401 - registers comm_args.connect_out's transport
                managers,  # FedML's classes: imported only now, offline
            )
            from .adapters import SSFLAggregator

            workers = worker_count(cfg)
            try:
                if not is_server:
                    if script is not None:
                        worker = SiloWorker(dev_cfg, rank, source=script.silo_source(cfg, rank))
                    elif deployed(cfg):
                        worker = SiloWorker(dev_cfg, rank)
                    else:
                        worker = ClientWorker(build_experiment(dev_cfg, dataset), rank)
                    _run_worker(worker, args, rank, meter, limits, comm, workers, backend)
                    return None
                if script is not None:
                    exp = build_experiment(dev_cfg, *script.server_data(cfg))
                else:
                    exp = build_experiment(dev_cfg, dataset)
                    if deployed(cfg):
                        check_server_counts(cfg, exp)
                exp.algorithm.setup()
                runtime_class = DeployedServerRuntime if deployed(cfg) else ServerRuntime
                runtime = runtime_class(cfg, exp, Path(run_dir), state, workers, stop_after, backend)
                server_agg = SSFLAggregator(exp.algorithm.global_model(), args, runtime, meter)
                silo_agg = managers.SSFLSiloAggregator(server_agg, args, workers, exp.device)
                manager = managers.SSFLServerManager(args, silo_agg, runtime, meter, limits, comm, workers, backend)
                previous = _install_terminate_handler(manager.on_terminate)
                try:
                    if runtime.done:
                        log.info("nothing to run: %s already completed round %d", run_dir, runtime.round)
                    manager.run()
                finally:
                    _restore_terminate_handler(previous)
                if runtime.failure is not None:
                    raise runtime.failure
                if not runtime.done:
                    raise runtime.fail(f"the FedML server stopped in round {runtime.round + 1} before the run ended")
                if script is not None:  # the script's model object holds the global model, as FedML's does
                    with torch.no_grad():
                        script.model.load_state_dict(exp.algorithm.global_model().state_dict())
                return runtime.result()
            finally:
                if mpi_pickle is not None:
                    with contextlib.suppress(Exception):
                        mpi_pickle.__init__()
                if guarded:
                    offline.uninstall()
    except RunFailed:
        discard_unwritten(claimed)
        raise  # the server ended the run and told the workers (or aborted the job itself)
    except Exception as exc:
        discard_unwritten(claimed)
        if comm is not None and comm.Get_size() > 1:
            _abort_mpi_job(rank, exc)
        raise
    finally:
        if lock is not None:
            lock.release()


def _abort_mpi_job(rank: int, exc: BaseException) -> None:
    """An error escaped this rank outside the run's own failure path: the other ranks would wait for it
    forever (in a receive, or in ``MPI_Finalize`` at exit), so say why and end the whole job."""
    text = str(exc) if isinstance(exc, (ConfigError, OSError)) else f"{type(exc).__name__}: {exc}"
    sys.stderr.write(error_line(f"rank {rank}: {text}; ending the MPI job") + "\n")
    sys.stderr.flush()
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(1)


def _run_worker(worker, args, rank: int, meter, limits, comm, workers: int, backend: str) -> None:
    """A worker process: FedML's client manager around ``worker`` (a :class:`ClientWorker` or :class:`SiloWorker`).

    FedML wants a data dict entry for every silo index the server may name; the trainer ignores them
    (the payload names the silo). A deployed silo's model is built when the server's metadata arrives.
    """
    from fedml.cross_silo.client.fedml_trainer_dist_adapter import TrainerDistAdapter

    from . import managers
    from .adapters import SSFLTrainer

    if isinstance(worker, SiloWorker):
        silos, counts, model, device = {worker.silo: worker.silo}, {worker.silo: 0}, torch.nn.Identity(), "cpu"
    else:
        exp = worker.exp
        K = exp.config.train_args.client_num_in_total
        silos = {k: k for k in range(K)}
        counts = {k: int(exp.split.client_unlabeled[k].numel()) for k in range(K)}
        model, device = exp.algorithm.model_fn(), exp.device
    trainer = SSFLTrainer(model, args, worker)
    adapter = TrainerDistAdapter(args, device, rank, model, sum(counts.values()), counts, silos, silos, trainer)
    manager = managers.SSFLClientManager(args, adapter, meter, limits, comm, rank, workers, backend)
    manager.run()
    if manager.refusal:
        raise ConfigError(f"rank {rank}: the server refused this process: {manager.refusal}")
    if manager.failure:  # the run failed (here, or on the server, which said why): exit non-zero
        raise RunFailed(f"rank {rank}: {manager.failure}")


def _install_terminate_handler(handler):
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def _restore_terminate_handler(previous) -> None:
    if previous is not None:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, previous)
