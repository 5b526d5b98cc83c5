"""What both runtimes share: a round's server halves, evaluation, logging, checkpoints, summary.

The local simulator (:mod:`.local`) and the FedML runtime (:mod:`.fedml`) drive a round
the same way:

1. :func:`start_round` -- the round's participation is planned (the seeded sampler's C_k clients,
   or the simulator's availability model or replay: :mod:`..participation`), the server takes its
   own step, and one message per client that answers is built (bytes counted by ``message_nbytes``);
2. the clients update (in this process, or in FedML worker processes);
3. :func:`finish_round` -- the algorithm aggregates the replies the round keeps, in the
   participation's order, and the round's metrics row is built;
4. :meth:`RunRecorder.record` -- ``finalize`` after the last round, evaluation, metrics.jsonl /
   TensorBoard, participation.jsonl, and an atomic checkpoint.

Keeping these pieces in one place is what makes the two runtimes end with the same model and
the same outputs for the same config.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .. import seeding
from ..algorithms.base import Algorithm, ClientContext, Message, message_nbytes
from ..algorithms.registry import get_algorithm
from ..atomic import atomic_write, folder_error, make_folder, naming
from ..checkpoint import CheckpointError, save_checkpoint
from ..client_state import (
    FILES_KEY,
    RECORD_FILES_KEY,
    STATES_DIR,
    ClientStateError,
    ClientStateStore,
    client_state_payload,
    open_client_states,
    prune_state_files,
)
from ..config import ConfigError, ExperimentConfig, save_config
from ..experiment import Experiment, deployed
from ..metrics import evaluate
from ..participation import FILE_NAME as PARTICIPATION_FILE
from ..participation import Participation, Planner, plan_round
from ..report import format_duration
from ..tracking import RunTracker, run_description, write_summary
from ..trained import CARD_KEY, label, model_card
from ..training import cosine_lr
from .folder_lock import LOCK_NAME, FolderLock, lock_folder

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "last.pt"


@dataclass
class RunResult:
    """What a finished (or stopped) run reports."""

    run_dir: Path
    algorithm: str
    final_acc: float
    best_acc: float
    rounds_completed: int
    summary: dict[str, Any] = field(default_factory=dict)


class RunFailed(RuntimeError):
    """A run stopped on an error; the message says where, and what was kept."""


CLAIM_NAME = ".claimed"
"""The file whose exclusive creation makes a run folder this run's (see :func:`fresh_run_dir`)."""


