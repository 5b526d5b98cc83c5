"""Participation as data: who was asked in a round, who answered, in what order the replies were folded.

A round's participation is one :class:`Participation`: the clients the server *asked* (the seeded
sample, over-selection included), those that *answered* (trained and sent a reply), the replies
*aggregated* (in the order they were folded into the model), the *listeners* (clients not asked that
received the round's broadcast, for an algorithm that broadcasts to all) and whether the round was
*skipped* (fewer than ``train_args.min_clients`` could take part: no server step, no training, the
model unchanged). Both runtimes build one per round (:func:`..runtime.common.start_round`) and the run
records it in ``participation.jsonl``, one JSON line per round::

    {"round": 3, "asked": [0, 2, 5], "answered": [0, 5], "aggregated": [0, 5], "listeners": [], "skipped": false}

``round`` is 1-based, as in ``metrics.jsonl``. A run started with ``train_args.replay_participation``
pointing at such a file follows it exactly (:class:`Planner`), which is how a churned run is proved
correct: the simulator replaying its record ends with the same model.

Where the simulator's participation comes from (:class:`Planner`):

* no availability key: every client is reachable; the seeded sampler's C_k clients all answer
  (what the runtimes always did);
* ``train_args.availability``: client k is reachable in round r with probability p_k, drawn from
  :func:`~.seeding.derive_seed` of (seed, "availability", r, k): the same in every run, resume and
  process;
* ``train_args.availability_trace``: a JSONL file, one line per round, ``{"round": 1, "available":
  [0, 3, 7]}``, rounds 1..n in order (a longer run starts over at the trace's first line);
* ``train_args.over_selection`` = o: ``ceil(C_k (1 + o))`` clients are asked (at most K); of those
  reachable, the first C_k to finish are kept, the finish order being a seeded draw per (round,
  client) (:func:`finish_time`); the others train but their replies arrive too late and are dropped.

The replies kept are aggregated in client-id order (as the runtimes always did).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import seeding
from .errors import ConfigError
from .sampling import sample_clients

FILE_NAME = "participation.jsonl"
"""The run folder's record of every round's participation."""

MAX_TRACE_BYTES = 256 * 2**20
"""The largest availability trace or participation file read (a file beyond it is refused)."""


@dataclass
class Participation:
    """One round's participation (``round_idx`` 0-based; the JSON line's ``round`` is 1-based)."""

    round_idx: int
    asked: list[int]
    answered: list[int]
    aggregated: list[int]
    listeners: list[int] = field(default_factory=list)
    skipped: bool = False

    def to_json(self) -> dict[str, Any]:
        """The ``participation.jsonl`` line of the round."""
        return {
            "round": self.round_idx + 1,
            "asked": list(self.asked),
            "answered": list(self.answered),
            "aggregated": list(self.aggregated),
            "listeners": list(self.listeners),
            "skipped": self.skipped,
        }

    @classmethod
    def from_json(cls, line: Any, where: str, num_clients: int) -> Participation:
        """Read one line (:meth:`to_json`); ``where`` names it in errors.

        Raises
        ------
        ConfigError
            The line is not a participation record for clients ``0..num_clients-1`` (names what is wrong).
        """
        if not isinstance(line, dict) or not isinstance(line.get("round"), int) or line["round"] < 1:
            raise ConfigError(f"{where}: not a participation record with a 1-based 'round'")
        lists = {}
        for key in ("asked", "answered", "aggregated", "listeners"):
            value = line.get(key, [])
            if not isinstance(value, list) or not all(isinstance(k, int) and 0 <= k < num_clients for k in value):
                raise ConfigError(f"{where}: '{key}' must be a list of client ids 0..{num_clients - 1}")
            if len(set(value)) != len(value):
                raise ConfigError(f"{where}: '{key}' names a client twice")
            lists[key] = value
        if not set(lists["answered"]) <= set(lists["asked"]):
            raise ConfigError(f"{where}: 'answered' names clients that were not asked")
        if not set(lists["aggregated"]) <= set(lists["answered"]):
            raise ConfigError(f"{where}: 'aggregated' names clients that did not answer")
        if set(lists["listeners"]) & set(lists["answered"]):
            raise ConfigError(f"{where}: 'listeners' names clients that answered")
        skipped = line.get("skipped", False)
        if not isinstance(skipped, bool):
            raise ConfigError(f"{where}: 'skipped' must be true or false")
        return cls(line["round"] - 1, **lists, skipped=skipped)


def uniform(seed: int, *parts: int | str) -> float:
    """A number in ``[0, 1)`` that is a pure function of (seed, parts)."""
    return seeding.derive_seed(seed, *parts) / 2**63


def finish_time(seed: int, round_idx: int, client: int) -> float:
    """The simulated time client ``client`` takes to answer in round ``round_idx`` (over-selection's order)."""
    return uniform(seed, "finish", round_idx, client)


def available_clients(seed: int, round_idx: int, probabilities: Sequence[float]) -> set[int]:
    """The clients reachable in ``round_idx``: client k with probability ``probabilities[k]``."""
    return {k for k, p in enumerate(probabilities) if uniform(seed, "availability", round_idx, k) < p}


def plan_round(
    seed: int,
    round_idx: int,
    num_clients: int,
    per_round: int,
    *,
    available: Iterable[int] | None = None,
    over_selection: float = 0.0,
    min_clients: int = 1,
    broadcast: bool = False,
) -> Participation:
    """The participation of one simulated round.

    Parameters
    ----------
    seed, round_idx, num_clients, per_round
        The run seed, the 0-based round, K and C_k.
    available : iterable of int, optional
        The clients reachable this round (None: all).
    over_selection : float
        Ask ``ceil(C_k (1 + over_selection))`` clients (at most K); keep the first C_k replies by
        :func:`finish_time`.
    min_clients : int
        Fewer replies to keep than this: the round is skipped (nobody trains, the model stays).
    broadcast : bool
        The algorithm broadcasts to all: the reachable clients not asked are the listeners.
    """
    reach = set(range(num_clients)) if available is None else set(available)
    n_ask = min(num_clients, math.ceil(per_round * (1.0 + over_selection) - 1e-9))
    asked = sample_clients(seed, round_idx, num_clients, n_ask)
    answered = [k for k in asked if k in reach]
    by_finish = sorted(answered, key=lambda k: (finish_time(seed, round_idx, k), k))
    kept = sorted(by_finish[:per_round])
    if len(kept) < min_clients:
        return Participation(round_idx, asked, [], [], [], skipped=True)
    listeners = sorted(reach - set(asked)) if broadcast else []
    return Participation(round_idx, asked, answered, kept, listeners)


def read_jsonl(path: Path, key: str) -> list[tuple[int, Any]]:
    """The JSON lines of ``path`` as (line number, value), blank lines skipped.

    Raises
    ------
    ConfigError
        The file is missing, too large, not UTF-8 or has a line that is not JSON (names ``key``, the
        file and the line).
    """
    try:
        size = path.stat().st_size
        if size > MAX_TRACE_BYTES:
            raise ConfigError(f"{key}: {path} is {size} bytes; at most {MAX_TRACE_BYTES} are read")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}; give an existing file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {path} is not UTF-8 text (JSON lines)") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except ValueError:
            raise ConfigError(f"{key}: {path} line {n} is not JSON") from None
    return out


