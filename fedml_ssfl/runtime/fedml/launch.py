"""Turning a config and the launcher's environment into a FedML job: ranks, ports, timeouts, args.

No FedML import at module level (``_fedml_offline`` imports it when a job starts).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import io
import ipaddress
import logging
import os
import re
import shlex
import socket
import warnings
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ... import envvars
from ...config import ConfigError, ExperimentConfig, load_yaml
from ...experiment import Experiment, deployed
from ...limits import read_small_file, text_position

log = logging.getLogger(__name__)


def _env_seconds(name: str, default: float) -> float:
    """``name``'s seconds (> 0, finite), or ``default`` when unset; anything else is refused naming it."""
    return envvars.seconds(name, default)


def timeouts() -> SimpleNamespace:
    """Fault-handling time limits, in seconds (environment variables override the defaults).

    ``FEDML_SSFL_ROUND_TIMEOUT`` (3600): the server fails a round whose replies are not all in.
    ``FEDML_SSFL_CONNECT_TIMEOUT`` (300): workers must come online (and GRPC peers accept).
    ``FEDML_SSFL_FINISH_GRACE`` (30): after a failure, how long workers get to acknowledge.
    ``FEDML_SSFL_OUTAGE_BUDGET`` (120): GRPC: how long a peer may be unreachable or silent (a cut link,
    a restart) before it is declared lost; a message is retried within it.
    ``FEDML_SSFL_HEARTBEAT_INTERVAL`` (5): GRPC: heartbeats between the server and each worker.
    ``FEDML_SSFL_IDLE_TIMEOUT`` (6 h): a GRPC worker that receives no message of the run from the
    server for this long (heartbeats aside) exits with an error.
    """
    round_t = _env_seconds("FEDML_SSFL_ROUND_TIMEOUT", 3600.0)
    connect_t = _env_seconds("FEDML_SSFL_CONNECT_TIMEOUT", 300.0)
    return SimpleNamespace(
        round=round_t,
        connect=connect_t,
        grace=_env_seconds("FEDML_SSFL_FINISH_GRACE", 30.0),
        outage=_env_seconds("FEDML_SSFL_OUTAGE_BUDGET", 120.0),
        heartbeat=_env_seconds("FEDML_SSFL_HEARTBEAT_INTERVAL", 5.0),
        idle=_env_seconds("FEDML_SSFL_IDLE_TIMEOUT", 6 * 3600.0),
    )


GRPC_BASE_PORT = 8890
"""FedML's first GRPC port (``CommunicationConstants.GRPC_BASE_PORT``): rank r listens on base + r."""

RANK_ENV = "FEDML_CLIENT_RANK"
"""What ``fedml launch`` exports on a client machine: its rank 1..C (FedML's job runner)."""

RUN_ID_ENV = "FEDML_CURRENT_RUN_ID"
"""What ``fedml launch`` exports on every machine of a run: the run id."""


def run_port(run_id: str, rank: int, world: int) -> int:
    """Rank ``rank``'s GRPC port when the ipconfig leaves it out: derived from the run id.

    Every process of a run computes the same table from what the platform gives all of them (the
    run id), and two runs on the same hosts get different blocks of ports: block
    ``crc32(run_id) mod 200`` of ``world`` ports above :data:`GRPC_BASE_PORT` (no run id: block 0).
    """
    block = zlib.crc32(run_id.encode()) % 200 if run_id else 0
    port = GRPC_BASE_PORT + block * world + rank
    if port > 65535:
        raise ConfigError(
            f"comm_args.grpc_ipconfig_path: {world} processes leave no free port block for run id {run_id!r}; "
            "give each rank a grpc_server_port in the ipconfig"
        )
    return port