def fresh_run_dir(base: Path) -> Path:
    """Claim ``base`` if free, else ``base-2``, ``base-3``, ...: a new run never shares a folder.

    A folder is claimed by creating ``.claimed`` in it exclusively (``O_CREAT | O_EXCL``), so two
    runs started at once with one name get two folders; a folder holding anything else (an older
    run) is never claimed. The folder exists when this returns.

    Raises
    ------
    ConfigError
        No folder can be made there: ``common_args.output_dir`` (or a parent) is a file, or is not
        writable; the message names the path and the fix.
    """
    try:
        make_folder(base.parent)
    except OSError as exc:
        raise _output_dir_error(base, exc) from None
    n = 1
    while True:
        candidate = base if n == 1 else base.parent / f"{base.name}-{n}"
        n += 1
        try:
            candidate.mkdir(exist_ok=True)
            if any(p.name != CLAIM_NAME for p in candidate.iterdir()):
                continue  # an older run's folder
            os.close(os.open(candidate / CLAIM_NAME, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            continue  # another run claimed it first (or a file has the name)
        except OSError as exc:
            raise _output_dir_error(candidate, folder_error(candidate, exc)) from None
        return candidate


def discard_unwritten(run_dir: Path | None) -> bool:
    """Remove ``run_dir``, a folder this run claimed, if the run wrote nothing into it yet.

    A run that stops before its first output (the data cannot be loaded, the model cannot be built, the
    device is missing, the algorithm's setup raises) leaves no folder behind, so failed attempts do not
    leave ``-2``, ``-3`` ... folders. Only a folder holding nothing but the claim file (and the lock
    file, :func:`hold_run_folder`) is removed.

    Returns
    -------
    bool
        Whether the folder was removed.
    """
    if run_dir is None:
        return False
    try:
        names = {p.name for p in run_dir.iterdir()}
        if CLAIM_NAME not in names or not names <= {CLAIM_NAME, LOCK_NAME}:
            return False
        for name in names:
            (run_dir / name).unlink()
        run_dir.rmdir()
    except OSError:
        return False
    return True


def hold_run_folder(run_dir: Path, resume: bool = False) -> FolderLock | None:
    """Lock the run folder for this process until the lock is released or the process ends.

    Every runtime takes it before it reads a checkpoint or writes anything in the folder
    (:mod:`.folder_lock`), so a second run or resume of the same folder is refused at once. A
    resumed folder that does not exist is not made (None: loading its checkpoint says what is wrong).

    Raises
    ------
    FolderInUse
        Another process holds the folder (names it, the holder and the fix).
    """
    if resume and not Path(run_dir).is_dir():
        return None
    return lock_folder(run_dir, "the run folder")


@contextlib.contextmanager
def run_folder(base: Path, resume: bool) -> Iterator[Path]:
    """The run's folder for the ``with`` block: ``base`` when resuming, else a new one (:func:`fresh_run_dir`),
    locked for the block (:func:`hold_run_folder`).

    A new folder is removed again when the block raises before anything was written into it
    (:func:`discard_unwritten`); a resumed run's folder is never touched.
    """
    run_dir = base if resume else fresh_run_dir(base)
    lock = None
    try:
        lock = hold_run_folder(run_dir, resume)
        yield run_dir
    except BaseException:
        if not resume:
            discard_unwritten(run_dir)
        raise
    finally:
        if lock is not None:
            lock.release()


def _output_dir_error(run_dir: Path, exc: OSError) -> ConfigError:
    """The one-line refusal of a run folder that cannot be made (``exc`` from :func:`.atomic.folder_error`)."""
    return ConfigError(
        f"common_args.output_dir: cannot create the run folder {run_dir}: {exc}; "
        "or set common_args.output_dir to another folder"
    )


def model_label(cfg: ExperimentConfig, model: Any = None) -> str:
    """The model as outputs name it: ``<model>-<norm>`` for a registered model; ``<Class>-<norm layers it holds>``
    for a script's own (``MyNet-bn``; :func:`..trained.label`), read from ``model`` when given."""
    from ..models.script import norm_kind

    held = norm_kind(model) if model is not None else cfg.model_args.norm
    return label(cfg.model_args.model, cfg.model_args.norm, held)


def mean_client_metrics(replies: dict[int, Message]) -> dict[str, float]:
    """Average the clients' diagnostic metrics (``extras["metrics"]``) key by key."""
    sums: dict[str, list[float]] = {}
    for msg in replies.values():
        for k, v in msg.extras.get("metrics", {}).items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                sums.setdefault(k, []).append(float(v))
    return {f"client_{k}": sum(v) / len(v) for k, v in sums.items()}


SPILL_PREFIX = ".client_states-"
"""The name prefix of a run's spill folder (in the run folder, or in ``device_args.state_spill_dir``)."""

RECORDS_PREFIX = ".server_records-"
"""The name prefix of the spill folders of the algorithm's server records (one per record map)."""


def state_budget(cfg: ExperimentConfig) -> int | None:
    """Bytes each per-client store of a run may keep resident (None: no budget, everything in memory).

    ``device_args.state_memory_mb`` bounds all the per-client state a run's server process keeps: it is
    split evenly between the client states and each of the algorithm's server record maps
    (:attr:`~..algorithms.base.Algorithm.client_records`; FedMatch: ``views`` and ``client_psi``, so a
    third each), so the resident total stays within the one budget.
    """
    mb = cfg.device_args.state_memory_mb
    if mb <= 0:
        return None
    stores = 1 + len(get_algorithm(cfg.algorithm).client_records)
    return int(mb * 2**20) // stores


def _spill_root(cfg: ExperimentConfig, run_dir: Path, prefix: str) -> Path:
    """The folder a run's spill folders named ``prefix...`` go in, made; in the run folder, stale ones removed.

    Raises
    ------
    ConfigError
        The folder cannot be made (names ``device_args.state_spill_dir`` and the fix).
    """
    d = cfg.device_args
    root = Path(d.state_spill_dir).expanduser() if d.state_spill_dir else Path(run_dir)
    try:
        if not d.state_spill_dir:  # left by a killed run (a shared state_spill_dir is never swept)
            for stale in Path(run_dir).glob(prefix + "*"):
                shutil.rmtree(stale, ignore_errors=True)
        make_folder(root)
    except OSError as exc:
        raise _spill_error(root, exc) from None
    return root


def spill_folder(root: Path, prefix: str) -> Path:
    """A new empty spill folder of this process's own, named ``prefix...``, in ``root`` (made if needed).

    Raises
    ------
    ConfigError
        It cannot be made (names ``device_args.state_spill_dir`` and the fix).
    """
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=make_folder(root)))
    except OSError as exc:
        raise _spill_error(root, exc) from None


