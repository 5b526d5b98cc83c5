"""The worker half of a FedML job (no FedML in here): train the silo each payload names, keep per-silo state."""

from __future__ import annotations

import logging
import re
import tempfile
import traceback
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from ... import seeding
from ...algorithms.base import ClientContext
from ...atomic import make_folder
from ...checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ...client_state import ClientStateStore
from ...config import ExperimentConfig
from ...experiment import Experiment
from ..common import spill_folder
from ..folder_lock import FolderLock, lock_folder
from .protocol import Failure, Intro, Reply, Task

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
        """Run one round's client updates (the task's silo, then those of ``task.more``); return the reply
        (its ``more``: the others', in order), or a :class:`Failure` naming the silo, never raising."""
        r, k = task.round, task.silo
        try:
            for j in task.drop:
                self.cache.pop(j, None)
            replies = []
            for one in (task, *task.more):
                k = one.silo
                replies.append(Reply(r, k, self.rank, msg=self._train(one)))
            k = task.silo
            missing = [j for j in task.upload if j not in self.cache]
            if missing:
                raise RuntimeError(
                    f"asked to upload the state of silos {missing}, which rank {self.rank} does not hold"
                )
            head = replies[0]
            head.states = {j: self.cache[j] for j in task.upload}
            head.more = replies[1:]
            return head
        except Exception as exc:  # reported to the server, which stops the run with this message
            return _failure(r, k, self.rank, exc)

    def _train(self, task: Task) -> Any:
        """One silo's client update on its cached (or sent) state; the cache then holds the new state."""
        r, k = task.round, task.silo
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
        return reply


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
"""The one state file of a silo folder written before states were kept per round (read on resume)."""

_ROUND_FILE = re.compile(r"silo_state-(\d+)\.pt")


def silo_dir(cfg: ExperimentConfig, run_name: str, silo: int) -> Path:
    """Where silo ``silo`` keeps its client state: ``output_dir/<the server's run folder name>/silo_<k>``."""
    return Path(cfg.common_args.output_dir).expanduser() / run_name / f"silo_{silo}"


def silo_state_path(folder: Path, r: int) -> Path:
    """The file of the state a silo saved after round ``r`` (0-based) in ``folder``: ``silo_state-<r + 1>.pt``."""
    return Path(folder) / f"silo_state-{r + 1}.pt"


def saved_rounds(folder: Path) -> dict[int, Path]:
    """The states saved in ``folder``: ``{round (0-based): file}``."""
    found = {}
    if Path(folder).is_dir():
        for p in Path(folder).iterdir():
            m = _ROUND_FILE.fullmatch(p.name)
            if m and int(m.group(1)) >= 1:
                found[int(m.group(1)) - 1] = p
    return found


