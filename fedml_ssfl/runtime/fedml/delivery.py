"""Delivery to one GRPC peer: an outbox with its own thread, retries with backoff within an outage budget.

The message thread of a process never waits on the network: :meth:`Outbox.put` queues a sealed
envelope and returns. The outbox's thread sends one envelope at a time, in order. A send that
fails for a reason that may pass (the peer is not listening, the network is cut, the call timed
out) is retried with a growing pause (0.5 s doubling to 10 s) until the peer has been unreachable
for the *outage budget* (``FEDML_SSFL_OUTAGE_BUDGET``); then the envelope is given up and the
outbox reports it (:class:`Undelivered`), with the cause :func:`.diagnose.diagnose_peer` found.
A lasting cause (a TLS setting: a certificate expired or for another name, plaintext against TLS)
is reported at once: waiting would not heal it. A retried envelope is the same bytes, so a
receiver that already had it answers "duplicate" (:class:`~.security.Duplicate`) and the outbox
counts it as delivered: every envelope arrives at most once.

A *droppable* envelope (a handshake challenge or hello, which the handshake sends again anyway) is
tried once. An envelope the peer does not take from this process's session (the peer restarted,
or this process is not admitted yet: :class:`~.security.NotAdmitted`) is dropped and reported
(:class:`Unknown`), so that the handshake runs again.

Nothing here imports FedML or gRPC: the transport hands in the function that sends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .diagnose import Cause

log = logging.getLogger(__name__)

FIRST_PAUSE, MAX_PAUSE = 0.5, 10.0
DIAGNOSE_EVERY = 30.0  # seconds between two diagnoses of one peer's failures
FLOOR_BYTES_PER_S = 8192
"""One attempt may last the outage budget plus the envelope's size at 64 kbit/s (then it is retried)."""

DELIVERED_CODES = ("OK", "ALREADY_EXISTS")
UNKNOWN_CODES = ("FAILED_PRECONDITION",)
FINAL_CODES = ("PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNIMPLEMENTED", "UNAUTHENTICATED")


class SendError(Exception):
    """A failed attempt: the gRPC status code's name and the details."""

    def __init__(self, code: str, details: str = ""):
        super().__init__(f"{code}: {details}" if details else code)
        self.code, self.details = code, details


@dataclass
class Item:
    """One envelope in an outbox."""

    envelope: bytes
    label: str  # what it carries, for messages ("round 3's task")
    droppable: bool = False
    budget: float | None = None  # None: the outbox's outage budget
    queued: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Undelivered:
    """An envelope given up: the peer was unreachable for the budget, refused it, or a lasting cause."""

    peer: int
    label: str
    cause: str
    code: str


@dataclass(frozen=True)
class Unknown:
    """The peer does not know this process's session (it restarted, or this one is not admitted yet)."""

    peer: int
    label: str


class Outbox:
    """Envelopes for one peer, sent in order by one thread.

    Parameters
    ----------
    peer : int
        The peer's rank.
    send : callable
        ``send(envelope, timeout)``; raises :class:`SendError`.
    budget : float
        The outage budget in seconds.
    report : callable
        Called (on the outbox's thread) with an :class:`Undelivered` or :class:`Unknown`.
    diagnose : callable
        Returns the :class:`~.diagnose.Cause` of the peer's unreachability (may take seconds).
    """

    def __init__(
        self,
        peer: int,
        send: Callable[[bytes, float], None],
        budget: float,
        report: Callable[[Undelivered | Unknown], None],
        diagnose: Callable[[], Cause],
    ) -> None:
        self.peer, self.send, self.budget, self.report, self.diagnose = peer, send, budget, report, diagnose
        self._items: deque[Item] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self.last_cause = Cause("")
        self.lasting_cause = Cause("")
        self.last_ok = 0.0
        self._diagnosed, self._diagnosed_for = 0.0, ""
        self._thread = threading.Thread(target=self._run, name=f"ssfl-outbox-{peer}", daemon=True)
        self._thread.start()

    # ---- what other threads call ------------------------------------------------------------
    def put(self, item: Item) -> None:
        with self._cond:
            if self._closed:
                return
            self._items.append(item)
            self._cond.notify_all()

    def clear(self) -> int:
        """Drop every queued envelope (not the one being sent); how many were dropped."""
        with self._cond:
            n = len(self._items)
            self._items.clear()
            return n

    def pending(self) -> int:
        with self._cond:
            return len(self._items) + int(self._busy)

    def drain(self, timeout: float) -> bool:
        """Wait until everything queued was sent or given up (at most ``timeout`` s); whether it was."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._items or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.2))
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()

    # ---- the outbox's thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                item = self._items.popleft()
                self._busy = True
            try:
                self._deliver(item)
            except Exception as exc:  # a bug here must not silently stop this peer's deliveries
                log.exception("rank %d's outbox: %s", self.peer, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _pause(self, seconds: float) -> bool:
        """Sleep unless closed; whether the outbox is still open."""
        with self._cond:
            if not self._closed:
                self._cond.wait(seconds)
            return not self._closed

    def _deliver(self, item: Item) -> None:
        budget = self.budget if item.budget is None else item.budget
        attempt_timeout = (min(budget, 30.0) if item.droppable else budget) + len(item.envelope) / FLOOR_BYTES_PER_S
        attempt_timeout = max(attempt_timeout, 5.0)
        pause, first_failure = FIRST_PAUSE, None
        while True:
            try:
                self.send(item.envelope, attempt_timeout)
                code = "OK"
            except SendError as exc:
                code = exc.code
                error = exc
            if code in DELIVERED_CODES:
                self.last_ok = time.monotonic()
                self.last_cause = Cause("")
                return
            if code in UNKNOWN_CODES:
                self.last_ok = time.monotonic()  # it answered: it is up
                self.report(Unknown(self.peer, item.label))
                return
            if code in FINAL_CODES:
                self.report(Undelivered(self.peer, item.label, f"{code}: {error.details}", code))
                return
            now = time.monotonic()
            first_failure = first_failure or now
            cause = self._cause(error, now)
            if cause.lasting:
                self.report(Undelivered(self.peer, item.label, cause.text, code))
                return
            if item.droppable:
                return
            if now - first_failure >= budget:
                tried = f"tried for {now - first_failure:.0f} s" + (
                    f", FEDML_SSFL_OUTAGE_BUDGET {budget:.0f} s" if item.budget is None else ""
                )
                self.report(Undelivered(self.peer, item.label, f"{cause.text} ({tried})", code))
                return
            if not self._pause(min(pause, max(0.0, first_failure + budget - now))):
                return
            pause = min(pause * 2, MAX_PAUSE)

    def _cause(self, error: SendError, now: float) -> Cause:
        """The failure in words: gRPC's code, refined by a diagnosis of the peer (again when gRPC's
        account of the failure changes, else at most every 30 s)."""
        seen = f"{error.code}: {error.details}"
        if now - self._diagnosed >= DIAGNOSE_EVERY or not self.last_cause.text or seen != self._diagnosed_for:
            self._diagnosed, self._diagnosed_for = now, seen
            found = self.diagnose()
            if found.lasting:
                self.lasting_cause = found
            text = found.text or f"{error.code}: {error.details}"
            if error.code == "DEADLINE_EXCEEDED" and not found.text:
                text = f"no answer within the call's deadline ({error.details or 'DEADLINE_EXCEEDED'})"
            self.last_cause = Cause(text, found.lasting)
        return self.last_cause