def _spill_error(root: Path, exc: OSError) -> ConfigError:
    return ConfigError(
        f"device_args.state_spill_dir: cannot make a spill folder in {root}: {exc}; "
        "set it to a writable folder, or device_args.state_memory_mb to 0 to keep every state in memory"
    )


def run_client_states(
    cfg: ExperimentConfig, run_dir: Path, resume_state: dict[str, Any] | None
) -> MutableMapping[int, dict]:
    """Every client's persistent state for a run: a dict, or under ``device_args.state_memory_mb`` a store.

    With a budget (its share: :func:`state_budget`), states beyond it spill into a folder of this
    run's own made in ``device_args.state_spill_dir`` (default: the run folder, where spill folders a
    killed run left are removed first); :func:`..client_state.close_client_states` removes it at the end.

    Raises
    ------
    CheckpointError
        A state file the resumed checkpoint names is missing or damaged (names the file).
    ConfigError
        The spill folder cannot be made (names ``device_args.state_spill_dir`` and the fix).
    """
    budget = state_budget(cfg)
    spill = None
    if budget is not None:
        root = _spill_root(cfg, run_dir, SPILL_PREFIX)
        spill = spill_folder(root, f"{SPILL_PREFIX}{Path(run_dir).name}-")
    try:
        return open_client_states(
            range(cfg.train_args.client_num_in_total),
            budget,
            spill,
            resume_state,
            Path(run_dir) / "checkpoints" / STATES_DIR,
        )
    except ClientStateError as exc:
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
        raise CheckpointError(str(exc)) from None


def bind_server_records(
    cfg: ExperimentConfig, algo: Algorithm, run_dir: Path, resume_state: dict[str, Any] | None
) -> dict[str, ClientStateStore]:
    """Put the algorithm's per-client server records (``client_records``) under the state budget.

    Call after ``setup`` / ``load_state_dict``. With a budget each record map becomes a
    :class:`..client_state.ClientStateStore` of its own (its share: :func:`state_budget`) spilling into
    a folder ``.server_records-<run>-<name>-*`` made like the client states' one; a resumed
    checkpoint's spilled records (:data:`..client_state.RECORD_FILES_KEY`) are taken by file. Without
    a budget nothing changes, except that records a budgeted checkpoint spilled are read back into
    the algorithm's dicts.

    Returns
    -------
    dict
        The stores made, by attribute name (empty without a budget): :func:`server_records_payload`
        checkpoints them, :meth:`ClientStateStore.close` removes their spill folders.

    Raises
    ------
    CheckpointError
        A record file the resumed checkpoint names is missing or damaged (names the file).
    ConfigError
        A spill folder cannot be made.
    """
    budget = state_budget(cfg)
    saved = (resume_state or {}).get(RECORD_FILES_KEY, {})
    if not algo.client_records or (budget is None and not saved):
        return {}
    states_dir = Path(run_dir) / "checkpoints" / STATES_DIR
    root = _spill_root(cfg, run_dir, RECORDS_PREFIX) if budget is not None else None
    stores: dict[str, ClientStateStore] = {}
    spill = None
    try:
        for name in algo.client_records:
            if root is not None:
                spill = spill_folder(root, f"{RECORDS_PREFIX}{Path(run_dir).name}-{name}-")
            held = {"client_states": getattr(algo, name), FILES_KEY: saved.get(name, {})}
            records = open_client_states((), budget, spill, held, states_dir)
            spill = None
            if isinstance(records, ClientStateStore):
                stores[name] = records
            setattr(algo, name, records)
    except BaseException as exc:
        for store in stores.values():
            store.close()
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
        if isinstance(exc, ClientStateError):
            raise CheckpointError(str(exc)) from None
        raise
    return stores


def server_records_payload(
    algo_state: dict[str, Any], stores: dict[str, ClientStateStore], states_dir: Path
) -> dict[str, Any]:
    """The checkpoint's part of the bound server records: resident ones inline, spilled ones by file.

    Each store in ``algo_state`` (``state_dict`` writes a bound store as itself) is replaced by its
    resident records, ``{client id: record}``; the spilled ones' files are placed in ``states_dir``
    (fsynced) and listed under :data:`..client_state.RECORD_FILES_KEY`, returned for the checkpoint's
    top level (an empty dict when nothing spilled).
    """
    files: dict[str, dict[int, str]] = {}
    for name, store in stores.items():
        inline, digests = store.checkpoint_entries(states_dir)
        algo_state[name] = inline
        if digests:
            files[name] = digests
    return {RECORD_FILES_KEY: files} if files else {}