def read_trace(path: Path, num_clients: int, key: str = "train_args.availability_trace") -> list[set[int]]:
    """An availability trace: the reachable clients of rounds 1..n (see the module docstring)."""
    rounds: list[set[int]] = []
    for n, line in read_jsonl(path, key):
        where = f"{key}: {path} line {n}"
        if not isinstance(line, dict) or line.get("round") != len(rounds) + 1:
            raise ConfigError(f'{where}: expected {{"round": {len(rounds) + 1}, "available": [client ids]}}')
        ids = line.get("available")
        if not isinstance(ids, list) or not all(isinstance(k, int) and 0 <= k < num_clients for k in ids):
            raise ConfigError(f"{where}: 'available' must be a list of client ids 0..{num_clients - 1}")
        rounds.append(set(ids))
    if not rounds:
        raise ConfigError(f"{key}: {path} holds no rounds; one JSON line per round is needed")
    return rounds


def read_participation(
    path: Path, num_clients: int, key: str = "train_args.replay_participation"
) -> dict[int, Participation]:
    """A recorded ``participation.jsonl``, by 0-based round (a later line of a round replaces an earlier one)."""
    out: dict[int, Participation] = {}
    for n, line in read_jsonl(path, key):
        rec = Participation.from_json(line, f"{key}: {path} line {n}", num_clients)
        out[rec.round_idx] = rec
    return out