def read_ipconfig(path: str | Path, run_id: str = "") -> dict[int, tuple[str, int]]:
    """FedML's GRPC ipconfig CSV (``eid,rank,grpc_server_ip[,grpc_server_port]``): rank -> (ip, port).

    A row whose port is blank, or a file without the port column, takes the port
    :func:`run_port` derives from ``run_id`` (``fedml launch`` provides the run id; the machines'
    addresses still have to be known).
    """
    p = Path(path).expanduser()
    if not p.exists():  # a folder or a device is named as such by the bounded read
        raise ConfigError(
            f"comm_args.grpc_ipconfig_path: {p} not found; GRPC needs a CSV with columns "
            "eid,rank,grpc_server_ip[,grpc_server_port] (see deploy/ipconfig.csv)"
        )
    rows = _ipconfig_rows(p)
    need = {"eid", "rank", "grpc_server_ip"}
    if not rows or not need <= set(rows[0]):
        raise ConfigError(f"{p}: expected a header eid,rank,grpc_server_ip[,grpc_server_port] and one row per rank")
    table: dict[int, tuple[str, int]] = {}
    for row in rows:
        if None in (row.get("eid"), row.get("rank"), row.get("grpc_server_ip")):
            fields = ",".join(v for k, v in row.items() if k is not None and v is not None)
            raise ConfigError(f"{p}: the row {fields!r} has fewer fields than the header; {_IPCONFIG_FIX}")
        text = (row.get("grpc_server_port") or "").strip()
        try:
            eid, rank = int(row["eid"]), int(row["rank"])
            port = int(text) if text else run_port(run_id, rank, len(rows))
        except (ValueError, TypeError) as exc:  # TypeError: a row with fewer fields than the header
            raise ConfigError(f"{p}: eid, rank and grpc_server_port must be integers ({exc})") from exc
        if eid != rank:
            raise ConfigError(f"{p}: row with eid {eid} has rank {rank}; use eid = rank (0 = server)")
        if rank in table:
            raise ConfigError(f"{p}: rank {rank} has two rows; give each rank one row (one address per process)")
        if not 1 <= port <= 65535:
            raise ConfigError(f"{p}: rank {rank}'s grpc_server_port {port} is not a TCP port; use 1..65535")
        table[rank] = (_address(row["grpc_server_ip"], p, rank), port)
    return table


_IPCONFIG_FIX = (
    "an ipconfig is a CSV text file with columns eid,rank,grpc_server_ip[,grpc_server_port] (see deploy/ipconfig.csv)"
)


def _ipconfig_rows(p: Path) -> list[dict[str, Any]]:
    """The ipconfig CSV's rows, read with a size bound; bytes that are no CSV text are named by line and column."""
    data = read_small_file(p, "comm_args.grpc_ipconfig_path", _IPCONFIG_FIX)
    try:
        text = data.decode("utf-8-sig")  # a UTF-8 byte-order mark is no part of the header
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{p}, {text_position(data, exc.start)}: byte 0x{data[exc.start]:02x} is not UTF-8 text; {_IPCONFIG_FIX}"
        ) from None
    if "\0" in text:
        at = text_position(data, data.index(b"\0"))
        raise ConfigError(f"{p}, {at}: a NUL byte; {_IPCONFIG_FIX}")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        return list(reader)
    except csv.Error as exc:
        raise ConfigError(f"{p}, line {reader.line_num}: not CSV ({exc}); {_IPCONFIG_FIX}") from None