# ---------------------------------------------------------------------------------------------
# one round, server side


@dataclass
class RoundStart:
    """The server's first half of a round: who takes part and what each is sent.

    ``chosen``: the clients that train this round (sorted; the participation's ``answered``).
    ``listeners``: for an algorithm that :meth:`~..algorithms.base.Algorithm.broadcasts_to_all`, the
    message each reachable client *not* asked receives this round (empty otherwise); counted in
    ``bytes_down`` like the chosen clients' messages. ``participation``: the round's record
    (:class:`~..participation.Participation`); a skipped round has no messages and no server step.
    """

    round_idx: int
    chosen: list[int]
    messages: dict[int, Message]
    bytes_down: int
    t0: float
    listeners: dict[int, Message] = field(default_factory=dict)
    participation: Participation | None = None


def start_round(exp: Experiment, r: int, planner: Planner | None = None) -> RoundStart:
    """Plan the round's participation, run the server step, build one message per client that trains
    (and, when the algorithm broadcasts to all, one per reachable client not asked).

    ``planner``: where the participation comes from (the simulator's availability model or replay,
    :class:`~..participation.Planner`); default: the seeded sampler's C_k clients, all answering. A
    round the plan skips runs no server step and sends nothing.
    """
    cfg, algo = exp.config, exp.algorithm
    t0 = time.perf_counter()
    broadcast = algo.broadcasts_to_all()
    if planner is None:
        plan = plan_round(
            cfg.common_args.random_seed,
            r,
            cfg.train_args.client_num_in_total,
            cfg.train_args.client_num_per_round,
            broadcast=broadcast,
        )
    else:
        plan = planner.plan(r, broadcast)
    chosen = sorted(plan.answered)
    if plan.skipped:
        return RoundStart(round_idx=r, chosen=[], messages={}, bytes_down=0, t0=t0, participation=plan)
    with seeding.global_stream(cfg.common_args.random_seed, "server", r, device=exp.device):
        algo.server_step(r)
        messages = {k: algo.message_for(k, r) for k in chosen}
        listeners = {k: algo.message_for(k, r) for k in sorted(plan.listeners)} if broadcast else {}
    down = sum(message_nbytes(m) for m in (*messages.values(), *listeners.values()))
    return RoundStart(
        round_idx=r, chosen=chosen, messages=messages, bytes_down=down, t0=t0, listeners=listeners, participation=plan
    )


def deliver_to_listeners(
    exp: Experiment, start: RoundStart, client_states: MutableMapping[int, dict], data_of: Any = None
) -> None:
    """Every client not sampled receives its message of the round (:attr:`RoundStart.listeners`):
    :meth:`~..algorithms.base.Algorithm.run_client_receive` on its state, in client order, each under
    the (seed, client, round, client) stream as a client update is. ``data_of(k)``: the client's data
    (default ``exp.client_data(k, round)``). The local simulator and the pooled FedML server call this."""
    algo, r = exp.algorithm, start.round_idx
    ctx = ClientContext(round_idx=r, device=exp.device, seed=exp.config.common_args.random_seed)
    for k in sorted(start.listeners):
        state = client_states[k]
        data = data_of(k) if data_of is not None else exp.client_data(k, r)
        with seeding.global_stream(ctx.seed, "client", r, k, device=exp.device):
            algo.run_client_receive(start.listeners[k], data, state, ctx)
        client_states[k] = state  # a bounded store may have spilled it since it was read (client_state.py)


