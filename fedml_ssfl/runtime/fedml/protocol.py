"""The server <-> worker protocol of a FedML job, as typed records (what the wire codec may carry).

One round, seen from a worker::

    server --Task--> worker --Reply | Failure--> server        ...        server --Finish--> worker

A pooled worker (simulation under mpirun) serves whichever silo a :class:`Task` names and keeps
a cache of client states; with fewer workers than silos a round (``device_args.worker_num``, as in
FedML's MPI simulation) a worker's task carries the round's other silos for it in ``more``, and its
reply their replies in ``more`` (``state``, ``state_tag``, ``upload``, ``drop`` move them); a deployed
silo (rank k + 1 serves silo k) keeps its own state, is introduced by the first task it receives
(:class:`Intro`) and saves its state when a task says ``checkpoint``.

Every record checks its own fields (:meth:`check`); the wire codec calls it on what it decoded,
so a peer cannot hand the server a reply whose round is a string.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...contract import Message
from ...data.silos import SiloMeta


def _int(name: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{name} must be an integer, got {v!r}")


def _ints(name: str, v: Any) -> None:
    if not isinstance(v, list):
        raise ValueError(f"{name} must be a list of silo ids, got {type(v).__name__}")
    for x in v:
        _int(name, x)


def _batch(name: str, head: Any, cls: type) -> None:
    """``head.more``: a flat list of ``cls`` records of the head's round and rank, each silo once."""
    if not isinstance(head.more, list):
        raise ValueError(f"{name}.more must be a list, got {type(head.more).__name__}")
    silos = {head.silo}
    for item in head.more:
        if not isinstance(item, cls) or item.more:
            raise ValueError(f"{name}.more must hold {cls.__name__} records without a more of their own")
        if (item.round, item.rank) != (head.round, head.rank) or item.silo in silos:
            raise ValueError(f"{name}.more: each silo once, all of round {head.round} for rank {head.rank}")
        silos.add(item.silo)
        item.check()


@dataclass
class Intro:
    """What a deployed silo learns from the server's first task: the data metadata it checks its
    file against, the server's run folder name, and the last round a resumed run had completed."""

    meta: SiloMeta
    run_name: str
    resumed_after: int = -1

    def check(self) -> None:
        if not isinstance(self.meta, SiloMeta):
            raise ValueError("Intro.meta must be a SiloMeta")
        if not isinstance(self.run_name, str) or not self.run_name:
            raise ValueError("Intro.run_name must be a non-empty string")
        _int("Intro.resumed_after", self.resumed_after)


@dataclass
class Task:
    """Server -> worker: round ``round``'s work on silo ``silo`` for rank ``rank``.

    Attributes
    ----------
    train : bool
        Run the client update (False: a deployed silo not sampled this round stays idle).
    msg : Message or None
        The algorithm's message to this client; with ``train`` False, the message a deployed silo not
        sampled receives when the algorithm broadcasts to every client (else None).
    state, state_tag : dict or None, int
        Pooled workers: the silo's client state when this rank does not hold its newest copy, and
        the round that copy was last updated in (-1: never).
    upload, drop : list of int
        Pooled workers: silos whose cached state to send back, and to forget.
    checkpoint : bool
        Deployed silos: save the client state after this round.
    intro : Intro or None
        Deployed silos: set on the first task a rank receives.
    more : list of Task
        Pooled workers serving several silos a round: the tasks of the others (same round and rank;
        their own ``upload`` and ``drop`` empty: the first task's apply to the whole batch, after it
        has trained).
    """

    round: int
    silo: int
    rank: int
    train: bool = True
    msg: Message | None = None
    state: dict | None = None
    state_tag: int = -1
    upload: list[int] = field(default_factory=list)
    drop: list[int] = field(default_factory=list)
    checkpoint: bool = False
    intro: Intro | None = None
    more: list[Task] = field(default_factory=list)

    def check(self) -> None:
        for name in ("round", "silo", "rank", "state_tag"):
            _int(f"Task.{name}", getattr(self, name))
        _batch("Task", self, Task)
        _ints("Task.upload", self.upload)
        _ints("Task.drop", self.drop)
        if not isinstance(self.train, bool) or not isinstance(self.checkpoint, bool):
            raise ValueError("Task.train and Task.checkpoint must be booleans")
        if self.msg is not None and not isinstance(self.msg, Message):
            raise ValueError("Task.msg must be a Message or None")
        if self.state is not None and not isinstance(self.state, dict):
            raise ValueError("Task.state must be a dict or None")
        if self.intro is not None:
            if not isinstance(self.intro, Intro):
                raise ValueError("Task.intro must be an Intro or None")
            self.intro.check()


@dataclass
class Reply:
    """Worker -> server: the outcome of a :class:`Task`.

    Attributes
    ----------
    trained : bool
        The client update ran (False: a deployed silo's idle answer).
    msg : Message or None
        The client's message (checked by :func:`~.payloads.check_reply` before aggregation).
    states : dict
        Pooled workers: ``{silo: (round of last update, client state)}`` for the task's ``upload``.
    more : list of Reply
        The replies to a task's ``more``, in its order (their ``states`` empty).
    """

    round: int
    silo: int
    rank: int
    trained: bool = True
    msg: Message | None = None
    states: dict[int, tuple[int, dict]] = field(default_factory=dict)
    more: list[Reply] = field(default_factory=list)

    def check(self) -> None:
        for name in ("round", "silo", "rank"):
            _int(f"Reply.{name}", getattr(self, name))
        _batch("Reply", self, Reply)
        if not isinstance(self.trained, bool):
            raise ValueError("Reply.trained must be a boolean")
        if not isinstance(self.states, dict):
            raise ValueError("Reply.states must be a dict")
        for j, entry in self.states.items():
            _int("Reply.states key", j)
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], dict)):
                raise ValueError(f"Reply.states[{j}] must be a (round, state dict) pair")
            _int(f"Reply.states[{j}] round", entry[0])


@dataclass
class Failure:
    """Worker -> server: the task raised; the server stops the run naming the rank and silo."""

    round: int
    silo: int
    rank: int
    error: str
    traceback: str = ""

    def check(self) -> None:
        for name in ("round", "silo", "rank"):
            _int(f"Failure.{name}", getattr(self, name))
        if not isinstance(self.error, str) or not isinstance(self.traceback, str):
            raise ValueError("Failure.error and Failure.traceback must be strings")

    def describe(self) -> str:
        return f"rank {self.rank} (silo {self.silo}) failed in round {self.round + 1}: {self.error}"


@dataclass
class Finish:
    """Server -> worker: the run is over."""

    def check(self) -> None:
        return None


#: The records the wire codec may carry, by name (a decoded name outside this table is refused).
RECORDS: dict[str, type] = {cls.__name__: cls for cls in (Intro, Task, Reply, Failure, Finish)}


def fields_of(record: Any) -> dict[str, Any]:
    """The record's fields, shallow (values are not copied)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


def build(name: str, values: dict[str, Any]) -> Any:
    """The record ``name`` from decoded field values, checked; ValueError naming what is wrong."""
    cls = RECORDS.get(name)
    if cls is None:
        raise ValueError(f"{name!r} is not a protocol record")
    expected = {f.name for f in dataclasses.fields(cls)}
    if set(values) != expected:
        raise ValueError(f"a {name} needs the fields {sorted(expected)}, got {sorted(values)}")
    record = cls(**values)
    record.check()
    return record