_HOST_NAME = re.compile(r"(?=.{1,253}$)(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def _address(text: str | None, path: Path, rank: int) -> str:
    """An ipconfig row's ``grpc_server_ip``: an IP address or a host name (999.1.1.1 is neither)."""
    address = (text or "").strip()
    try:
        ipaddress.ip_address(address)
        return address
    except ValueError:
        pass
    numeric = re.fullmatch(r"[0-9.]+", address) is not None  # dotted numbers are meant as IPv4: they must be one
    if numeric or not _HOST_NAME.fullmatch(address):
        raise ConfigError(
            f"{path}: rank {rank}'s grpc_server_ip {address!r} is not an IP address or a host name; give the "
            "address of the machine that runs the rank, e.g. 10.0.0.2"
        )
    return address


def gpu_for_rank(mapping_file: str | Path, key: str, rank: int, world: int) -> int:
    """The GPU index FedML's GPU-mapping YAML gives ``rank`` (processes numbered host by host).

    The file maps ``key`` to ``{host: [processes on GPU 0, processes on GPU 1, ...]}``, as in
    FedML's ``gpu_mapping.yaml``; the counts must add up to the job's C_k + 1 processes.
    """
    p = Path(mapping_file).expanduser()
    if not p.exists():
        raise ConfigError(f"device_args.gpu_mapping_file: {p} not found")
    raw = read_small_file(p, "device_args.gpu_mapping_file", "pass FedML's gpu_mapping.yaml")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"device_args.gpu_mapping_file: {p}, {text_position(raw, exc.start)}: not UTF-8 text"
        ) from None
    data = load_yaml(text, str(p)) or {}  # the configs' loader: aliases bounded, characters named
    if not isinstance(data, dict):
        raise ConfigError(f"device_args.gpu_mapping_file: {p} is not a mapping of keys; pass FedML's gpu_mapping.yaml")
    if key not in data:
        raise ConfigError(
            f"device_args.gpu_mapping_key: '{key}' is not in {p}; it has {', '.join(map(str, data)) or 'no keys'}"
        )
    slots = []
    for host, counts in (data[key] or {}).items():
        if not isinstance(counts, list) or not all(isinstance(c, int) and c >= 0 for c in counts):
            raise ConfigError(f"{p} [{key}] {host}: expected a list of process counts per GPU, got {counts!r}")
        for gpu, n in enumerate(counts):
            slots += [(host, gpu)] * n
    if len(slots) != world:
        raise ConfigError(
            f"{p} [{key}] places {len(slots)} processes, but the job has C_k + 1 = {world} (server + workers)"
        )
    return slots[rank][1]


def worker_count(cfg: ExperimentConfig) -> int:
    """FedML worker processes: in simulation ``device_args.worker_num`` (fewer than C_k: each serves several
    of a round's silos) or C_k (silos are routed to them), K in deployment (one per silo)."""
    t = cfg.train_args
    if deployed(cfg):
        return t.client_num_in_total
    return min(cfg.device_args.worker_num, t.client_num_per_round) or t.client_num_per_round


def world_size(cfg: ExperimentConfig) -> int:
    """Processes a FedML job needs: one server plus :func:`worker_count` workers."""
    return worker_count(cfg) + 1


def world_reason(cfg: ExperimentConfig) -> str:
    """Why the job needs :func:`world_size` processes, for error messages."""
    t = cfg.train_args
    if deployed(cfg):
        return (
            f"comm_args.mode deployment runs one process per silo: K = train_args.client_num_in_total = "
            f"{t.client_num_in_total}, plus the server: {world_size(cfg)}"
        )
    if worker_count(cfg) < t.client_num_per_round:
        return (
            f"device_args.worker_num = {worker_count(cfg)} workers (serving the C_k = {t.client_num_per_round} silos "
            f"of a round) plus the server: {world_size(cfg)}"
        )
    return f"train_args.client_num_per_round C_k = {t.client_num_per_round} needs C_k + 1 = {world_size(cfg)}"


def mpirun_command(cfg: ExperimentConfig, config: str = "CONFIG") -> str:
    """The command that runs ``cfg`` under mpirun on this machine, as it must be typed here.

    ``--oversubscribe`` when the job has more processes than this machine has cores (Open MPI
    otherwise refuses: "not enough slots"), as ``deploy/run_mpi.sh`` does.
    """
    n = world_size(cfg)
    over = " --oversubscribe" if n > (os.cpu_count() or 1) else ""
    return f"mpirun -np {n}{over} fedml-ssfl run --cf {shlex.quote(config)}"


def np_hint(cfg: ExperimentConfig) -> str:
    return f"{mpirun_command(cfg)} (deploy/run_mpi.sh computes -np from the config)"


def check_backend(cfg: ExperimentConfig) -> None:
    if cfg.comm_args.backend not in ("MPI", "GRPC") or cfg.common_args.training_type != "cross_silo":
        raise ConfigError(
            f"the FedML runtime needs comm_args.backend MPI or GRPC with common_args.training_type cross_silo "
            f"(got {cfg.comm_args.backend} / {cfg.common_args.training_type}); FedML 0.9.6 ignores custom "
            "trainers in simulation mode"
        )


