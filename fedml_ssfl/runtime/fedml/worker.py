"""The worker half of a FedML job (no FedML in here): train the silo each payload names, keep per-silo state."""

from __future__ import annotations

import logging
import tempfile
import traceback
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from ... import seeding
from ...algorithms.base import ClientContext
from ...checkpoint import load_checkpoint, save_checkpoint
from ...client_state import ClientStateStore
from ...config import ExperimentConfig
from ...experiment import Experiment
from ..common import spill_folder
from .protocol import Failure, Reply, Task

log = logging.getLogger(__name__)


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
        # silo -> (round of last update, state): every silo this worker has served
        self.cache: MutableMapping[int, tuple[int, dict]] = worker_state_cache(exp.config, rank)

    def handle(self, task: Task) -> Reply | Failure:
        """Run one round's client update; return the reply (or a :class:`Failure`, never raising)."""
        r, k = task.round, task.silo
        try:
            for j in task.drop:
                self.cache.pop(j, None)
            if task.state is not None:
                self.cache[k] = (task.state_tag, task.state)
            tag, state = self.cache.get(k, (None, None))
            if state is None or tag != task.state_tag:
                raise RuntimeError(
                    f"silo {k}'s client state from round {task.state_tag + 1} is not on rank {self.rank} "
                    f"(it has {tag}); the routing and the state cache disagree"
                )
            reply = _client_update(self.exp, task.msg, k, r, state)
            self.cache[k] = (r, state)
            missing = [j for j in task.upload if j not in self.cache]
            if missing:
                raise RuntimeError(
                    f"asked to upload the state of silos {missing}, which rank {self.rank} does not hold"
                )
            return Reply(r, k, self.rank, msg=reply, states={j: self.cache[j] for j in task.upload})
        except Exception as exc:  # reported to the server, which stops the run with this message
            return _failure(r, k, self.rank, exc)


WORKER_SPILL_PREFIX = ".worker_states-"
"""The name prefix of a pooled worker's spill folder."""


def worker_state_cache(cfg: ExperimentConfig, rank: int) -> MutableMapping[int, tuple[int, dict]]:
    """A pooled worker's cache of the states of the silos it has served: a dict, or under
    ``device_args.state_memory_mb`` a store that keeps that many MiB resident and spills the rest.

    The whole budget is the worker's (a worker process keeps no other per-client state). The spill
    folder is made in ``device_args.state_spill_dir``, else in the system's temporary folder (a worker
    may run on a host without the server's run folder), and removed when the worker exits. Results do
    not change: a spilled state comes back bit for bit.

    Raises
    ------
    ConfigError
        The spill folder cannot be made (names ``device_args.state_spill_dir`` and the fix).
    """
    d = cfg.device_args
    if d.state_memory_mb <= 0:
        return {}
    root = Path(d.state_spill_dir).expanduser() if d.state_spill_dir else Path(tempfile.gettempdir())
    folder = spill_folder(root, f"{WORKER_SPILL_PREFIX}rank{rank}-")
    return ClientStateStore(int(d.state_memory_mb * 2**20), folder)


def _client_update(exp: Experiment, msg: Any, silo: int, r: int, state: dict[str, Any]) -> Any:
    """The algorithm's client update for ``silo`` in round ``r`` (``run_client_update``: the idle-client
    control applies), under the (seed, client, r, silo) stream."""
    ctx = ClientContext(round_idx=r, device=exp.device, seed=exp.config.common_args.random_seed)
    with seeding.global_stream(ctx.seed, "client", r, silo, device=exp.device):
        return exp.algorithm.run_client_update(msg, exp.client_data(silo, r), state, ctx)


def _client_receive(exp: Any, msg: Any, silo: int, r: int, state: dict[str, Any]) -> None:
    """A silo not sampled in round ``r`` receives the round's message (``run_client_receive``), under the
    same (seed, client, r, silo) stream as the local simulator's delivery."""
    ctx = ClientContext(round_idx=r, device=exp.device, seed=exp.config.common_args.random_seed)
    with seeding.global_stream(ctx.seed, "client", r, silo, device=exp.device):
        exp.algorithm.run_client_receive(msg, exp.client_data(silo, r), state, ctx)


def _failure(r: int, silo: int, rank: int, exc: Exception) -> Failure:
    return Failure(r, silo, rank, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())


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

    def _start(self, task: Task) -> None:
        from ...experiment import build_silo_experiment

        intro = task.intro
        if intro is None:
            raise RuntimeError("the server's first message carries no metadata; restart the job")
        self.exp = build_silo_experiment(self.cfg, intro.meta, self.rank)
        self.state_path = silo_dir(self.cfg, intro.run_name, self.silo) / "checkpoints" / SILO_STATE_NAME
        after = intro.resumed_after
        if after >= 0:
            saved = load_checkpoint(self.state_path, self.cfg.fingerprint())
            if saved.get("round") != after or saved.get("silo") != self.silo:
                theirs = saved.get("round")
                theirs = theirs + 1 if isinstance(theirs, int) else theirs
                raise RuntimeError(
                    f"{self.state_path} holds silo {saved.get('silo')}'s state after round {theirs}, but "
                    f"the server resumes after round {after + 1}: restore this silo's checkpoint folder from that round"
                )
            self.state = saved["state"]

    def handle(self, task: Task) -> Reply | Failure:
        """One round (train, or stay idle when not sampled); never raises (errors go to the server)."""
        r = task.round
        try:
            if self.exp is None:
                self._start(task)
            if task.silo != self.silo:
                raise RuntimeError(f"rank {self.rank} serves silo {self.silo}, but was sent silo {task.silo}")
            reply = Reply(r, self.silo, self.rank, trained=task.train)
            if task.train:
                reply.msg = _client_update(self.exp, task.msg, self.silo, r, self.state)
            elif task.msg is not None:  # not sampled, but the algorithm broadcasts to every client
                _client_receive(self.exp, task.msg, self.silo, r, self.state)
            if task.checkpoint:
                save_checkpoint(
                    self.state_path,
                    {"round": r, "silo": self.silo, "fingerprint": self.cfg.fingerprint(), "state": self.state},
                )
            return reply
        except Exception as exc:  # reported to the server, which stops the run naming this silo
            return _failure(r, self.silo, self.rank, exc)