def finish_round(
    exp: Experiment, start: RoundStart, replies: dict[int, Message], bytes_up: int, **extra: Any
) -> dict[str, Any]:
    """Aggregate the replies the round keeps; return the round's metrics row (without test accuracy).

    The replies folded are those of the participation's ``aggregated`` clients, in that order (a reply
    that came too late under over-selection is counted in ``bytes_up`` but not folded); a skipped round
    aggregates nothing. The row carries the round's participation under ``"participation"``, which
    :meth:`RunRecorder.record` takes out and writes to ``participation.jsonl``. ``extra`` entries
    (e.g. a runtime's transport counters) go into the row before ``seconds``.
    """
    algo, r = exp.algorithm, start.round_idx
    plan = start.participation
    if plan is None:  # a RoundStart built by hand: every reply counts, in client order
        plan = Participation(r, sorted(replies), sorted(replies), sorted(replies))
    kept = {k: replies[k] for k in plan.aggregated if k in replies}
    metrics: dict[str, Any] = {}
    if not plan.skipped:
        with seeding.global_stream(exp.config.common_args.random_seed, "aggregate", r, device=exp.device):
            metrics = algo.aggregate(kept, r)
    train = algo.train
    return {
        "round": r + 1,  # 1-based, as in the plots and TensorBoard (round 1 is the first)
        "clients": len(kept),
        "bytes_up": bytes_up,
        "bytes_down": start.bytes_down,
        "lr": cosine_lr(train, r * train.local_steps),
        **mean_client_metrics(kept),
        **metrics,
        **extra,
        "seconds": time.perf_counter() - start.t0,
        "participation": plan.to_json(),
    }


def is_eval_round(cfg: ExperimentConfig, r: int, end: int) -> bool:
    """Evaluate every ``frequency_of_the_test`` rounds, after the last round, and where a run stops."""
    return (
        (r + 1) % cfg.validation_args.frequency_of_the_test == 0 or r == cfg.train_args.comm_round - 1 or r == end - 1
    )


def is_checkpoint_round(cfg: ExperimentConfig, r: int, end: int) -> bool:
    """Checkpoint every ``checkpoint_every`` rounds, after the last round, and where a run stops."""
    return (r + 1) % cfg.tracking_args.checkpoint_every == 0 or r == cfg.train_args.comm_round - 1 or r == end - 1


# ---------------------------------------------------------------------------------------------
# a run's progress