def mpi_rank(cfg: ExperimentConfig, rank: int | None, role: str | None) -> tuple[int, Any]:
    """This process's MPI rank after checking the job size equals C_k + 1 (else a clear error)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    size, me = comm.Get_size(), comm.Get_rank()
    world = world_size(cfg)
    if size != world:
        if me == 0:
            raise ConfigError(
                f"this MPI job has {size} process{'es' if size != 1 else ''}, but {world_reason(cfg)} (rank 0 is the "
                f"server): run {np_hint(cfg)}"
            )
        raise SystemExit(2)  # rank 0 reports; the others leave quietly
    if rank is not None and rank != me:
        raise ConfigError(f"--rank {rank} disagrees with the MPI rank {me}; under mpirun leave --rank out")
    if role is not None and role != ("server" if me == 0 else "client"):
        raise ConfigError(f"--role {role} disagrees with MPI rank {me} (rank 0 is the server)")
    return me, comm


def port_in_use(rank: int, address: str) -> ConfigError:
    return ConfigError(
        f"rank {rank}: cannot listen on {address} (its port is in use: another process of this job already "
        "runs this rank, or another program holds the port); stop it, or give the rank another port in "
        "comm_args.grpc_ipconfig_path"
    )


def check_port_free(rank: int, ip: str, port: int) -> None:
    """Refuse early (before a run folder is claimed) when something already listens on this rank's port.

    The bind in the transport stays the authority; this only spares a duplicate process its setup.
    """
    with contextlib.suppress(OSError):
        family = socket.getaddrinfo(ip, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is no conflict
            try:
                s.bind((ip, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise port_in_use(rank, f"{ip}:{port}") from None
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise ConfigError(
                        f"rank {rank}: this machine has no address {ip} (rank {rank}'s row in "
                        "comm_args.grpc_ipconfig_path): start this rank on the machine with that address, "
                        "or fix the row"
                    ) from None


def grpc_rank(cfg: ExperimentConfig, rank: int | None, role: str | None) -> tuple[int, dict[int, tuple[str, int]]]:
    """This process's GRPC rank, checked against --role and the ipconfig (C_k + 1 rows)."""
    world = world_size(cfg)
    if rank is None and role == "server":
        rank = 0
    elif rank is None:
        rank = envvars.integer(RANK_ENV, None, minimum=0)
    if rank is None:
        raise ConfigError(
            f"comm_args.backend GRPC: pass --rank N (0 = server, 1..{world - 1} = clients) and --role server|client "
            f"(under fedml launch the client's rank comes from {RANK_ENV})"
        )
    expected = "server" if rank == 0 else "client"
    if role is not None and role != expected:
        raise ConfigError(f"--role {role} does not go with --rank {rank}: rank 0 is the server, ranks 1.. are clients")
    if not cfg.comm_args.grpc_ipconfig_path:
        raise ConfigError("comm_args.grpc_ipconfig_path: GRPC needs an ipconfig CSV (see deploy/ipconfig.csv)")
    table = read_ipconfig(cfg.comm_args.grpc_ipconfig_path, cfg.common_args.run_id)
    if cfg.comm_args.connect_out and 0 in table and set(table) <= set(range(world)):
        # clients connect out: only the server's row is needed; a client's own row is never listened on
        table = {r: table.get(r, ("", 0)) for r in range(world)}
    if sorted(table) != list(range(world)):
        raise ConfigError(
            f"{cfg.comm_args.grpc_ipconfig_path} lists ranks {sorted(table)}, but {world_reason(cfg)}: ranks "
            f"0..{world - 1}"
        )
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} is outside 0..{world - 1} ({world_reason(cfg)})")
    return rank, table


class _QuietFedMLLogs(logging.Filter):
    """Drop FedML's own INFO chatter (it logs every message through the root logger)."""

    def __init__(self, fedml_dir: str):
        super().__init__()
        self.fedml_dir = fedml_dir

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.pathname.startswith(self.fedml_dir)