class SiloWorker:
    """A deployed silo (rank k + 1): trains its own data, keeps its own client state, saves it itself.

    A task that carries an :class:`~.protocol.Intro` (the first one, and any later one: a server
    restarted with ``--resume``, a silo process restarted) gives the server's metadata, the run
    folder's name and the last round the server has committed; the silo then (re)builds what it
    needs (it reads its file, ``data_args.local_data``, checks it against the metadata and builds its
    algorithm; again only when they changed), locks its folder ``silo_dir(...)`` for the process's
    life, and sets its client state to the one it saved after that round (an empty state for -1, a
    fresh run), refusing in one line naming the file and the fix when that state is not on disk.
    States saved after later rounds are removed: the server never committed them.

    Its client state never leaves the process. At checkpoint rounds (every task says whether the
    round is one) it is written atomically to ``silo_dir(...)/checkpoints/silo_state-<round>.pt``
    (round from 1) before the reply goes out. That is the first phase of a two-phase checkpoint;
    the server's ``last.pt`` for the round, written once every silo has replied, is the second.
    The server builds round r's tasks only after it has committed every checkpoint round before r,
    so when the silo saves round r, the newest state it saved before r belongs to the round the
    server committed last: the silo keeps that one and the new one and removes older ones. Whatever
    point of whatever round a run fails at, the state matching the server's ``last.pt`` is on disk.

    A task for the round the silo answered last, delivered again without an ``Intro`` (a send that
    was retried after it had arrived), gets the same answer again: the state is not trained twice.

    ``source``, when given, stands in for the file: called with the metadata, it returns the silo's
    data and model factory (a FedML script's list and module: :mod:`.hooks`).
    """

    def __init__(self, cfg: ExperimentConfig, rank: int, source: Any = None):
        self.cfg, self.rank, self.silo = cfg, rank, rank - 1
        self.source = source
        self.exp: Any = None
        self.meta: Any = None
        self.run_name: str | None = None
        self.state: dict[str, Any] = {}
        self.folder: Path | None = None  # silo_dir(...)/checkpoints
        self.lock: FolderLock | None = None
        self.answered: tuple[int, Reply] | None = None  # the last round answered, and the answer

    def introduce(self, intro: Intro) -> None:
        """Take the server's :class:`~.protocol.Intro`: build for its metadata and run folder, and set the client
        state to the one saved after round ``intro.resumed_after`` (empty for -1).

        Raises
        ------
        CheckpointError
            No state of that round is on disk, or the file is damaged or from another config (names the file
            and the fix).
        FolderInUse
            Another process holds this silo's folder.
        """
        from ...experiment import build_silo_experiment

        if self.exp is None or intro.meta != self.meta:
            data, factory = self.source(intro.meta) if self.source is not None else (None, None)
            self.exp = build_silo_experiment(self.cfg, intro.meta, self.rank, data, factory)
            self.meta = intro.meta
        if intro.run_name != self.run_name:
            home = make_folder(silo_dir(self.cfg, intro.run_name, self.silo))
            lock = lock_folder(home, f"silo {self.silo}'s folder")
            if self.lock is not None:
                self.lock.release()
            self.lock, self.run_name, self.folder = lock, intro.run_name, home / "checkpoints"
        self.state = self._load(intro.resumed_after)
        for r, path in saved_rounds(self.folder).items():
            if r > intro.resumed_after:  # saved in a round the server never committed
                path.unlink(missing_ok=True)

    def _load(self, after: int) -> dict[str, Any]:
        """The state saved after round ``after`` (a new empty state for -1)."""
        if after < 0:
            return {}
        path = silo_state_path(self.folder, after)
        legacy = self.folder / SILO_STATE_NAME
        if not path.is_file() and legacy.is_file():
            path = legacy  # written by a version that kept one file: checked for its round below
        if not path.is_file():
            have = ", ".join(str(r + 1) for r in sorted(saved_rounds(self.folder))) or "none"
            raise CheckpointError(
                f"silo {self.silo}: no state saved after round {after + 1} at {path} (rounds saved here: {have}), but "
                f"the server resumes after round {after + 1}: restore this silo's folder {self.folder.parent} from a "
                "copy that has it, or start a new run (without --resume)"
            )
        saved = load_checkpoint(path, self.cfg.fingerprint(), self.cfg.to_dict())
        if saved.get("round") != after or saved.get("silo") != self.silo:
            theirs = saved.get("round")
            theirs = theirs + 1 if isinstance(theirs, int) else theirs
            raise CheckpointError(
                f"{path} holds silo {saved.get('silo')}'s state after round {theirs}, but the server resumes after "
                f"round {after + 1}: restore this silo's folder {self.folder.parent} from that round"
            )
        return saved["state"]

    def save(self, r: int) -> Path:
        """Write the state after round ``r`` (atomically), then remove states older than the last one the server
        committed (the newest saved before ``r``): two stay."""
        path = save_checkpoint(
            silo_state_path(self.folder, r),
            {
                "round": r,
                "silo": self.silo,
                "fingerprint": self.cfg.fingerprint(),
                "config": self.cfg.to_dict(),  # a refused resume names the keys that differ
                "state": self.state,
            },
        )
        older = sorted(q for q in saved_rounds(self.folder) if q < r)
        for q in older[:-1]:  # older[-1]: the round the server committed last, until it commits r
            silo_state_path(self.folder, q).unlink(missing_ok=True)
        (self.folder / SILO_STATE_NAME).unlink(missing_ok=True)  # the one-file layout's state is older still
        return path

    def handle(self, task: Task) -> Reply | Failure:
        """One round (train, or stay idle when not sampled); never raises (errors go to the server)."""
        r = task.round
        try:
            if task.intro is not None:
                self.introduce(task.intro)
                self.answered = None
            elif self.exp is None:
                raise RuntimeError("the server's first message carries no metadata; restart the job")
            elif self.answered is not None and self.answered[0] == r:
                log.info(
                    "silo %d: round %d's task arrived again; answering it again without training", self.silo, r + 1
                )
                return self.answered[1]  # a second delivery (a retried send) must not train the state twice
            if task.silo != self.silo:
                raise RuntimeError(f"rank {self.rank} serves silo {self.silo}, but was sent silo {task.silo}")
            reply = Reply(r, self.silo, self.rank, trained=task.train)
            if task.train:
                reply.msg = _client_update(self.exp, task.msg, self.silo, r, self.state)
            elif task.msg is not None:  # not sampled, but the algorithm broadcasts to every client
                _client_receive(self.exp, task.msg, self.silo, r, self.state)
            if task.checkpoint:
                self.save(r)
            self.answered = (r, reply)
            return reply
        except Exception as exc:  # reported to the server, which stops the run naming this silo
            return _failure(r, self.silo, self.rank, exc)