def is_terminal(stream: IO[str] | None) -> bool:
    """Whether ``stream`` is an open terminal (not a file, a pipe or a closed stream)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class RoundProgress:
    """A run's progress, one :meth:`update` per round, for both runtimes.

    On a terminal a tqdm bar (rounds done, rate, the last test accuracy). Where the output goes to a
    file or a pipe (a log file, ``nohup``, a batch job, mpirun's forwarded output) a bar would write
    a ``\\r`` frame per refresh into it; there each round is one INFO log line instead::

        semifl: round 3/20: test acc 85.20%, 4.1s (12.3s so far, about 1m10s left)

    ``tracking_args.progress_bar: false`` turns both off.

    Parameters
    ----------
    cfg : ExperimentConfig
        The run's config (``train_args.comm_round``, ``tracking_args.progress_bar``).
    start : int
        Rounds already done (a resumed run).
    desc : str
        What the bar or line is about (the algorithm, and the runtime).
    stream : text stream, optional
        Where the bar goes (default ``sys.stderr``, as tqdm's); the lines go to this module's logger.
    """

    def __init__(self, cfg: ExperimentConfig, start: int, desc: str, stream: IO[str] | None = None) -> None:
        from tqdm.auto import tqdm

        self.total, self.done, self.desc = cfg.train_args.comm_round, start, desc
        stream = sys.stderr if stream is None else stream
        on = cfg.tracking_args.progress_bar
        self.bar = None
        if on and is_terminal(stream):
            self.bar = tqdm(
                total=self.total, initial=start, desc=desc, unit="round", dynamic_ncols=True, leave=True, file=stream
            )
        self.lines = on and self.bar is None
        self.started = self.last = time.monotonic()
        self.rounds = 0  # rounds of this session (a resumed run's estimate counts only its own)

    def update(self, acc: float | None) -> None:
        """One more round done; ``acc``: its test accuracy (None when the round was not evaluated)."""
        now = time.monotonic()
        seconds, self.last = now - self.last, now
        self.done += 1
        self.rounds += 1
        if self.bar is not None:
            self.bar.update(1)
            if acc is not None:
                self.bar.set_postfix(acc=f"{100 * acc:.2f}%")
        elif self.lines:
            so_far = now - self.started
            left = so_far / self.rounds * max(self.total - self.done, 0)
            result = f"test acc {100 * acc:.2f}%" if acc is not None else "not evaluated"
            log.info(
                "%s: round %d/%d: %s, %s (%s so far, about %s left)",
                self.desc,
                self.done,
                self.total,
                result,
                format_duration(seconds),
                format_duration(so_far),
                format_duration(left),
            )

    def close(self) -> None:
        """Close the bar (a no-op without one; closing twice is fine)."""
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# a run's outputs


def keep_participation_lines(path: Path, rounds: int) -> None:
    """Keep the ``participation.jsonl`` lines of rounds ``1..rounds`` only (0: start it empty), atomically.

    A resumed run continues after its checkpoint's round: the lines of rounds a stopped or killed
    session recorded after that checkpoint are dropped, so that each round is written exactly once.
    """
    kept = []
    if rounds > 0 and path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                n = json.loads(line).get("round")
            except (ValueError, AttributeError):
                continue  # a line a killed write left unfinished
            if isinstance(n, int) and 1 <= n <= rounds:
                kept.append(line + "\n")
    text = "".join(kept).encode("utf-8")
    atomic_write(path, lambda fh: fh.write(text))


class RunRecorder:
    """Evaluation, metrics.jsonl / TensorBoard, checkpoints and summary.json for one run.

    Parameters
    ----------
    cfg : ExperimentConfig
        The run's config (its fingerprint goes into every checkpoint).
    exp : Experiment
        The built experiment; its algorithm's server side must be set up.
    run_dir : Path
        The output folder.
    resume_state : dict, optional
        A loaded checkpoint to continue from (the algorithm state is restored here).
    totals_keys : tuple of str
        Row keys summed over the run (and kept in checkpoints).
    started : float, optional
        ``time.perf_counter()`` when the run started (default: now); ``wall_seconds`` in
        summary.json counts from there (plus the wall seconds of the sessions before a resume).
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        exp: Experiment,
        run_dir: Path,
        resume_state: dict[str, Any] | None = None,
        totals_keys: tuple[str, ...] = ("bytes_up", "bytes_down", "seconds"),
        started: float | None = None,
    ) -> None:
        self.cfg, self.exp, self.run_dir = cfg, exp, Path(run_dir)
        self.started = time.perf_counter() if started is None else started
        self.wall_before = float((resume_state or {}).get("wall_seconds", 0.0))
        self.ckpt_path = self.run_dir / "checkpoints" / CHECKPOINT_NAME
        self.totals: dict[str, float] = {k: 0.0 if k == "seconds" else 0 for k in totals_keys}
        self.start = 0
        if resume_state is not None:
            exp.algorithm.load_state_dict(resume_state["algorithm"])
            self.start = resume_state["round"] + 1
            self.totals.update(resume_state["totals"])
        # the algorithm's per-client server records under the state budget (FedMatch's views, client_psi)
        self.records = bind_server_records(cfg, exp.algorithm, self.run_dir, resume_state)
        self.card = model_card(cfg, exp)  # what the checkpoint needs to be used alone (..trained)
        try:
            save_config(cfg, self.run_dir / "config.yaml", self._config_note())
            self.tracker = RunTracker(
                self.run_dir,
                cfg.tracking_args.enable_tensorboard,
                resume_after=self.start if resume_state is not None else None,
            )
            self.tracker.log_config(cfg.to_dict())
            self.participation_path = self.run_dir / PARTICIPATION_FILE
            keep_participation_lines(self.participation_path, self.start if resume_state is not None else 0)
        except OSError as exc:
            self._close_records()
            raise self.write_failed("at the start of the run", exc) from None
        # the clients' non-iid level needs their data: a deployment's server holds none of it (absent, not 0)
        self.measured_r = None if deployed(cfg) else exp.split.measured_r(exp.dataset.train_labels)
        evals = [r["test_acc"] for r in self.tracker.rows if r.get("test_acc") is not None]
        self.best = max(evals, default=float("nan"))
        self.last_acc = evals[-1] if evals else float("nan")

    def _config_note(self) -> str:
        """config.yaml's opening comment: the normalisation and model the run resolved (the keys stay as given)."""
        c = self.card
        return (
            f"resolved by the run: model {c['label']}, {c['num_classes']} classes, images {c['in_channels']}x"
            f"{c['image_size']}x{c['image_size']}, norm_mean {c['norm_mean']}, norm_std {c['norm_std']}\n"
            f"(all in checkpoints/last.pt and summary.json under {CARD_KEY}; fedml_ssfl.trained.load_trained uses it)"
        )

    def record(self, r: int, row: dict[str, Any], end: int, client_states: MutableMapping[int, dict]) -> float | None:
        """Close round ``r``: totals, ``finalize`` after the last round, evaluation, log, checkpoint.

        Returns the test accuracy when the round was evaluated, else None.
        """
        cfg, algo = self.cfg, self.exp.algorithm
        participation = row.pop("participation", None)  # finish_round's record of who took part
        for k in self.totals:
            self.totals[k] += row.get(k, 0)
        if r == cfg.train_args.comm_round - 1:
            with seeding.global_stream(cfg.common_args.random_seed, "finalize", device=self.exp.device):
                algo.finalize()
        acc = None
        if is_eval_round(cfg, r, end):
            evals = [
                evaluate(
                    model,
                    self.exp.dataset.test_images,
                    self.exp.dataset.test_labels,
                    self.exp.data_info,
                    self.exp.device,
                    cfg.validation_args.eval_batch_size,
                )
                for model in algo.evaluation_models()
            ]
            ev = {key: sum(e[key] for e in evals) / len(evals) for key in ("acc", "loss")}
            row["test_acc"], row["test_loss"] = ev["acc"], ev["loss"]
            if len(evals) > 1:
                row["test_acc_min"] = min(e["acc"] for e in evals)
                row["test_acc_max"] = max(e["acc"] for e in evals)
            acc = self.last_acc = ev["acc"]
            self.best = acc if math.isnan(self.best) else max(self.best, acc)
        try:
            self._check_run_dir()
            self.tracker.log_round(row)
            if participation is not None:
                with naming(self.participation_path), self.participation_path.open("a", encoding="utf-8") as fh:
                    fh.write(json.dumps(participation) + "\n")
            if is_checkpoint_round(cfg, r, end):
                states_dir = self.ckpt_path.parent / STATES_DIR
                states = client_state_payload(client_states, states_dir)  # spilled states: files in states_dir
                algo_state = algo.state_dict()
                records = server_records_payload(algo_state, self.records, states_dir)  # likewise
                payload = {
                    "round": r,
                    "fingerprint": cfg.fingerprint(),
                    "config": cfg.to_dict(),  # a refused resume names the keys that differ from it
                    "algorithm_name": cfg.algorithm,
                    CARD_KEY: self.card,  # the model card: the checkpoint used alone (..trained)
                    "algorithm": algo_state,
                    **states,
                    **records,
                    "totals": self.totals,
                    "wall_seconds": self.wall_seconds(),
                }
                save_checkpoint(self.ckpt_path, payload)
                prune_state_files(states_dir, payload)  # files only the previous checkpoint named
        except OSError as exc:
            raise self.write_failed(f"round {r + 1}", exc) from None
        return acc

    def wall_seconds(self) -> float:
        """Wall-clock seconds of the run so far, over all its sessions (resumes add up)."""
        return self.wall_before + time.perf_counter() - self.started

    def _run_dir_lost(self) -> str:
        """How the run folder went away during the run ("" while it is a folder)."""
        if self.run_dir.is_dir():
            return ""
        return "replaced by a file (left untouched)" if self.run_dir.exists() else "removed"

    def _check_run_dir(self) -> None:
        """Raise :class:`NotADirectoryError` when the run folder is gone or is a file now.

        Checked before each round's writes: ``save_checkpoint`` would otherwise re-create a removed
        folder and fill it with a checkpoint and no config or earlier metrics.
        """
        lost = self._run_dir_lost()
        if lost:
            raise NotADirectoryError(f"the run folder {self.run_dir} was {lost} while the run was running")

    def write_failed(self, when: str, exc: OSError) -> RunFailed:
        """The :class:`RunFailed` for an output that could not be written: names the path and the fix.

        Nothing already saved is touched: the checkpoint is replaced atomically, so the last good one
        stays, and a run folder replaced by a file is left alone. A ``failed`` summary.json is written
        where it can be (a full disk has room again once the interrupted write's temporary file is gone).
        """
        lost = self._run_dir_lost()
        if lost:
            return RunFailed(
                f"{when}: the run folder {self.run_dir} was {lost} while the run was running, so nothing more "
                f"was written; put the run folder back and continue with `fedml-ssfl run --resume {self.run_dir}`, "
                "or start a new run"
            )
        tracker = getattr(self, "tracker", None)  # None: the run's outputs could not even be opened
        if tracker is not None:
            tracker.write_failed = True
        target = Path(exc.filename) if exc.filename else self.run_dir
        where = f"in the run folder {self.run_dir}"
        if target != self.run_dir and self.run_dir not in target.parents:  # e.g. device_args.state_spill_dir
            where = f"{target} (outside the run folder {self.run_dir})"
        reason = folder_error(target, exc)
        if self.ckpt_path.is_file():
            text = (
                f"{when}: cannot write {where}: {reason}; outputs already saved are intact (last good checkpoint: "
                f"{self.ckpt_path}): once that is fixed (or disk space freed), continue with `fedml-ssfl run --resume "
                f"{self.run_dir}`"
            )
        else:  # --resume would be refused (no checkpoint): say what works
            text = (
                f"{when}: cannot write {where}: {reason}; no checkpoint was written yet, so there is nothing to "
                "resume: once that is fixed (or disk space freed), run the same command again (it starts afresh)"
            )
        return RunFailed(text + self._failed_summary(text))

    def _failed_summary(self, error: str) -> str:
        """Write summary.json with status ``failed``; "" when written, else why not (for the error line)."""
        tracker = getattr(self, "tracker", None)
        try:
            self._check_run_dir()
            write_summary(
                self.run_dir,
                {
                    "status": "failed",
                    "error": error,
                    "run_dir": str(self.run_dir),
                    "rounds_completed": len(tracker.rows) if tracker is not None else self.start,
                    "wall_seconds": self.wall_seconds(),
                },
            )
        except OSError as exc:
            return f" (summary.json was not written: {exc})"
        return ""

    def fail(self, error: BaseException | str, cause: BaseException | None = None) -> RunFailed:
        """Write a ``failed`` summary; return the :class:`RunFailed` to raise (names the checkpoint).

        When the summary cannot be written (the run folder is gone), the error says so. When the
        failure is a damaged client state file of the checkpoint's own folder (``error``, or
        ``cause`` when ``error`` is its text), the last checkpoint names that file too: the error
        says it cannot be resumed as it is, instead of calling it good.
        """
        unwritten = self._failed_summary(str(error))
        if unwritten:
            return RunFailed(f"{error}{unwritten}")
        kept = self.ckpt_path if self.ckpt_path.exists() else "none yet"
        damaged = cause if cause is not None else error
        if isinstance(damaged, ClientStateError) and damaged.path is not None and kept != "none yet":
            if damaged.path.parent == self.ckpt_path.parent / STATES_DIR:
                return RunFailed(
                    f"{error} The last checkpoint ({kept}) names that file too, so it cannot be resumed as it is: "
                    f"restore {damaged.path} from a copy of the run folder, or start a new run"
                )
        return RunFailed(f"{error} Last good checkpoint: {kept}")

    def close(self) -> None:
        """Close the tracker; remove the spill folders of the server records (their checkpointed files stay)."""
        self.tracker.close()
        self._close_records()

    def _close_records(self) -> None:
        for store in self.records.values():
            store.close()

    def result(self, status: str, **extra: Any) -> RunResult:
        """Plots and summary.json for a completed or stopped run; the :class:`RunResult`."""
        cfg, totals = self.cfg, self.totals
        done = len(self.tracker.rows)
        summary = {
            "status": status,
            "algorithm": cfg.algorithm,
            "dataset": self.card["dataset"],  # the data used (a script's list: its own name)
            "model": self.card["label"],
            "rounds_completed": done,
            "comm_round": cfg.train_args.comm_round,
            "final_test_acc": self.last_acc,
            "best_test_acc": self.best,
            "bytes_up_total": totals["bytes_up"],
            "bytes_down_total": totals["bytes_down"],
            "bytes_up_per_round": totals["bytes_up"] / max(done, 1),
            "bytes_down_per_round": totals["bytes_down"] / max(done, 1),
            "seconds_total": totals["seconds"],
            "seconds_per_round": totals["seconds"] / max(done, 1),
            "wall_seconds": self.wall_seconds(),
            **({} if self.measured_r is None else {"measured_non_iid_r": self.measured_r}),
            "num_classes": self.exp.data_info.num_classes,
            "config_fingerprint": cfg.fingerprint(),
            "run_dir": str(self.run_dir),
            CARD_KEY: self.card,
            **extra,
        }
        try:
            self._check_run_dir()
            if self.tracker.rows:
                subtitle = run_description(cfg.to_dict(), summary)
                self.tracker.plot(cfg.algorithm, self.exp.data_info.num_classes, subtitle)
            self.tracker.write_summary(summary)
            self.tracker.write_hparams(cfg.to_dict(), summary)
        except OSError as exc:
            raise self.write_failed("at the end of the run", exc) from None
        return RunResult(
            run_dir=self.run_dir,
            algorithm=cfg.algorithm,
            final_acc=self.last_acc,
            best_acc=self.best,
            rounds_completed=done,
            summary=summary,
        )
