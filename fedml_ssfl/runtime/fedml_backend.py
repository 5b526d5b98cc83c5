"""The FedML runtime: any registered algorithm as a FedML cross-silo server and clients.

``fedml-ssfl run --cf CONFIG`` with ``comm_args.backend: MPI`` (under ``mpirun -np C_k+1``) or
``GRPC`` (one process per host, ``--rank N --role server|client``) lands in :func:`run_fedml`.
FedML 0.9.6 honours custom trainers only in ``training_type: cross_silo`` (see
docs/deploy.md); there rank 0 is the server and ranks 1..C_k are workers, and FedML's server
manager tells each worker, every round, which data silo (client id) it trains.

How the pieces map onto FedML
-----------------------------
* :class:`ServerRuntime` (no FedML in it) is the server half of a round:
  :meth:`~ServerRuntime.begin_round` samples the C_k silos with the ONE seeded sampler
  (:func:`fedml_ssfl.sampling.sample_clients`, via :func:`.common.start_round`), runs the
  algorithm's server step and ``message_for`` each silo, and returns one payload per silo;
  :meth:`~ServerRuntime.finish_round` checks the replies, calls ``aggregate`` and records
  the round exactly as the local runtime does (:class:`.common.RunRecorder`).
* FedML's ``ServerAggregator`` subclass returns those payloads as a plain ``dict`` keyed by silo
  id -- FedML then sends each worker its own entry (group models, thresholds, helper weights all
  travel this way). Its ``FedMLAggregator`` subclass routes silos to workers
  (``data_silo_selection``) following the runtime's plan.
* FedML's ``ClientTrainer`` subclass hands each payload to a :class:`ClientWorker`, which calls
  the algorithm's ``client_update`` on the silo named in the payload.

Per-silo client state
---------------------
``client_update`` mutates a persistent per-client ``state`` dict (EMA nets, ensembles,
sigma/psi). When K > C_k a worker serves different silos across rounds, so state belongs to the
silo, not the process. Each worker caches the states of the silos it served, tagged with the
round they were last updated; the server keeps the authoritative copy of every silo's state
(what checkpoints store, in the local runtime's format). Silos are routed back to the worker that
holds their newest state when possible (:func:`assign_silos`); when a silo moves, its state is
fetched from its holder the round before (``upload`` requests) and shipped with the payload.
At checkpoint rounds every stale state is uploaded, so checkpoints are complete and ``--resume``
works across any routing. State bytes are counted apart from the algorithm's message bytes.

Faults
------
A client whose ``client_update`` raises replies with the error; the server stops the run at
once naming the rank and the silo, writes ``summary.json`` (``failed``), tells the workers to
finish and exits non-zero; the last checkpoint is untouched (atomic writes). A worker process
that dies: under ``mpirun`` the launcher terminates the job and the server records which ranks
and silos it was waiting for; under GRPC the server probes outstanding workers and fails the run
when one is unreachable. A round with no complete reply within ``FEDML_SSFL_ROUND_TIMEOUT``
seconds fails the same way. A malformed reply (unknown or missing keys, wrong shapes, NaN/inf)
is refused with a warning naming rank, silo and reason, and counts as an empty reply (the
algorithms already handle clients with nothing to send) unless the algorithm sets
``requires_all_replies = True``.

Offline
-------
FedML's cloud config fetch is replaced before ``fedml.init``, MLOps and wandb stay off, FedML's
network diagnostics are skipped, and :mod:`.offline` refuses any socket outside loopback and the
configured GRPC peers.

Only this module imports ``fedml``, ``mpi4py`` and ``grpc``, inside functions.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import functools
import io
import logging
import os
import platform
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
import zlib
from collections import OrderedDict
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm

from .. import seeding
from ..algorithms.base import ClientContext, Message, message_nbytes
from ..checkpoint import load_checkpoint, save_checkpoint
from ..config import ConfigError, ExperimentConfig
from ..data import ImageDataset
from ..experiment import Experiment, build_experiment, deployed
from ..sampling import sample_clients
from . import offline, wire
from .common import (
    CHECKPOINT_NAME,
    RoundStart,
    RunFailed,
    RunRecorder,
    RunResult,
    finish_round,
    fresh_run_dir,
    is_checkpoint_round,
    start_round,
)
from .security import (
    JobSecurity,
    Opener,
    Refused,
    Sealer,
    load_security,
    membership,
    membership_diff,
    proof,
)
from .wire import WireArray, WireError

log = logging.getLogger(__name__)

TOTALS = (
    "bytes_up",
    "bytes_down",
    "seconds",
    "wire_bytes_up",
    "wire_bytes_down",
    "state_bytes_up",
    "state_bytes_down",
)


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError as exc:
        raise ConfigError(f"{name}={value!r}: expected a number of seconds") from exc


def timeouts() -> SimpleNamespace:
    """Fault-handling time limits, in seconds (environment variables override the defaults).

    ``FEDML_SSFL_ROUND_TIMEOUT`` (3600): the server fails a round whose replies are not all in.
    ``FEDML_SSFL_CONNECT_TIMEOUT`` (300): workers must come online (and GRPC peers accept).
    ``FEDML_SSFL_FINISH_GRACE`` (30): after a failure, how long workers get to acknowledge.
    ``FEDML_SSFL_PROBE_INTERVAL`` (5): GRPC liveness probes of the workers a round waits for.
    ``FEDML_SSFL_IDLE_TIMEOUT`` (6 h): a GRPC worker that hears nothing from the server for this
    long exits with an error (sooner, after two failed probes, when the server's port is gone).
    """
    round_t = _env_seconds("FEDML_SSFL_ROUND_TIMEOUT", 3600.0)
    connect_t = _env_seconds("FEDML_SSFL_CONNECT_TIMEOUT", 300.0)
    return SimpleNamespace(
        round=round_t,
        connect=connect_t,
        grace=_env_seconds("FEDML_SSFL_FINISH_GRACE", 30.0),
        probe=_env_seconds("FEDML_SSFL_PROBE_INTERVAL", 5.0),
        idle=_env_seconds("FEDML_SSFL_IDLE_TIMEOUT", 6 * 3600.0),
    )


# ---------------------------------------------------------------------------------------------
# the wire: dense tensors travel as NumPy arrays, written as raw bytes by wire.py (no pickle)


_NUMPY_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
}


def encode(obj: Any) -> Any:
    """Replace dense CPU-able tensors inside dicts / lists / tuples / Messages by :class:`WireArray`."""
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided and obj.dtype in _NUMPY_DTYPES:
            return WireArray(obj.detach().cpu().numpy())
        return obj  # sparse, bfloat16, ...: torch's own pickling
    if isinstance(obj, Message):
        return Message(weights=encode(obj.weights), extras=encode(obj.extras), num_samples=obj.num_samples)
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, encode(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(encode(v) for v in obj)
    return obj


def decode(obj: Any) -> Any:
    """Inverse of :func:`encode` (arrays become tensors sharing the unpickled memory)."""
    if isinstance(obj, WireArray):
        array = obj.array  # np.ascontiguousarray would turn a 0-d array (BatchNorm's counter) into shape (1,)
        return torch.from_numpy(array if array.flags.c_contiguous else np.ascontiguousarray(array))
    if isinstance(obj, Message):
        return Message(weights=decode(obj.weights), extras=decode(obj.extras), num_samples=obj.num_samples)
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, decode(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(decode(v) for v in obj)
    return obj


def state_nbytes(state: Any) -> int:
    """Tensor bytes of a client state (same counting rule as ``message_nbytes``)."""
    return message_nbytes(Message(extras={"state": state})) if state else 0


# ---------------------------------------------------------------------------------------------
# routing, checks, deployment files


def assign_silos(chosen: list[int], holder: dict[int, int], workers: int) -> list[int]:
    """Route a round's silos to workers 1..``workers``: position i is served by rank i + 1.

    A silo goes back to the worker holding its newest client state when that worker is free,
    so state rarely has to move; the rest fill the free workers in id order. Deterministic.
    """
    if len(chosen) != workers:
        raise ValueError(f"{len(chosen)} silos for {workers} workers")
    slots: list[int | None] = [None] * workers
    rest = []
    for k in sorted(chosen):
        w = holder.get(k)
        if w is not None and 1 <= w <= workers and slots[w - 1] is None:
            slots[w - 1] = k
        else:
            rest.append(k)
    free = [i for i, s in enumerate(slots) if s is None]
    for i, k in zip(free, rest, strict=True):
        slots[i] = k
    return [int(s) for s in slots]


def _tensors(obj: Any, path: str = ""):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")


def check_reply(
    reply: Any,
    model_shapes: dict[str, tuple[int, ...]],
    sent: Message | None = None,
    partial_ok: bool = False,
) -> str | None:
    """Why a client's reply is malformed, or None when it is fine.

    Refused: not a :class:`Message`; weights naming tensors neither the model nor the message
    sent has; a shape different from the reference; NaN or inf anywhere (weights, or tensors in
    extras); a dense full-model reply missing model keys (unless ``partial_ok``); a negative or
    non-integer ``num_samples``.
    """
    if not isinstance(reply, Message):
        return f"expected a Message, got {type(reply).__name__}"
    if not isinstance(reply.weights, dict) or not isinstance(reply.extras, dict):
        return "weights and extras must be dicts"
    if not isinstance(reply.num_samples, int) or reply.num_samples < 0:
        return f"num_samples must be an integer >= 0, got {reply.num_samples!r}"
    ref = dict(model_shapes)
    if sent is not None:
        ref.update({k: tuple(t.shape) for k, t in sent.weights.items() if isinstance(t, torch.Tensor)})
    unknown = sorted(set(reply.weights) - set(ref))
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        return f"unknown weight keys: {shown}"
    sparse = False
    for name, t in reply.weights.items():
        if not isinstance(t, torch.Tensor):
            return f"weight {name!r} is a {type(t).__name__}, not a tensor"
        if tuple(t.shape) != tuple(ref[name]):
            return f"weight {name!r} has shape {tuple(t.shape)}, expected {tuple(ref[name])}"
        sparse = sparse or t.is_sparse
    missing = sorted(set(model_shapes) - set(reply.weights))
    if reply.weights and missing and not sparse and not partial_ok and set(reply.weights) <= set(model_shapes):
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        return f"missing weight keys: {shown}"
    extras = {k: v for k, v in reply.extras.items() if k != "metrics"}
    for name, t in [*_tensors(reply.weights), *_tensors(extras)]:
        values = t.coalesce().values() if t.is_sparse else t
        if (values.is_floating_point() or values.is_complex()) and not bool(torch.isfinite(values).all()):
            return f"non-finite values (NaN/inf) in {name!r}"
    return None


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
    if not p.is_file():
        raise ConfigError(
            f"comm_args.grpc_ipconfig_path: {p} not found; GRPC needs a CSV with columns "
            "eid,rank,grpc_server_ip[,grpc_server_port] (see deploy/ipconfig.csv)"
        )
    with p.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    need = {"eid", "rank", "grpc_server_ip"}
    if not rows or not need <= set(rows[0]):
        raise ConfigError(f"{p}: expected a header eid,rank,grpc_server_ip[,grpc_server_port] and one row per rank")
    table: dict[int, tuple[str, int]] = {}
    for row in rows:
        text = (row.get("grpc_server_port") or "").strip()
        try:
            eid, rank = int(row["eid"]), int(row["rank"])
            port = int(text) if text else run_port(run_id, rank, len(rows))
        except ValueError as exc:
            raise ConfigError(f"{p}: eid, rank and grpc_server_port must be integers ({exc})") from exc
        if eid != rank:
            raise ConfigError(f"{p}: row with eid {eid} has rank {rank}; use eid = rank (0 = server)")
        if not 1 <= port <= 65535:
            raise ConfigError(f"{p}: rank {rank}'s grpc_server_port {port} is not a TCP port; use 1..65535")
        table[rank] = (row["grpc_server_ip"].strip(), port)
    return table


def gpu_for_rank(mapping_file: str | Path, key: str, rank: int, world: int) -> int:
    """The GPU index FedML's GPU-mapping YAML gives ``rank`` (processes numbered host by host).

    The file maps ``key`` to ``{host: [processes on GPU 0, processes on GPU 1, ...]}``, as in
    FedML's ``gpu_mapping.yaml``; the counts must add up to the job's C_k + 1 processes.
    """
    p = Path(mapping_file).expanduser()
    if not p.is_file():
        raise ConfigError(f"device_args.gpu_mapping_file: {p} not found")
    data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
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


# ---------------------------------------------------------------------------------------------
# the client side (no FedML in here)


class ClientWorker:
    """One worker process: trains whichever silo each payload names, keeping per-silo state.

    Parameters
    ----------
    exp : Experiment
        This process's experiment (data, split, algorithm built from the shared config).
    rank : int
        The worker's rank (1..C_k).
    """

    def __init__(self, exp: Experiment, rank: int):
        self.exp, self.rank = exp, rank
        self.cache: dict[int, tuple[int, dict]] = {}  # silo -> (round of last update, state)

    def handle(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Run one round's client update; return the upload (or an error upload, never raising)."""
        r, k = payload.get("round", -1), payload.get("silo", -1)
        try:
            for j in payload.get("drop", ()):
                self.cache.pop(j, None)
            if payload["state"] is not None:
                self.cache[k] = (payload["state_tag"], payload["state"])
            tag, state = self.cache.get(k, (None, None))
            if state is None or tag != payload["state_tag"]:
                raise RuntimeError(
                    f"silo {k}'s client state from round {payload['state_tag']} is not on rank {self.rank} "
                    f"(it has {tag}); the routing and the state cache disagree"
                )
            ctx = ClientContext(round_idx=r, device=self.exp.device, seed=self.exp.config.common_args.random_seed)
            t0 = time.perf_counter()
            with seeding.global_stream(ctx.seed, "client", r, k, device=self.exp.device):
                reply = self.exp.algorithm.client_update(payload["msg"], self.exp.client_data(k, r), state, ctx)
            seconds = time.perf_counter() - t0
            self.cache[k] = (r, state)
            missing = [j for j in payload["upload"] if j not in self.cache]
            if missing:
                raise RuntimeError(
                    f"asked to upload the state of silos {missing}, which rank {self.rank} does not hold"
                )
            states = {j: self.cache[j] for j in payload["upload"]}
            return {
                "kind": "reply",
                "round": r,
                "silo": k,
                "rank": self.rank,
                "msg": reply,
                "states": states,
                "seconds": seconds,
            }
        except Exception as exc:  # reported to the server, which stops the run with this message
            return {
                "kind": "error",
                "round": r,
                "silo": k,
                "rank": self.rank,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }


# ---------------------------------------------------------------------------------------------
# the server side (no FedML in here)


class ServerRuntime:
    """The server's round logic, routing and per-silo state store, independent of transport.

    Parameters
    ----------
    cfg : ExperimentConfig
        The run's config (its fingerprint goes into checkpoints).
    exp : Experiment
        The server's experiment; ``exp.algorithm.setup()`` must have run.
    run_dir : Path
        Output folder.
    resume_state : dict, optional
        A checkpoint to continue from.
    workers : int
        C_k, the number of worker processes.
    stop_after : int, optional
        Stop after this many rounds in total (as in the local runtime).
    backend : str
        Name recorded in the summary (``MPI`` / ``GRPC``).
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        exp: Experiment,
        run_dir: Path,
        resume_state: dict[str, Any] | None,
        workers: int,
        stop_after: int | None = None,
        backend: str = "MPI",
    ) -> None:
        self.cfg, self.exp, self.workers, self.backend = cfg, exp, workers, backend
        K = cfg.train_args.client_num_in_total
        self.rec = RunRecorder(cfg, exp, run_dir, resume_state=resume_state, totals_keys=TOTALS)
        self.run_dir = Path(run_dir)
        self.client_states: dict[int, dict] = (
            resume_state["client_states"] if resume_state is not None else {k: {} for k in range(K)}
        )
        self.tags = {k: -1 for k in range(K)}  # round each silo's state was last updated
        self.holder: dict[int, int] = {}  # silo -> rank whose cache has its newest state
        self.stale: set[int] = set()  # silos whose newest state the server has not received
        self.drop: dict[int, set[int]] = {w: set() for w in range(1, workers + 1)}
        self.plans: dict[int, list[int]] = {}
        self.round = self.rec.start
        rounds = cfg.train_args.comm_round
        self.end = rounds if stop_after is None else min(rounds, stop_after)
        self.status = "completed" if self.end == rounds else "stopped"
        self.current: RoundStart | None = None
        self.payloads: dict[int, dict] | None = None
        self.awaiting: dict[int, int] = {}  # rank -> silo, this round
        self.round_started = time.monotonic()
        self.failure: RunFailed | None = None
        self.refused: list[str] = []
        self.last_row: dict[str, Any] = {}
        self.model_shapes = {k: tuple(v.shape) for k, v in exp.algorithm.model_fn().state_dict().items()}
        self.partial_ok = bool(getattr(exp.algorithm, "partial_replies", False))
        self.requires_all = bool(getattr(exp.algorithm, "requires_all_replies", False))
        self.bar = tqdm(
            total=rounds,
            initial=self.round,
            desc=f"{cfg.algorithm} [FedML {backend}]",
            unit="round",
            disable=not cfg.tracking_args.progress_bar,
            dynamic_ncols=True,
            leave=True,
        )

    # ---- routing -------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.round >= self.end

    def plan(self, r: int, holder: dict[int, int] | None = None) -> list[int]:
        """The silo each worker serves in round ``r`` (cached: computed once per round)."""
        if r not in self.plans:
            t = self.cfg.train_args
            chosen = sample_clients(self.cfg.common_args.random_seed, r, t.client_num_in_total, t.client_num_per_round)
            self.plans[r] = assign_silos(chosen, self.holder if holder is None else holder, self.workers)
        return self.plans[r]

    def routing(self) -> list[int]:
        """Silo ids in worker order for the next send (the last round's after the run ends)."""
        return self.plan(min(self.round, self.end - 1))

    def outstanding(self) -> dict[int, int]:
        """rank -> silo of the workers this round still waits for."""
        return dict(self.awaiting)

    def received(self, rank: int) -> None:
        self.awaiting.pop(rank, None)

    # ---- a round -------------------------------------------------------------------------
    def begin_round(self) -> dict[int, dict[str, Any]]:
        """Server step and one payload per silo for the current round (idempotent per round)."""
        r = self.round
        if self.payloads is not None and self.current is not None and self.current.round_idx == r:
            return self.payloads
        plan = self.plan(r)
        start = start_round(self.exp, r)
        if sorted(plan) != start.chosen:
            raise RuntimeError(f"routing {plan} disagrees with the sampler's {start.chosen} in round {r}")
        after = dict(self.holder)
        after.update({k: i + 1 for i, k in enumerate(plan)})
        stale_after = self.stale | set(plan)
        nxt = self.plan(r + 1, holder=after) if r + 1 < self.end else []
        checkpoint = is_checkpoint_round(self.cfg, r, self.end)
        uploads: dict[int, list[int]] = {w: [] for w in range(1, self.workers + 1)}
        for j in sorted(stale_after):
            w = after[j]
            if checkpoint or (j in nxt and nxt.index(j) + 1 != w):
                uploads[w].append(j)
        payloads, state_down = {}, 0
        for i, k in enumerate(plan):
            w = i + 1
            send_state = self.holder.get(k) != w
            if send_state:
                if k in self.stale:
                    raise RuntimeError(f"silo {k}'s newest state is on rank {self.holder[k]}, not on the server")
                state_down += state_nbytes(self.client_states[k])
            payloads[k] = {
                "kind": "round",
                "round": r,
                "silo": k,
                "rank": w,
                "msg": start.messages[k],
                "state": self.client_states[k] if send_state else None,
                "state_tag": self.tags[k],
                "upload": uploads[w],
                "drop": sorted(self.drop[w] - {k}),
            }
            self.drop[w].clear()
        self.current, self.payloads, self.state_down = start, payloads, state_down
        self.awaiting = {i + 1: k for i, k in enumerate(plan)}
        self.round_started = time.monotonic()
        return payloads

    def finish_round(self, uploads: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """Fold the workers' uploads into the algorithm; record the round; advance."""
        start, r = self.current, self.round
        if start is None:
            raise RuntimeError("finish_round before begin_round")
        by_silo = {}
        for up in uploads:
            if up.get("kind") == "error":
                raise self.client_error(up)
            if up.get("round") != r or up.get("silo") not in start.chosen:
                raise RuntimeError(
                    f"rank {up.get('rank')} sent a reply for round {up.get('round')} silo {up.get('silo')} "
                    f"while round {r} waited for silos {start.chosen}"
                )
            if up.get("rank") != self.plan(r).index(up["silo"]) + 1:
                raise RuntimeError(
                    f"round {r}: silo {up['silo']} came back from rank {up.get('rank')}, but was routed to rank "
                    f"{self.plan(r).index(up['silo']) + 1}"
                )
            by_silo[up["silo"]] = up
        if sorted(by_silo) != start.chosen:
            raise RuntimeError(f"round {r}: replies for silos {sorted(by_silo)}, expected {start.chosen}")
        for k in start.chosen:  # the worker that trained a silo now holds its newest state
            w = by_silo[k]["rank"]
            old = self.holder.get(k)
            if old is not None and old != w:
                self.drop[old].add(k)
            self.holder[k], self.tags[k] = w, r
            self.stale.add(k)
        state_up = 0
        for k in start.chosen:
            up = by_silo[k]
            for j, (tag, st) in up.get("states", {}).items():
                if self.holder.get(j) == up["rank"] and self.tags[j] == tag:
                    self.client_states[j] = st
                    self.stale.discard(j)
                    state_up += state_nbytes(st)
        if is_checkpoint_round(self.cfg, r, self.end) and self.stale:
            raise RuntimeError(f"round {r}: client states of silos {sorted(self.stale)} were not uploaded")
        return self._close_round(by_silo, state_bytes_up=state_up, state_bytes_down=self.state_down, **extra)

    def _close_round(self, by_silo: dict[int, dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """Check the chosen silos' replies, aggregate, record the round and advance (both modes)."""
        start, r = self.current, self.round
        replies: dict[int, Message] = {}
        up_bytes = refused = 0
        for k in start.chosen:  # sorted, as in the local runtime: aggregation order matters
            up = by_silo[k]
            msg = up.get("msg")
            if isinstance(msg, Message):
                up_bytes += message_nbytes(msg)
            problem = check_reply(msg, self.model_shapes, start.messages.get(k), self.partial_ok)
            if problem is None:
                replies[k] = msg
                continue
            text = f"round {r}: refused the reply of rank {up['rank']} (silo {k}): {problem}"
            if self.requires_all:
                raise RunFailed(f"{text}; algorithm '{self.cfg.algorithm}' needs every reply")
            log.warning("%s; the round goes on without it", text)
            self.refused.append(text)
            refused += 1
            replies[k] = Message()
        if refused:
            extra["refused_replies"] = refused
        row = finish_round(self.exp, start, replies, up_bytes, **extra)
        acc = self.rec.record(r, row, self.end, self.client_states)
        self.last_row = row
        self.round += 1
        self.current, self.payloads, self.awaiting = None, None, {}
        self.bar.update(1)
        if acc is not None:
            self.bar.set_postfix(acc=f"{100 * acc:.2f}%")
        return row

    def client_error(self, up: dict[str, Any]) -> RunFailed:
        tb = up.get("traceback", "")
        if tb:
            log.error("traceback from rank %s (silo %s):\n%s", up.get("rank"), up.get("silo"), tb)
        return RunFailed(
            f"rank {up.get('rank')} (silo {up.get('silo')}) failed in round {up.get('round')}: {up.get('error')}"
        )

    # ---- end -----------------------------------------------------------------------------
    def fail(self, error: BaseException | str) -> RunFailed:
        """Record a failure once (summary.json ``failed``); return the :class:`RunFailed`."""
        if self.failure is None:
            text = str(error) if isinstance(error, (RunFailed, str)) else f"{type(error).__name__}: {error}"
            self.failure = self.rec.fail(text)
            self.bar.close()
            self.rec.close()
        return self.failure

    def result(self) -> RunResult:
        self.bar.close()
        self.rec.close()
        return self.rec.result(
            self.status,
            runtime=f"fedml-{self.backend}",
            workers=self.workers,
            wire_bytes_up_per_round=self.rec.totals["wire_bytes_up"] / max(len(self.rec.tracker.rows), 1),
            wire_bytes_down_per_round=self.rec.totals["wire_bytes_down"] / max(len(self.rec.tracker.rows), 1),
            state_bytes_total=self.rec.totals["state_bytes_up"] + self.rec.totals["state_bytes_down"],
            refused_replies=self.refused,
        )

    def describe(self, ranks: dict[int, int]) -> str:
        return ", ".join(f"rank {w} (silo {k})" for w, k in sorted(ranks.items()))


# ---------------------------------------------------------------------------------------------
# deployment mode: silo k's data only on rank k + 1, its client state stays there (no FedML in here)

SILO_STATE_NAME = "silo_state.pt"


def silo_dir(cfg: ExperimentConfig, run_name: str, silo: int) -> Path:
    """Where silo ``silo`` keeps its client state: ``output_dir/<the server's run folder name>/silo_<k>``."""
    return Path(cfg.common_args.output_dir).expanduser() / run_name / f"silo_{silo}"


class SiloWorker:
    """A deployed silo (rank k + 1): trains its own data, keeps its own client state, saves it itself.

    The first payload carries the server's metadata (:class:`~fedml_ssfl.data.silos.SiloMeta`),
    the run folder's name and the last round the run had completed; only then does the silo read
    its file (``data_args.local_data``), check it against the metadata and build its algorithm.
    Its client state never leaves the process: at checkpoint rounds (every payload says whether
    the round is one) it is written atomically to ``silo_dir(...)/checkpoints/silo_state.pt`` with
    the round, and a resumed run reloads it, refusing a file from another round or config.
    """

    def __init__(self, cfg: ExperimentConfig, rank: int):
        self.cfg, self.rank, self.silo = cfg, rank, rank - 1
        self.exp: Any = None
        self.state: dict[str, Any] = {}
        self.state_path: Path | None = None

    def _start(self, payload: dict[str, Any]) -> None:
        from ..data.silos import SiloMeta
        from ..experiment import build_silo_experiment

        meta = payload.get("meta")
        if meta is None:
            raise RuntimeError("the server's first message carries no metadata; restart the job")
        self.exp = build_silo_experiment(self.cfg, SiloMeta(**meta), self.rank)
        self.state_path = silo_dir(self.cfg, payload["run_name"], self.silo) / "checkpoints" / SILO_STATE_NAME
        after = int(payload.get("resumed_after", -1))
        if after >= 0:
            saved = load_checkpoint(self.state_path, self.cfg.fingerprint())
            if saved.get("round") != after or saved.get("silo") != self.silo:
                raise RuntimeError(
                    f"{self.state_path} holds silo {saved.get('silo')}'s state after round {saved.get('round')}, but "
                    f"the server resumes after round {after}: restore this silo's checkpoint folder from that round"
                )
            self.state = saved["state"]

    def handle(self, payload: dict[str, Any]) -> dict[str, Any]:
        """One round (train, or stay idle when not sampled); never raises (errors go to the server)."""
        r = payload.get("round", -1)
        try:
            if self.exp is None:
                self._start(payload)
            if payload.get("silo") != self.silo:
                raise RuntimeError(f"rank {self.rank} serves silo {self.silo}, but was sent silo {payload.get('silo')}")
            up: dict[str, Any] = {"kind": "idle", "round": r, "silo": self.silo, "rank": self.rank}
            if payload["kind"] == "round":
                seed = self.cfg.common_args.random_seed
                ctx = ClientContext(round_idx=r, device=self.exp.device, seed=seed)
                t0 = time.perf_counter()
                with seeding.global_stream(seed, "client", r, self.silo, device=self.exp.device):
                    reply = self.exp.algorithm.client_update(
                        payload["msg"], self.exp.client_data(self.silo, r), self.state, ctx
                    )
                up.update(kind="reply", msg=reply, seconds=time.perf_counter() - t0)
            if payload.get("checkpoint"):
                save_checkpoint(
                    self.state_path,
                    {"round": r, "silo": self.silo, "fingerprint": self.cfg.fingerprint(), "state": self.state},
                )
            return up
        except Exception as exc:  # reported to the server, which stops the run naming this silo
            return {
                "kind": "error",
                "round": r,
                "silo": self.silo,
                "rank": self.rank,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }


class DeployedServerRuntime(ServerRuntime):
    """The server of a deployment: rank k + 1 always serves silo k, whose data and state stay there.

    Every round every silo gets a payload: the sampled ones the algorithm's message, the others an
    ``idle`` note (so that all of them keep step, answer liveness, and save their state at checkpoint
    rounds). The first payload to each rank also carries the metadata the silo checks its data
    against and builds its model from. The server's checkpoint holds no client state: each silo
    saves its own (:class:`SiloWorker`).
    """

    def __init__(self, cfg, exp, run_dir, resume_state, workers, stop_after=None, backend="MPI") -> None:
        from ..data.silos import SiloMeta

        super().__init__(cfg, exp, run_dir, resume_state, workers, stop_after, backend)
        self.client_states = {}
        self.meta = dataclasses.asdict(SiloMeta.of(exp.dataset))
        self.resumed_after = self.round - 1 if resume_state is not None else -1
        self.introduced: set[int] = set()

    def plan(self, r: int, holder: dict[int, int] | None = None) -> list[int]:
        return list(range(self.workers))

    def begin_round(self) -> dict[int, dict[str, Any]]:
        r = self.round
        if self.payloads is not None and self.current is not None and self.current.round_idx == r:
            return self.payloads
        start = start_round(self.exp, r)
        checkpoint = is_checkpoint_round(self.cfg, r, self.end)
        payloads = {}
        for k in range(self.workers):
            p: dict[str, Any] = {"kind": "idle", "round": r, "silo": k, "rank": k + 1, "checkpoint": checkpoint}
            if k in start.messages:
                p.update(kind="round", msg=start.messages[k])
            if k + 1 not in self.introduced:
                p.update(meta=self.meta, run_name=self.run_dir.name, resumed_after=self.resumed_after)
                self.introduced.add(k + 1)
            payloads[k] = p
        self.current, self.payloads = start, payloads
        self.awaiting = {k + 1: k for k in range(self.workers)}
        self.round_started = time.monotonic()
        return payloads

    def finish_round(self, uploads: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        start, r = self.current, self.round
        if start is None:
            raise RuntimeError("finish_round before begin_round")
        by_silo: dict[int, dict[str, Any]] = {}
        for up in uploads:
            if up.get("kind") == "error":
                raise self.client_error(up)
            k = up.get("silo")
            if up.get("round") != r or up.get("rank") != (k + 1 if isinstance(k, int) else None):
                raise RuntimeError(
                    f"rank {up.get('rank')} sent a reply for round {up.get('round')} silo {k} in round {r} "
                    "(rank k + 1 serves silo k)"
                )
            if (up.get("kind") == "reply") != (k in start.chosen):
                raise RuntimeError(f"round {r}: silo {k} answered '{up.get('kind')}' to a '{self.payloads[k]['kind']}'")
            if up["kind"] == "reply":
                by_silo[k] = up
        if sorted(by_silo) != start.chosen:
            raise RuntimeError(f"round {r}: replies for silos {sorted(by_silo)}, expected {start.chosen}")
        return self._close_round(by_silo, **extra)


# ---------------------------------------------------------------------------------------------
# checks before anything starts


def worker_count(cfg: ExperimentConfig) -> int:
    """FedML worker processes: C_k in simulation (silos are routed to them), K in deployment (one per silo)."""
    t = cfg.train_args
    return t.client_num_in_total if deployed(cfg) else t.client_num_per_round


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
    return f"train_args.client_num_per_round C_k = {t.client_num_per_round} needs C_k + 1 = {world_size(cfg)}"


def np_hint(cfg: ExperimentConfig) -> str:
    return f"mpirun -np {world_size(cfg)} fedml-ssfl run --cf CONFIG (deploy/run_mpi.sh computes -np from the config)"


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
    elif rank is None and os.environ.get(RANK_ENV, "").strip():
        text = os.environ[RANK_ENV].strip()
        try:
            rank = int(text)
        except ValueError:
            raise ConfigError(f"{RANK_ENV}={text!r} is not a rank; pass --rank N") from None
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
    if sorted(table) != list(range(world)):
        raise ConfigError(
            f"{cfg.comm_args.grpc_ipconfig_path} lists ranks {sorted(table)}, but {world_reason(cfg)}: ranks "
            f"0..{world - 1}"
        )
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} is outside 0..{world - 1} ({world_reason(cfg)})")
    return rank, table


# ---------------------------------------------------------------------------------------------
# FedML, lazily


class _QuietFedMLLogs(logging.Filter):
    """Drop FedML's own INFO chatter (it logs every message through the root logger)."""

    def __init__(self, fedml_dir: str):
        super().__init__()
        self.fedml_dir = fedml_dir

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.pathname.startswith(self.fedml_dir)


class DeliveryError(ConnectionError):
    """A GRPC message could not be delivered to ``receiver`` (its process died, or the network)."""

    def __init__(self, text: str, receiver: int, address: str, code: str):
        super().__init__(text)
        self.receiver, self.address, self.code = receiver, address, code


class WireMeter:
    """Serialized bytes actually sent / received, by FedML message type (thread-safe)."""

    def __init__(self, message_class: type | None = None) -> None:
        self.lock = threading.Lock()
        self.sent: dict[Any, int] = {}
        self.recv: dict[Any, int] = {}
        self.message_class = message_class  # FedML's transport message (set when FedML is imported)

    @staticmethod
    def _type(obj: Any) -> Any:
        get = getattr(obj, "get_type", None)
        try:
            return get() if callable(get) else None
        except Exception:
            return None

    def count(self, table: dict, obj: Any, n: int) -> None:
        t = self._type(obj)
        with self.lock:
            table[t] = table.get(t, 0) + n

    def total(self, table: dict, types: tuple) -> int:
        with self.lock:
            return sum(table.get(t, 0) for t in types)

    def dumps(self, obj: Any) -> bytes:
        """Encode with :mod:`~fedml_ssfl.runtime.wire` (no pickle), counting the bytes."""
        data = wire.dumps(obj, self.message_class)
        self.count(self.sent, obj, len(data))
        return data

    def loads(self, buf: Any) -> Any:
        """Decode with :mod:`~fedml_ssfl.runtime.wire`; :class:`~fedml_ssfl.runtime.wire.WireError` for
        bytes that are not a well-formed message (nothing is built from them)."""
        obj = wire.loads(buf, self.message_class)
        self.count(self.recv, obj, memoryview(buf).nbytes)
        return obj


@functools.cache
def _fedml_classes() -> SimpleNamespace:
    """FedML subclasses, defined on first use so that importing this module never imports FedML."""
    import grpc
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2, grpc_comm_manager_pb2_grpc
    from fedml.core.distributed.communication.grpc.grpc_comm_manager import GRPCCommManager, GRPCMapping
    from fedml.core.distributed.communication.message import Message as FedMessage
    from fedml.core.distributed.communication.mpi.com_manager import MpiCommunicationManager
    from fedml.cross_silo.client.fedml_client_master_manager import ClientMasterManager
    from fedml.cross_silo.server.fedml_aggregator import FedMLAggregator
    from fedml.cross_silo.server.fedml_server_manager import FedMLServerManager
    from fedml.cross_silo.server.message_define import MyMessage

    WATCHDOG = "ssfl_watchdog"
    MEMBERSHIP, PROOF, REFUSED = "ssfl_membership", "ssfl_proof", "ssfl_refused"

    # ---- transports: blocking waits instead of FedML's busy polling ----------------------
    class QuietMpiComm(MpiCommunicationManager):
        """FedML's MPI transport, waiting on its queue instead of spinning (frees a core)."""

        def handle_receive_message(self):
            self._notify_connection_ready()
            while not self._stop_running:
                try:
                    msg = self.q_receiver.get(timeout=0.2)
                except queue.Empty:
                    continue
                self.notify(msg)

        def inject(self, msg) -> None:
            self.q_receiver.put(msg)

        def _free_q(self, q):  # FedML's calls a non-existent Queue.get_no_wait
            with contextlib.suppress(queue.Empty):
                while True:
                    q.get_nowait()

    class SealedServicer(grpc_comm_manager_pb2_grpc.gRPCCommManagerServicer):
        """FedML's GRPC service, opening envelopes (:mod:`.security`) before anything is queued."""

        def __init__(self, opener: Opener, rank: int):
            self.opener, self.rank = opener, rank
            self.message_q: queue.Queue = queue.Queue()

        def sendMessage(self, request, context):
            try:
                sender, payload = self.opener.open(request.message)
            except Refused as exc:
                log.warning("rank %d dropped a message from %s: %s", self.rank, context.peer(), exc)
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"rank {self.rank} dropped the message: {exc}")
            self.message_q.put((sender, payload, context.peer()))
            return grpc_comm_manager_pb2.CommResponse()

    class QuietGrpcComm(GRPCCommManager):
        """FedML's GRPC transport over sealed envelopes (TLS, the job key), with blocking waits, cached
        channels, wait-for-ready sends and byte counts. Replaces FedML's ``__init__`` (server creation:
        TLS, no port sharing), ``send_message``, ``message_handling_subroutine`` and ``stop_receive_message``."""

        def __init__(self, *, grpc_ipconfig_path, client_rank, client_num, args, meter: WireMeter, connect_timeout):
            self.meter, self.connect_timeout = meter, connect_timeout
            self._channels: dict[int, Any] = {}
            self._topic, self._observers = "fedml", []
            self.grpc_ipconfig_path, self.args = grpc_ipconfig_path, args
            self.grpc_mappings: dict[int, Any] = {}
            self.client_rank = self.client_id = client_rank
            self.client_num = client_num
            self.node_type = "server" if client_rank == 0 else "client"
            self._init_grpc_mappings()
            self.security: JobSecurity = args.ssfl_security
            limit = wire.max_message_bytes()
            # up to twice the limit is read and dropped by name; gRPC itself refuses more
            grpc_limit = min(2 * limit, 2**31 - 1)
            self.opts = [
                ("grpc.max_send_message_length", grpc_limit),
                ("grpc.max_receive_message_length", grpc_limit),
                ("grpc.enable_http_proxy", 0),
            ]
            if self.security.tls is not None and self.security.tls.server_name:
                self.opts.append(("grpc.ssl_target_name_override", self.security.tls.server_name))
            peers = {0} if client_rank else set(self.grpc_mappings) - {0}
            self.sealer = Sealer(self.security, client_rank)
            self.grpc_servicer = SealedServicer(Opener(self.security, client_rank, peers, limit), client_rank)
            self.grpc_server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=max(2, client_num)),
                options=[*self.opts, ("grpc.so_reuseport", 0)],  # a second process cannot share the port
            )
            grpc_comm_manager_pb2_grpc.add_gRPCCommManagerServicer_to_server(self.grpc_servicer, self.grpc_server)
            me = self.grpc_mappings[client_rank]
            address = f"{me.grpc_server_ip}:{me.grpc_server_port}"
            tls = self.security.tls
            try:
                if tls is None:
                    self.grpc_server.add_insecure_port(address)
                else:
                    creds = grpc.ssl_server_credentials([(tls.key, tls.cert)], tls.ca, require_client_auth=True)
                    self.grpc_server.add_secure_port(address, creds)
            except RuntimeError:
                raise port_in_use(client_rank, address) from None
            self.grpc_server.start()
            self.is_running = True

        def channel(self, url: str):
            """A channel to ``url`` with this job's credentials."""
            tls = self.security.tls
            if tls is None:
                return grpc.insecure_channel(url, options=self.opts)
            creds = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
            return grpc.secure_channel(url, creds, options=self.opts)

        def _init_grpc_mappings(self):
            """The table :func:`grpc_rank` resolved (ports derived from the run id where the CSV has none)."""
            table = getattr(self.args, "ssfl_grpc_table", None)
            if table is None:
                super()._init_grpc_mappings()
                return
            for rank, (ip, port) in table.items():
                self.grpc_mappings[rank] = GRPCMapping(
                    eid=rank, rank=rank, grpc_server_ip=ip, grpc_server_port=port, ingress_ip=None
                )

        def _stub(self, receiver: int):
            if receiver not in self._channels:
                m = self.grpc_mappings[receiver]
                url = f"{m.ingress_ip or m.grpc_server_ip}:{m.grpc_server_port}"
                channel = self.channel(url)
                self._channels[receiver] = (channel, grpc_comm_manager_pb2_grpc.gRPCCommManagerStub(channel))
            return self._channels[receiver][1]

        def send_message(self, msg):
            m = self.grpc_mappings[self.client_id]
            msg.add_params(GRPCCommManager.MSG_ARG_KEY_SENDER_RANK, self.client_rank)
            msg.add_params(GRPCCommManager.MSG_ARG_KEY_SENDER_IP, m.ingress_ip or m.grpc_server_ip)
            msg.add_params(GRPCCommManager.MSG_ARG_KEY_SENDER_PORT, m.grpc_server_port)
            data = self.meter.dumps(msg)
            request = grpc_comm_manager_pb2.CommRequest()
            request.client_id = self.client_id
            request.message = self.sealer.seal(int(msg.get_receiver_id()), data)
            # A status probe to a worker not up yet may fail (the worker announces itself), and a
            # stop notice is best effort; everything else waits for the peer, up to the connect timeout.
            fast = msg.get_type() in (MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS, MyMessage.MSG_TYPE_S2C_FINISH)
            receiver = int(msg.get_receiver_id())
            try:
                self._stub(receiver).sendMessage(
                    request, timeout=5.0 if fast else self.connect_timeout, wait_for_ready=not fast
                )
            except grpc.RpcError as exc:
                r = self.grpc_mappings[receiver]
                address = f"{r.ingress_ip or r.grpc_server_ip}:{r.grpc_server_port}"
                code = exc.code().name
                finished = (
                    msg.get_type() == MyMessage.MSG_TYPE_C2S_CLIENT_STATUS
                    and msg.get(MyMessage.MSG_ARG_KEY_CLIENT_STATUS) == "FINISHED"
                )
                if finished and code in ("UNAVAILABLE", "CANCELLED"):
                    # the run is over: the server may stop while this last notice is in flight
                    log.info("rank %d: the server stopped while it was told this rank finished", self.client_rank)
                    return
                if code == "DEADLINE_EXCEEDED":
                    waited = f"within {self.connect_timeout:.0f} s (FEDML_SSFL_CONNECT_TIMEOUT)"
                elif code == "PERMISSION_DENIED":  # the receiver dropped it: say why (another key, ...)
                    waited = f"({code}: {exc.details()})"
                else:
                    waited = f"({code})"
                raise DeliveryError(
                    f"rank {self.client_rank} could not deliver a message to rank {receiver} at {address} {waited}",
                    receiver,
                    address,
                    code,
                ) from exc

        def message_handling_subroutine(self):
            while self.is_running:
                try:
                    item = self.grpc_servicer.message_q.get(timeout=0.2)
                except queue.Empty:
                    continue
                if isinstance(item, FedMessage):
                    msg = item
                else:
                    sender, payload, peer = item
                    try:
                        msg = self.meter.loads(payload)
                        claimed = int(msg.get_sender_id())
                    except (WireError, AttributeError, TypeError, ValueError) as exc:
                        # nothing was built from the bytes: drop them, say so
                        log.warning(
                            "rank %d dropped a message from %s it could not decode: %s", self.client_rank, peer, exc
                        )
                        continue
                    if claimed != sender:
                        log.warning(
                            "rank %d dropped a message from %s: sealed by rank %d, claims rank %d",
                            self.client_rank,
                            peer,
                            sender,
                            claimed,
                        )
                        continue
                for observer in self._observers:
                    observer.receive_message(msg.get_type(), msg)

        def inject(self, msg) -> None:
            self.grpc_servicer.message_q.put(msg)

        def stop_receive_message(self):
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()
            self.grpc_server.stop(grace=2.0)  # calls in flight (a worker's last status) may complete
            self.is_running = False

    def make_comm(manager) -> None:
        """Install the quiet transport on a FedML comm manager (called from ``_init_manager``)."""
        if manager.backend == "MPI":
            manager.com_manager = QuietMpiComm(manager.comm, manager.rank, manager.size)
        elif manager.backend == "GRPC":
            manager.com_manager = QuietGrpcComm(
                grpc_ipconfig_path=manager.args.grpc_ipconfig_path,
                client_rank=manager.rank,
                client_num=manager.size,
                args=manager.args,
                meter=manager.meter,
                connect_timeout=manager.limits.connect,
            )
        else:
            raise ConfigError(f"comm_args.backend {manager.backend}: only MPI and GRPC are supported")
        manager.com_manager.add_observer(manager)

    def grpc_reachable(comm, rank: int) -> bool:
        """Whether ``rank``'s gRPC port accepts a connection within 2 s (its process is alive)."""
        m = comm.grpc_mappings[rank]
        channel = comm.channel(f"{m.ingress_ip or m.grpc_server_ip}:{m.grpc_server_port}")
        try:
            grpc.channel_ready_future(channel).result(timeout=2.0)
            return True
        except grpc.FutureTimeoutError:
            return False
        finally:
            channel.close()

    def is_finish(payload: Any) -> bool:
        return isinstance(payload, dict) and payload.get("kind") == "finish"

    # ---- server ----------------------------------------------------------------------------
    from .fedml_hooks import SSFLAggregator, SSFLTrainer

    class SSFLSiloAggregator(FedMLAggregator):
        """FedML's round driver, routing silos to workers by the runtime's plan."""

        def __init__(self, server_aggregator: SSFLAggregator, args, workers: int, device):
            super().__init__(None, None, 0, {}, {}, {}, workers, device, args, server_aggregator)
            self.runtime = server_aggregator.runtime

        def data_silo_selection(self, round_idx, client_num_in_total, client_num_per_round):
            return list(self.runtime.routing())

        def aggregate(self):
            # FedML's own version indexes dict results by position 0..n-1, not by silo id.
            model_list = [(self.sample_num_dict[i], self.model_dict[i]) for i in range(self.client_num)]
            payloads = self.aggregator.aggregate(model_list)
            return payloads, model_list, list(range(self.client_num))

        def test_on_server_for_all_clients(self, round_idx):
            pass  # evaluation happens in the runtime, as in the local runtime

    class SSFLServerManager(FedMLServerManager):
        """FedML's cross-silo server manager plus fault handling (errors, deaths, timeouts)."""

        def __init__(self, args, aggregator, runtime: ServerRuntime, meter: WireMeter, limits, comm, size, backend):
            self.runtime, self.meter, self.limits = runtime, meter, limits
            self.failing = False
            self.fail_time = 0.0
            self.dead: set[int] = set()
            self.finished: set[int] = set()
            self.probe_failures: dict[int, int] = {}
            self.refused: dict[int, str] = {}
            security = getattr(args, "ssfl_security", None)
            self.job_key = security.key if security is not None else None
            self.t_start = time.monotonic()
            self._stop = threading.Event()
            super().__init__(args, aggregator, comm, 0, size, backend)

        def _init_manager(self):
            make_comm(self)

        def register_message_receive_handlers(self):
            super().register_message_receive_handlers()
            self.register_message_receive_handler(WATCHDOG, self.handle_watchdog)

        def run(self):
            watchdog = threading.Thread(target=self._watch, name="ssfl-watchdog", daemon=True)
            watchdog.start()
            try:
                super().run()
            finally:
                self._stop.set()

        # -- protocol --
        def process_online_status(self, client_status, msg_params):
            if self.is_initialized or self.failing:
                return  # FedML would send the first round again on a repeated ONLINE
            sender = int(msg_params.get_sender_id())
            problem = self.admission(sender, msg_params)
            if problem:
                if self.refused.get(sender) != problem:
                    log.error("rank %d refused: %s", sender, problem)
                self.refused[sender] = problem
                refusal = FedMessage(MyMessage.MSG_TYPE_S2C_FINISH, 0, sender)
                refusal.add_params(REFUSED, problem)
                with contextlib.suppress(Exception):
                    self.send_message(refusal)
                return
            self.refused.pop(sender, None)
            try:
                super().process_online_status(client_status, msg_params)
            except Exception as exc:
                self.fail(exc)

        def admission(self, rank: int, msg_params) -> str:
            """Why rank ``rank``'s ONLINE handshake is refused ("" if it is admitted)."""
            theirs = msg_params.get(MEMBERSHIP)
            if msg_params.get(PROOF) != proof(self.job_key, self.args.ssfl_job, rank, theirs):
                return "its key proof does not match (another job key)"
            differ = membership_diff(self.args.ssfl_membership, theirs, rank)
            if differ:
                return f"its config differs from the server's in {'; '.join(differ)}: start it with the server's config"
            return ""

        def handle_message_receive_model_from_client(self, msg_params):
            if self.failing:
                return
            payload = msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)
            sender = int(msg_params.get_sender_id())
            if isinstance(payload, dict) and payload.get("kind") == "error":
                self.fail(self.runtime.client_error(payload))
                return
            self.runtime.received(sender)
            try:
                super().handle_message_receive_model_from_client(msg_params)
            except Exception as exc:
                self.fail(exc)

        def process_finished_status(self, client_status, msg_params):
            self.finished.add(int(msg_params.get_sender_id()))
            self._maybe_finish()

        def _maybe_finish(self):
            if set(self.client_real_ids) <= self.finished | self.dead:
                self.finish()

        def finish(self):
            # FedML calls MPI.Finalize here; leaving it to mpi4py at exit lets one process run
            # several jobs in turn (and a failing run still report before MPI goes away).
            if self.backend == "MPI" and self.failing and self.dead:
                # a rank that never answered (stalled: SIGSTOP, a hung update) would hold every
                # process in MPI_Finalize forever; the failed summary is written, so end the job
                self.force_stop()
            self.com_manager.stop_receive_message()

        # -- faults --
        def fail(self, error) -> None:
            if self.failing:
                return
            if isinstance(error, DeliveryError):  # name the silo whose payload could not go out
                silos = self.runtime.routing()
                silo = silos[error.receiver - 1] if 1 <= error.receiver <= len(silos) else "?"
                self.dead.add(error.receiver)
                error = (
                    f"round {self.runtime.round}: rank {error.receiver} (silo {silo}) is unreachable at "
                    f"{error.address} ({error.code}); its process died or lost the network"
                )
            self.failing, self.fail_time = True, time.monotonic()
            failure = self.runtime.fail(error)
            log.error("%s", failure)
            for rank in self.client_real_ids:
                if rank in self.dead:
                    continue
                try:
                    self.send_message(FedMessage(MyMessage.MSG_TYPE_S2C_FINISH, 0, rank))
                except Exception:
                    self.dead.add(rank)
            self._maybe_finish()

        def handle_watchdog(self, msg_params):
            action = msg_params.get("action")
            self.dead |= set(msg_params.get("dead") or ())
            if action == "fail":
                self.fail(msg_params.get("reason"))
                self._maybe_finish()
            elif action == "force":
                self.force_stop()

        def force_stop(self):
            """Workers did not acknowledge the stop in time: end without waiting for them."""
            failure = self.runtime.failure
            if self.backend == "MPI":
                sys.stderr.write(f"fedml-ssfl run: error: {failure}\n")
                sys.stderr.flush()
                from mpi4py import MPI

                MPI.COMM_WORLD.Abort(1)
            self.com_manager.stop_receive_message()

        def _inject(self, **params):
            msg = FedMessage(WATCHDOG, 0, 0)
            for k, v in params.items():
                msg.add_params(k, v)
            self.com_manager.inject(msg)

        def _probe(self, rank: int) -> bool:
            return grpc_reachable(self.com_manager, rank)

        def _watch(self):
            limits, rt = self.limits, self.runtime
            last_probe = time.monotonic()
            forced = reported = False
            while not self._stop.wait(0.5):
                now = time.monotonic()
                if self.failing:
                    if not forced and now - self.fail_time > limits.grace:
                        forced = True
                        self._inject(action="force")
                    continue
                if reported:
                    continue
                if not self.is_initialized:
                    if now - self.t_start > limits.connect:
                        missing = [r for r in self.client_real_ids if not self.client_online_mapping.get(str(r))]
                        refused = "".join(f"; rank {r} was refused: {why}" for r, why in sorted(self.refused.items()))
                        reported = True
                        self._inject(
                            action="fail",
                            reason=f"ranks {missing} did not come online within {limits.connect:.0f} s "
                            f"(FEDML_SSFL_CONNECT_TIMEOUT){refused}",
                            dead=missing,
                        )
                    continue
                waiting = rt.outstanding()
                if waiting and now - rt.round_started > limits.round:
                    reported = True
                    self._inject(
                        action="fail",
                        reason=f"round {rt.round}: no reply within {limits.round:.0f} s (FEDML_SSFL_ROUND_TIMEOUT) "
                        f"from {rt.describe(waiting)}",
                        dead=sorted(waiting),
                    )
                    continue
                if self.backend == "GRPC" and waiting and now - last_probe >= limits.probe:
                    last_probe = now
                    for rank, silo in waiting.items():
                        if self._probe(rank):
                            self.probe_failures[rank] = 0
                            continue
                        self.probe_failures[rank] = self.probe_failures.get(rank, 0) + 1
                        if self.probe_failures[rank] >= 2:
                            m = self.com_manager.grpc_mappings[rank]
                            reported = True
                            self._inject(
                                action="fail",
                                reason=f"round {rt.round}: rank {rank} (silo {silo}) is unreachable at "
                                f"{m.grpc_server_ip}:{m.grpc_server_port}; its process died or lost the network",
                                dead=[rank],
                            )
                            break

        def on_terminate(self, signum, frame):
            """mpirun (or a scheduler) is ending the job: record who the round was waiting for."""
            waiting = self.runtime.outstanding()
            if self.runtime.failure is None:
                who = self.runtime.describe(waiting) if waiting else "no worker"
                self.runtime.fail(
                    f"the job was terminated (signal {signum}) in round {self.runtime.round} while the server "
                    f"waited for {who}; a worker process died (the launcher's message names its rank)"
                )
            sys.stderr.write(f"fedml-ssfl run: error: {self.runtime.failure}\n")
            sys.stderr.flush()
            os._exit(1)

    # ---- client ----------------------------------------------------------------------------
    class SSFLClientManager(ClientMasterManager):
        """FedML's cross-silo client manager; the server's ``finish`` payload ends the run."""

        def __init__(self, args, adapter, meter: WireMeter, limits, comm, rank, size, backend):
            self.meter, self.limits = meter, limits
            self.refusal = None
            self.last_heard = time.monotonic()
            self._stop = threading.Event()
            super().__init__(args, adapter, comm, rank, size, backend)
            self.num_rounds = 2**62  # the server decides when the run ends (resume-safe)

        def _init_manager(self):
            make_comm(self)

        def finish(self):
            self.com_manager.stop_receive_message()  # MPI.Finalize is left to mpi4py at exit

        def receive_message(self, msg_type, msg_params) -> None:
            self.last_heard = time.monotonic()
            super().receive_message(msg_type, msg_params)

        def send_client_status(self, receive_id, status=ClientMasterManager.ONLINE_STATUS_FLAG):
            if status != ClientMasterManager.ONLINE_STATUS_FLAG:
                super().send_client_status(receive_id, status)
                return
            # the handshake: this process's job config, rank and key proof
            message = FedMessage(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self.client_real_id, receive_id)
            message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, status)
            message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_OS, platform.system())
            security = getattr(self.args, "ssfl_security", None)
            key = security.key if security is not None else None
            mine = self.args.ssfl_membership
            message.add_params(MEMBERSHIP, mine)
            message.add_params(PROOF, proof(key, self.args.ssfl_job, self.rank, mine))
            self.send_message(message)

        def handle_message_finish(self, msg_params):
            self.refusal = msg_params.get(REFUSED)
            if self.refusal:  # not a member of this job: stop without reporting FINISHED
                self.finish()
                return
            super().handle_message_finish(msg_params)

        def handle_message_init(self, msg_params):
            if is_finish(msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)):
                self.cleanup()
                return
            super().handle_message_init(msg_params)

        def handle_message_receive_model_from_server(self, msg_params):
            if is_finish(msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)):
                self.cleanup()
                return
            super().handle_message_receive_model_from_server(msg_params)

        def run(self):
            if self.backend == "GRPC":
                threading.Thread(target=self._watch, name="ssfl-server-watchdog", daemon=True).start()
            try:
                super().run()
            finally:
                self._stop.set()

        def _watch(self):
            """GRPC only (under mpirun the launcher ends the job when the server dies): stop when the
            server's port stops answering, or after FEDML_SSFL_IDLE_TIMEOUT of silence."""
            failures, last_probe = 0, time.monotonic()
            while not self._stop.wait(1.0):
                now = time.monotonic()
                idle = now - self.last_heard
                reason = None
                if idle > self.limits.idle:
                    reason = f"heard nothing from the server (rank 0) for {idle:.0f} s (FEDML_SSFL_IDLE_TIMEOUT)"
                elif self.is_inited and idle > self.limits.probe and now - last_probe >= self.limits.probe:
                    last_probe = now
                    failures = 0 if grpc_reachable(self.com_manager, 0) else failures + 1
                    if failures >= 2:
                        m = self.com_manager.grpc_mappings[0]
                        reason = f"the server (rank 0) at {m.grpc_server_ip}:{m.grpc_server_port} is unreachable"
                if reason:
                    sys.stderr.write(f"fedml-ssfl run: error: rank {self.rank}: {reason}; stopping\n")
                    sys.stderr.flush()
                    os._exit(1)

    return SimpleNamespace(
        ServerAggregator=SSFLAggregator,
        SiloAggregator=SSFLSiloAggregator,
        ServerManager=SSFLServerManager,
        ClientTrainer=SSFLTrainer,
        ClientManager=SSFLClientManager,
        GrpcComm=QuietGrpcComm,
    )


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


