"""What the round managers use of a transport: the one interface MPI and GRPC (and a later one) implement.

:mod:`.managers` (the handshake, rounds, faults and the watchdogs, written once for every entry point)
speaks only this to its transport; :mod:`.transports` implements it over FedML's MPI and GRPC
communication managers and registers each in :data:`~.transports.TRANSPORTS`. A new transport is one
class there that implements :class:`Transport` and one entry in that table; the managers, the
runtime, security and progress do not change. What a transport cannot do it says with its
capabilities (:attr:`Transport.liveness`, :attr:`Transport.sessions`, :attr:`Transport.whole_job`),
and the manager skips that part: MPI has no heartbeats (``mpirun`` ends the job when a process
dies) and no sessions (the launcher started every process of the job).

Imports nothing from FedML: the interface is plain Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Transport(Protocol):
    """A FedML comm manager as the round managers use it.

    Capabilities (class attributes)
    -------------------------------
    liveness : bool
        Peers are judged alive by :attr:`heard` (heartbeats, any envelope); the managers' watchdogs
        apply the outage budget and name :meth:`cause_of`. False: the launcher ends a job whose
        process dies (MPI), so nothing is judged.
    sessions : bool
        The transport admits and verifies handshake sessions (:meth:`admit`, :meth:`answer`, a
        verdict marked ``ssfl_verified``); False: every process of the job is the launcher's, and
        every handshake reply is taken as verified.
    whole_job : bool
        :meth:`abort_job` ends every process of the job (``MPI_Abort``); False: each process ends alone.
    """

    liveness: bool
    sessions: bool
    whole_job: bool

    @property
    def heard(self) -> Mapping[int, float]:
        """rank -> when (``time.monotonic``) its admitted session was last heard from (empty without liveness)."""

    @property
    def session(self) -> str:
        """This process's session ("" without sessions)."""

    # FedML's comm-manager calls
    def add_observer(self, observer: Any) -> None: ...

    def send_message(self, msg: Any) -> None:
        """Send (or queue) a FedML message to ``msg.get_receiver_id()``."""

    def handle_receive_message(self) -> None:
        """Deliver received messages to the observers until stopped (the message thread)."""

    def stop_receive_message(self, drain: float = 0.0) -> None:
        """Stop; first wait up to ``drain`` seconds for queued messages to go out (where there is a queue)."""

    # what the managers add
    def inject(self, msg: Any) -> None:
        """Queue a local message (a watchdog's or the transport's verdict) for the message thread."""

    def admit(self, rank: int, session: str) -> str | None:
        """Admit ``rank``'s ``session``; the session it replaces (None: none before)."""

    def admitted(self, rank: int) -> str | None:
        """``rank``'s admitted session (None: not admitted)."""

    def answer(self, challenge: str, session: str) -> bool:
        """A worker may answer ``challenge`` from the server's ``session``: False for one answered before."""

    def clear_outbox(self, rank: int) -> int:
        """Drop what is queued for ``rank`` (a process that restarted); how many messages."""

    def address(self, rank: int) -> tuple[str, int] | None:
        """``rank``'s host and port, for messages (None where a rank has no address)."""

    def cause_of(self, rank: int) -> str:
        """Why ``rank`` is not heard from, in words ("" if nothing is known)."""

    def abort_job(self, reason: str) -> None:
        """End the job now after a failure the run has recorded (a no-op unless :attr:`whole_job`)."""


def at(transport: Transport, rank: int) -> str:
    """`` at host:port`` for a rank with an address ("" otherwise): how messages name a peer."""
    where = transport.address(rank)
    return f" at {where[0]}:{where[1]}" if where is not None else ""