class Planner:
    """Each round's participation for a run: plain sampling, an availability model, or a replay.

    Built from the config's ``train_args`` (:meth:`from_config`); files are read once, here.
    """

    def __init__(
        self,
        seed: int,
        num_clients: int,
        per_round: int,
        *,
        probabilities: Sequence[float] | None = None,
        trace: list[set[int]] | None = None,
        over_selection: float = 0.0,
        min_clients: int = 1,
        replay: dict[int, Participation] | None = None,
        replay_source: str = "",
    ) -> None:
        self.seed, self.num_clients, self.per_round = seed, num_clients, per_round
        self.probabilities = list(probabilities) if probabilities is not None else None
        self.trace = trace
        self.over_selection, self.min_clients = over_selection, min_clients
        self.replay, self.replay_source = replay, replay_source

    @classmethod
    def from_config(cls, cfg: Any) -> Planner:
        """The planner of a validated config (``train_args`` availability, trace, over-selection, replay).

        Raises
        ------
        ConfigError
            A trace or participation file cannot be read or is malformed (names the key, file and line).
        """
        t = cfg.train_args
        k = t.client_num_in_total
        probs = t.availability if isinstance(t.availability, list) else [t.availability]
        probabilities = None
        if any(p < 1.0 for p in probs):
            probabilities = probs * k if len(probs) == 1 else probs
        trace = read_trace(Path(t.availability_trace).expanduser(), k) if t.availability_trace else None
        replay = None
        if t.replay_participation:
            replay = read_participation(Path(t.replay_participation).expanduser(), k)
        return cls(
            cfg.common_args.random_seed,
            k,
            t.client_num_per_round,
            probabilities=probabilities,
            trace=trace,
            over_selection=t.over_selection,
            min_clients=t.min_clients,
            replay=replay,
            replay_source=t.replay_participation,
        )

    @property
    def plain(self) -> bool:
        """True when the planner does what a runtime without one does: the seeded C_k, all answering."""
        return (
            self.probabilities is None
            and self.trace is None
            and self.replay is None
            and self.over_selection == 0
            and self.min_clients <= 1
        )

    def available(self, round_idx: int) -> set[int] | None:
        """The clients reachable in ``round_idx`` (None: all)."""
        if self.trace is not None:
            return self.trace[round_idx % len(self.trace)]
        if self.probabilities is not None:
            return available_clients(self.seed, round_idx, self.probabilities)
        return None

    def plan(self, round_idx: int, broadcast: bool = False) -> Participation:
        """Round ``round_idx``'s participation; ``broadcast``: the algorithm broadcasts to all.

        Raises
        ------
        ConfigError
            A replayed record has no line for the round (names the file and the round).
        """
        if self.replay is not None:
            rec = self.replay.get(round_idx)
            if rec is None:
                raise ConfigError(
                    f"train_args.replay_participation: {self.replay_source} has no line for round {round_idx + 1}; "
                    "replay the participation.jsonl of a run with at least as many rounds"
                )
            return rec
        return plan_round(
            self.seed,
            round_idx,
            self.num_clients,
            self.per_round,
            available=self.available(round_idx),
            over_selection=self.over_selection,
            min_clients=self.min_clients,
            broadcast=broadcast,
        )