def run_fedml(
    cfg: ExperimentConfig,
    rank: int | None = None,
    role: str | None = None,
    run_dir: str | Path | None = None,
    resume: bool = False,
    dataset: ImageDataset | None = None,
    stop_after: int | None = None,
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
        check_port_free(rank, *table[rank])
    is_server = rank == 0
    state = None
    if is_server:
        base = Path(run_dir) if run_dir is not None else cfg.run_dir()
        run_dir = base if resume else fresh_run_dir(base)
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
        args.ssfl_membership, args.ssfl_job = membership(cfg), cfg.common_args.run_id
        with contextlib.redirect_stdout(io.StringIO()):
            args = fedml.init(args, check_env=False, should_init_logs=False)
        if backend == "MPI":
            from mpi4py import MPI

            mpi_pickle = MPI.pickle
            MPI.pickle.__init__(meter.dumps, meter.loads)
        classes = _fedml_classes()
        workers = worker_count(cfg)
        try:
            if not is_server:
                worker = (
                    SiloWorker(dev_cfg, rank)
                    if deployed(cfg)
                    else ClientWorker(build_experiment(dev_cfg, dataset), rank)
                )
                _run_worker(classes, worker, args, rank, meter, limits, comm, workers, backend)
                return None
            exp = build_experiment(dev_cfg, dataset)
            if deployed(cfg):
                check_server_counts(cfg, exp)
            exp.algorithm.setup()
            runtime_class = DeployedServerRuntime if deployed(cfg) else ServerRuntime
            runtime = runtime_class(cfg, exp, Path(run_dir), state, workers, stop_after, backend)
            server_agg = classes.ServerAggregator(exp.algorithm.global_model(), args, runtime, meter)
            silo_agg = classes.SiloAggregator(server_agg, args, workers, exp.device)
            manager = classes.ServerManager(args, silo_agg, runtime, meter, limits, comm, workers, backend)
            previous = _install_terminate_handler(manager.on_terminate)
            try:
                if runtime.done:
                    log.info("nothing to run: %s already completed round %d", run_dir, runtime.round - 1)
                manager.run()
            finally:
                _restore_terminate_handler(previous)
            if runtime.failure is not None:
                raise runtime.failure
            if not runtime.done:
                raise runtime.fail(f"the FedML server stopped in round {runtime.round} before the run ended")
            return runtime.result()
        finally:
            if mpi_pickle is not None:
                with contextlib.suppress(Exception):
                    mpi_pickle.__init__()
            if guarded:
                offline.uninstall()


def _run_worker(classes, worker, args, rank: int, meter, limits, comm, workers: int, backend: str) -> None:
    """A worker process: FedML's client manager around ``worker`` (a :class:`ClientWorker` or :class:`SiloWorker`).

    FedML wants a data dict entry for every silo index the server may name; the trainer ignores them
    (the payload names the silo). A deployed silo's model is built when the server's metadata arrives.
    """
    from fedml.cross_silo.client.fedml_trainer_dist_adapter import TrainerDistAdapter

    if isinstance(worker, SiloWorker):
        silos, counts, model, device = {worker.silo: worker.silo}, {worker.silo: 0}, torch.nn.Identity(), "cpu"
    else:
        exp = worker.exp
        K = exp.config.train_args.client_num_in_total
        silos = {k: k for k in range(K)}
        counts = {k: int(exp.split.client_unlabeled[k].numel()) for k in range(K)}
        model, device = exp.algorithm.model_fn(), exp.device
    trainer = classes.ClientTrainer(model, args, worker)
    adapter = TrainerDistAdapter(args, device, rank, model, sum(counts.values()), counts, silos, silos, trainer)
    manager = classes.ClientManager(args, adapter, meter, limits, comm, rank, workers, backend)
    try:
        manager.run()
    except DeliveryError as exc:  # the server is gone, or refused this process's messages
        raise RunFailed(str(exc)) from None
    if manager.refusal:
        raise ConfigError(f"rank {rank}: the server refused this process: {manager.refusal}")


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


def _install_terminate_handler(handler):
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def _restore_terminate_handler(previous) -> None:
    if previous is not None:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, previous)


__all__ = [
    "ClientWorker",
    "DeployedServerRuntime",
    "ServerRuntime",
    "SiloWorker",
    "WireArray",
    "assign_silos",
    "check_reply",
    "decode",
    "encode",
    "gpu_for_rank",
    "read_ipconfig",
    "run_fedml",
    "timeouts",
    "world_size",
]
