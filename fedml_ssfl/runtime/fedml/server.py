"""The server half of a FedML job (no FedML in here): plan, begin and finish rounds, record them."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from ...algorithms.base import Message, message_nbytes
from ...client_state import close_client_states
from ...config import ExperimentConfig
from ...experiment import Experiment
from ...sampling import sample_clients
from ..common import (
    RoundProgress,
    RoundStart,
    RunFailed,
    RunRecorder,
    RunResult,
    deliver_to_listeners,
    finish_round,
    is_checkpoint_round,
    run_client_states,
    start_round,
)
from .payloads import check_reply, state_nbytes
from .protocol import Failure, Intro, Reply, Task

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


def assign_silos(chosen: list[int], holder: dict[int, int], workers: int) -> list[int]:
    """Route a round's silos to workers 1..``workers`` (one each): position i is served by rank i + 1.

    A silo goes back to the worker holding its newest client state when that worker is free,
    so state rarely has to move; the rest fill the free workers in id order. Deterministic.
    """
    if len(chosen) != workers:
        raise ValueError(f"{len(chosen)} silos for {workers} workers")
    return [g[0] for g in assign_groups(chosen, holder, workers)]


def assign_groups(chosen: list[int], holder: dict[int, int], workers: int) -> list[list[int]]:
    """Route a round's C_k silos to workers 1..``workers`` (at most C_k): group i is served by rank i + 1.

    Each worker serves ``C_k // workers`` silos, the first ``C_k % workers`` one more (FedML's MPI
    simulation with ``worker_num`` below ``client_num_per_round`` runs several clients per process
    too). A silo goes back to the worker holding its newest client state while that worker has room,
    so state rarely has to move; the rest fill the workers with room in rank order. Each group is in
    silo order. Deterministic.
    """
    n = len(chosen)
    if not 1 <= workers <= n:
        raise ValueError(f"{n} silos for {workers} workers")
    room = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
    groups: list[list[int]] = [[] for _ in range(workers)]
    rest = []
    for k in sorted(chosen):
        w = holder.get(k)
        if w is not None and 1 <= w <= workers and len(groups[w - 1]) < room[w - 1]:
            groups[w - 1].append(int(k))
        else:
            rest.append(int(k))
    i = 0
    for k in rest:
        while len(groups[i]) >= room[i]:
            i += 1
        groups[i].append(k)
    return [sorted(g) for g in groups]


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
        The number of worker processes: C_k, or fewer (``device_args.worker_num``), each serving several
        of a round's silos (:func:`assign_groups`).
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
        try:
            self.client_states = run_client_states(cfg, self.run_dir, resume_state)  # a dict, or a bounded store
        except BaseException:
            self.rec.close()  # the algorithm's server records' spill folders
            raise
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
        self.payloads: dict[int, Task] | None = None
        self.awaiting: dict[int, int] = {}  # rank -> silo, this round
        self.round_started = time.monotonic()
        self.failure: RunFailed | None = None
        self.refused: list[str] = []
        self.last_row: dict[str, Any] = {}
        self.model_shapes = {k: tuple(v.shape) for k, v in exp.algorithm.model_fn().state_dict().items()}
        self.partial_ok = exp.algorithm.partial_replies
        self.requires_all = exp.algorithm.requires_all_replies
        self.bar = RoundProgress(cfg, self.round, f"{cfg.algorithm} [FedML {backend}]")

    # ---- routing -------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.round >= self.end

    def groups(self, r: int, holder: dict[int, int] | None = None) -> list[list[int]]:
        """The silos each worker serves in round ``r``, in rank order (cached: computed once per round)."""
        if r not in self.plans:
            t = self.cfg.train_args
            chosen = sample_clients(self.cfg.common_args.random_seed, r, t.client_num_in_total, t.client_num_per_round)
            self.plans[r] = assign_groups(chosen, self.holder if holder is None else holder, self.workers)
        return self.plans[r]

    def plan(self, r: int, holder: dict[int, int] | None = None) -> list[int]:
        """Round ``r``'s silos, the workers' groups one after another (one silo each: the silo of each worker)."""
        return [k for g in self.groups(r, holder) for k in g]

    def owners(self, r: int, holder: dict[int, int] | None = None) -> dict[int, int]:
        """silo -> the rank serving it in round ``r``."""
        return {k: w + 1 for w, g in enumerate(self.groups(r, holder)) for k in g}

    def routing(self) -> list[int]:
        """One silo id per worker in worker order, the key of its payload (the first of its group), for the
        next send (the last round's after the run ends)."""
        return [g[0] for g in self.groups(min(self.round, self.end - 1))]

    def outstanding(self) -> dict[int, int]:
        """rank -> silo of the workers this round still waits for."""
        return dict(self.awaiting)

    def received(self, rank: int) -> None:
        self.awaiting.pop(rank, None)

    def routed(self, rank: int) -> list[tuple[int, bool]]:
        """(silo, trained) of each reply round ``self.round``'s task asks of ``rank``, in the task's order."""
        start = self.current
        chosen = start.chosen if start is not None else []
        return [(k, True) for k, w in self.owners(self.round).items() if w == rank and k in chosen]

    def reply_problem(self, rank: int, reply: Reply) -> str | None:
        """Why ``reply``, received from ``rank`` in this round, does not answer the task the round sent it
        (None when it does). A member's reply naming another rank, silo or round is refused, not fatal."""
        got = [(up.round, up.rank, up.silo, up.trained) for up in (reply, *reply.more)]
        want = [(self.round, rank, k, trained) for k, trained in self.routed(rank)]
        if sorted(got) == sorted(want):
            return None
        said = ", ".join(f"round {r + 1} rank {w} silo {k}{'' if t else ' (idle)'}" for r, w, k, t in got)
        asked = ", ".join(f"silo {k}{'' if t else ' (idle)'}" for _, _, k, t in want) or "nothing"
        return f"it answers {said}, where round {self.round + 1} asked rank {rank} for {asked}"

    # ---- a round -------------------------------------------------------------------------
    def begin_round(self) -> dict[int, Task]:
        """Server step and one task per silo for the current round (idempotent per round)."""
        r = self.round
        if self.payloads is not None and self.current is not None and self.current.round_idx == r:
            return self.payloads
        plan, groups = self.plan(r), self.groups(r)
        start = start_round(self.exp, r)
        if sorted(plan) != start.chosen:
            raise RuntimeError(f"routing {plan} disagrees with the sampler's {start.chosen} in round {r + 1}")
        if start.listeners:
            self._deliver_on_server(start)
        after = dict(self.holder)
        after.update(self.owners(r))
        stale_after = self.stale | set(plan)
        nxt = self.owners(r + 1, holder=after) if r + 1 < self.end else {}
        checkpoint = is_checkpoint_round(self.cfg, r, self.end)
        # an algorithm that broadcasts to every client has the silos not sampled receive on the server,
        # which therefore needs every silo's newest state after each round: every trained state comes back
        everyone = self.exp.algorithm.broadcasts_to_all()
        uploads: dict[int, list[int]] = {w: [] for w in range(1, self.workers + 1)}
        for j in sorted(stale_after):
            w = after[j]
            if checkpoint or everyone or (j in nxt and nxt[j] != w):
                uploads[w].append(j)
        payloads, state_down = {}, 0
        for i, group in enumerate(groups):
            w = i + 1
            tasks = []
            for k in group:
                send_state = self.holder.get(k) != w
                if send_state:
                    if k in self.stale:
                        raise RuntimeError(f"silo {k}'s newest state is on rank {self.holder[k]}, not on the server")
                    state_down += state_nbytes(self.client_states[k])
                tasks.append(
                    Task(
                        round=r,
                        silo=k,
                        rank=w,
                        msg=start.messages[k],
                        state=self.client_states[k] if send_state else None,
                        state_tag=self.tags[k],
                    )
                )
            head = tasks[0]
            head.upload, head.drop, head.more = uploads[w], sorted(self.drop[w] - set(group)), tasks[1:]
            payloads[head.silo] = head
            self.drop[w].clear()
        self.current, self.payloads, self.state_down = start, payloads, state_down
        self.awaiting = {i + 1: g[0] for i, g in enumerate(groups)}
        self.round_started = time.monotonic()
        return payloads

    def _deliver_on_server(self, start: RoundStart) -> None:
        """The silos not sampled receive the round's message here, on the server's copy of their state.

        Pooled workers are a simulation: any process can play a silo. The server holds every silo's
        newest state (each trained state is uploaded after its round when the algorithm broadcasts to
        all), folds the message in (:func:`~..common.deliver_to_listeners`, as the local simulator does),
        and so holds a newer state than any worker's cache: the worker that cached one forgets it, and
        the silo's state goes down with its next task.
        """
        r = start.round_idx
        missing = sorted(set(start.listeners) & self.stale)
        if missing:
            raise RuntimeError(f"round {r + 1}: the newest states of silos {missing} are not on the server")
        deliver_to_listeners(self.exp, start, self.client_states)
        for k in start.listeners:
            old = self.holder.pop(k, None)
            if old is not None:
                self.drop[old].add(k)
            self.tags[k] = r

    def finish_round(self, uploads: list[Reply | Failure], **extra: Any) -> dict[str, Any]:
        """Fold the workers' uploads into the algorithm; record the round; advance."""
        start, r = self.current, self.round
        if start is None:
            raise RuntimeError("finish_round before begin_round")
        by_silo: dict[int, Reply] = {}
        owners = self.owners(r)
        heads = self._replies(uploads)
        for up in (one for head in heads for one in (head, *head.more)):
            if up.round != r or up.silo not in start.chosen:
                raise RuntimeError(
                    f"rank {up.rank} sent a reply for round {up.round + 1} silo {up.silo} "
                    f"while round {r + 1} waited for silos {start.chosen}"
                )
            if up.rank != owners[up.silo]:
                raise RuntimeError(
                    f"round {r + 1}: silo {up.silo} came back from rank {up.rank}, but was routed to rank "
                    f"{owners[up.silo]}"
                )
            by_silo[up.silo] = up
        if sorted(by_silo) != start.chosen:
            raise RuntimeError(f"round {r + 1}: replies for silos {sorted(by_silo)}, expected {start.chosen}")
        for k in start.chosen:  # the worker that trained a silo now holds its newest state
            w = by_silo[k].rank
            old = self.holder.get(k)
            if old is not None and old != w:
                self.drop[old].add(k)
            self.holder[k], self.tags[k] = w, r
            self.stale.add(k)
        state_up = 0
        for up in heads:
            for j, (tag, st) in up.states.items():
                if self.holder.get(j) == up.rank and self.tags[j] == tag:
                    self.client_states[j] = st
                    self.stale.discard(j)
                    state_up += state_nbytes(st)
        if is_checkpoint_round(self.cfg, r, self.end) and self.stale:
            raise RuntimeError(f"round {r + 1}: client states of silos {sorted(self.stale)} were not uploaded")
        return self._close_round(by_silo, state_bytes_up=state_up, state_bytes_down=self.state_down, **extra)

    def _replies(self, uploads: list[Reply | Failure]) -> list[Reply]:
        """The uploads as replies; a worker's :class:`Failure` (or anything else) stops the run."""
        for up in uploads:
            if isinstance(up, Failure):
                raise self.client_error(up)
            if not isinstance(up, Reply):
                raise RuntimeError(f"round {self.round + 1}: a worker sent a {type(up).__name__}, not a Reply")
        return list(uploads)

    def _close_round(self, by_silo: dict[int, Reply], **extra: Any) -> dict[str, Any]:
        """Check the chosen silos' replies, aggregate, record the round and advance (both modes)."""
        start, r = self.current, self.round
        replies: dict[int, Message] = {}
        up_bytes = refused = 0
        for k in start.chosen:  # sorted, as in the local runtime: aggregation order matters
            up = by_silo[k]
            msg = up.msg
            if isinstance(msg, Message):
                up_bytes += message_nbytes(msg)
            problem = check_reply(msg, self.model_shapes, start.messages.get(k), self.partial_ok)
            if problem is None:
                replies[k] = msg
                continue
            text = f"round {r + 1}: refused the reply of rank {up.rank} (silo {k}): {problem}"
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
        self.bar.update(acc)
        return row

    def rejoin(self, rank: int) -> Task | None:
        """Rank ``rank`` came back as a new process in the middle of the run: a pooled worker's cache of
        client states is gone with its process, so the run cannot go on (it resumes from a checkpoint)."""
        raise RuntimeError(
            f"round {self.round + 1}: rank {rank} restarted; a pooled worker's cached client states are gone "
            f"with its process: resume the run from its last checkpoint (--resume {self.run_dir})"
        )

    def client_error(self, up: Failure) -> RunFailed:
        if up.traceback:
            log.error("traceback from rank %s (silo %s):\n%s", up.rank, up.silo, up.traceback)
        return RunFailed(up.describe())

    # ---- end -----------------------------------------------------------------------------
    def fail(self, error: BaseException | str) -> RunFailed:
        """Record a failure once (summary.json ``failed``); return the :class:`RunFailed`."""
        if self.failure is None:
            text = str(error) if isinstance(error, (RunFailed, str)) else f"{type(error).__name__}: {error}"
            self.failure = self.rec.fail(text, cause=error if isinstance(error, BaseException) else None)
            self.bar.close()
            self.rec.close()
            close_client_states(self.client_states)
        return self.failure

    def result(self) -> RunResult:
        self.bar.close()
        self.rec.close()
        close_client_states(self.client_states)
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


class DeployedServerRuntime(ServerRuntime):
    """The server of a deployment: rank k + 1 always serves silo k, whose data and state stay there.

    Every round every silo gets a payload: the sampled ones the algorithm's message, the others an
    ``idle`` note (so that all of them keep step, answer liveness, and save their state at checkpoint
    rounds), which carries the round's message for them to receive when the algorithm broadcasts to
    every client (FedSEAL). The first payload to each rank also carries the metadata the silo checks its data
    against and builds its model from. The server's checkpoint holds no client state: each silo
    saves its own (:class:`SiloWorker`).
    """

    def __init__(self, cfg, exp, run_dir, resume_state, workers, stop_after=None, backend="MPI") -> None:
        from ...data.silos import SiloMeta

        super().__init__(cfg, exp, run_dir, resume_state, workers, stop_after, backend)
        self.client_states = {}
        self.meta = SiloMeta.of(exp.dataset)
        self.resumed_after = self.round - 1 if resume_state is not None else -1
        self.introduced: set[int] = set()

    def groups(self, r: int, holder: dict[int, int] | None = None) -> list[list[int]]:
        return [[k] for k in range(self.workers)]

    def plan(self, r: int, holder: dict[int, int] | None = None) -> list[int]:
        return list(range(self.workers))

    def begin_round(self) -> dict[int, Task]:
        r = self.round
        if self.payloads is not None and self.current is not None and self.current.round_idx == r:
            return self.payloads
        start = start_round(self.exp, r)
        checkpoint = is_checkpoint_round(self.cfg, r, self.end)
        payloads = {}
        for k in range(self.workers):
            intro = None
            if k + 1 not in self.introduced:
                intro = self.intro()
                self.introduced.add(k + 1)
            payloads[k] = Task(
                round=r,
                silo=k,
                rank=k + 1,
                train=k in start.messages,
                msg=start.messages.get(k, start.listeners.get(k)),  # a listener: the message to receive
                checkpoint=checkpoint,
                intro=intro,
            )
        self.current, self.payloads = start, payloads
        self.awaiting = {k + 1: k for k in range(self.workers)}
        self.round_started = time.monotonic()
        return payloads

    def intro(self) -> Intro:
        """What a silo process learns first: the metadata, the run folder, the last round completed
        (whose saved state it reloads; -1: none, it starts fresh)."""
        return Intro(self.meta, self.run_dir.name, self.round - 1)

    def rejoin(self, rank: int) -> Task | None:
        """Rank ``rank`` came back as a new process (a silo restarted): its next task carries an
        :class:`Intro`, so it reloads its state saved after the last round the server completed
        before that task; that is this round's task again while the round waits for it (returned),
        else (it had answered) the next round's.

        Raises
        ------
        RuntimeError
            That round was not a checkpoint round: the silo saved no state after it.
        """
        waits = self.payloads is not None and rank in self.awaiting
        needed = self.round - 1 if waits else self.round
        if needed >= 0 and needed < self.end and not is_checkpoint_round(self.cfg, needed, self.end):
            every = self.cfg.tracking_args.checkpoint_every
            raise RuntimeError(
                f"round {self.round + 1}: rank {rank} (silo {rank - 1}) restarted, and silos save their state only "
                f"at checkpoint rounds (tracking_args.checkpoint_every: {every}), not after round {needed + 1}: "
                f"resume the run from its last checkpoint (--resume {self.run_dir}); with checkpoint_every: 1 a "
                "restarted silo rejoins the running job"
            )
        self.introduced.discard(rank)
        if not waits:
            return None
        k = rank - 1
        task = dataclasses.replace(self.payloads[k], intro=self.intro())
        self.payloads[k] = task
        self.introduced.add(rank)
        return task

    def routed(self, rank: int) -> list[tuple[int, bool]]:
        """Rank k + 1 answers for silo k every round: trained when it was chosen, else idle."""
        start = self.current
        return [(rank - 1, start is not None and rank - 1 in start.chosen)]

    def finish_round(self, uploads: list[Reply | Failure], **extra: Any) -> dict[str, Any]:
        start, r = self.current, self.round
        if start is None:
            raise RuntimeError("finish_round before begin_round")
        by_silo: dict[int, Reply] = {}
        for up in self._replies(uploads):
            k = up.silo
            if up.round != r or up.rank != k + 1:
                raise RuntimeError(
                    f"rank {up.rank} sent a reply for round {up.round + 1} silo {k} in round {r + 1} "
                    "(rank k + 1 serves silo k)"
                )
            if up.trained != (k in start.chosen):
                said, asked = ("trained", "stay idle") if up.trained else ("stayed idle", "train")
                raise RuntimeError(f"round {r + 1}: silo {k} {said} when told to {asked}")
            if up.trained:
                by_silo[k] = up
        if sorted(by_silo) != start.chosen:
            raise RuntimeError(f"round {r + 1}: replies for silos {sorted(by_silo)}, expected {start.chosen}")
        return self._close_round(by_silo, **extra)