def fedml_args(cfg: ExperimentConfig, rank: int) -> SimpleNamespace:
    """The flat ``args`` FedML expects, from the validated sections (offline settings forced).

    FedML's own client counts are the worker processes: every worker hears from the server every
    round (in deployment mode the algorithm's C_k of the K silos train, the rest are told to idle).
    """
    t, d = cfg.train_args, cfg.device_args
    workers = worker_count(cfg)
    return SimpleNamespace(
        training_type="cross_silo",
        backend=cfg.comm_args.backend,
        scenario="horizontal",
        federated_optimizer="FedAvg",
        config_version="release",
        random_seed=cfg.common_args.random_seed,
        using_mlops=False,
        enable_wandb=False,
        sys_perf_profiling=False,
        run_id=cfg.common_args.run_id or "0",
        dataset=cfg.data_args.dataset,
        data_cache_dir=cfg.data_args.data_cache_dir,
        model=cfg.model_args.model,
        client_num_in_total=t.client_num_in_total if not deployed(cfg) else workers,
        client_num_per_round=workers,
        comm_round=t.comm_round,
        epochs=1,
        batch_size=t.batch_size,
        learning_rate=t.learning_rate,
        client_optimizer=t.client_optimizer,
        frequency_of_the_test=cfg.validation_args.frequency_of_the_test,
        test_on_clients="no",
        worker_num=workers,
        rank=rank,
        role="server" if rank == 0 else "client",
        grpc_ipconfig_path=str(Path(cfg.comm_args.grpc_ipconfig_path).expanduser())
        if cfg.comm_args.grpc_ipconfig_path
        else "",
        using_gpu=d.device == "cuda",
        gpu_id=d.gpu_id,
        gpu_mapping_file=d.gpu_mapping_file,
        gpu_mapping_key=d.gpu_mapping_key,
        log_file_dir=cfg.tracking_args.log_file_dir,
    )


def _no_fetch_config(args, version="release"):
    """Stands in for ``fedml.core.mlops.fetch_config``, which posts to FedML's cloud."""
    return False


@contextlib.contextmanager
def _fedml_offline():
    """Import FedML with its cloud config fetch replaced and its INFO logs filtered."""
    with warnings.catch_warnings():  # requests' version check and pkg_resources, at FedML's import
        warnings.simplefilter("ignore")
        import fedml
        import fedml.core.mlops as core_mlops

    original = core_mlops.fetch_config
    core_mlops.fetch_config = _no_fetch_config
    root = logging.getLogger()
    quiet = None
    if root.getEffectiveLevel() > logging.DEBUG:
        quiet = _QuietFedMLLogs(str(Path(fedml.__file__).parent))
        root.addFilter(quiet)
    try:
        yield fedml
    finally:
        core_mlops.fetch_config = original
        if quiet is not None:
            root.removeFilter(quiet)


def _with_device(cfg: ExperimentConfig, rank: int) -> ExperimentConfig:
    """A copy of ``cfg`` whose ``gpu_id`` is this rank's GPU from the mapping file (if any)."""
    d = cfg.device_args
    if d.device != "cuda" or not d.gpu_mapping_file:
        return cfg
    gpu = gpu_for_rank(d.gpu_mapping_file, d.gpu_mapping_key, rank, world_size(cfg))
    return dataclasses.replace(cfg, device_args=dataclasses.replace(d, gpu_id=gpu))


def check_server_counts(cfg: ExperimentConfig, exp: Experiment) -> None:
    """Deployment mode: ``num_server_labels`` / ``num_server_val`` must describe the server's files.

    Algorithms check these keys (e.g. FedSEAL needs a validation set), so they must agree with what
    the server actually holds.
    """
    d, split = cfg.data_args, exp.split
    for key, have in (
        ("num_server_labels", split.server_labeled.numel()),
        ("num_server_val", split.server_val.numel()),
    ):
        if getattr(d, key) != have:
            raise ConfigError(
                f"data_args.{key} is {getattr(d, key)}, but the server's files hold {have} such samples "
                f"(data_args.server_data / server_val_data): set data_args.{key}: {have}"
            )
