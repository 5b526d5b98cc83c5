"""Connect-out GRPC: each client dials the server and fetches its tasks on that connection.

Imports FedML (through :mod:`.transports`): import it only when a FedML job starts.

Selected by ``comm_args.connect_out: true`` (with ``comm_args.backend: GRPC``); importing this module
registers it in :data:`~.transports.TRANSPORTS` as ``GRPC_CONNECT_OUT`` (:mod:`.run` does, with the
managers). A phone or a silo behind NAT accepts no
connection, so here only the server listens: the server needs no client's address (the ipconfig CSV
needs only rank 0's row) and a client may start anywhere that reaches the server, with its certificate
(mutual TLS, the job's CA) and the job key. Everything else is :class:`~.transports.QuietGrpcComm`'s:
the same sealed envelopes, sessions, handshake, codec, outboxes and outage budget.

How messages travel (as Flower's SuperNode pulls from its SuperLink):

* client -> server: as under GRPC, ``sendMessage`` calls on the client's channel to the server.
* server -> client: the server's outbox for rank k puts each sealed envelope in rank k's
  :class:`Mailbox`; the client's fetch loop calls ``/ssfl.ConnectOut/fetch`` (a long poll) with a
  *ticket*: an envelope sealed by the client (kind ``h``, so it passes the job key, job id, rank and
  replay checks before any handshake) carrying the number of the last envelope it received and the
  status its transport answered for it (OK, or the refusal's gRPC code: ALREADY_EXISTS for a
  duplicate, FAILED_PRECONDITION for a session it does not know, PERMISSION_DENIED). The server
  answers with the oldest envelope not yet acknowledged (8-byte number + envelope), or, after
  ``FEDML_SSFL_HEARTBEAT_INTERVAL`` seconds with nothing to send, a sealed heartbeat (number 0). An
  envelope counts as sent when its acknowledgement comes back, with the status the client answered:
  the outbox's retries, refusals and outage budget apply unchanged. An envelope whose answer was lost
  is sent again and acknowledged as a duplicate.
* liveness: a client is heard from by its tickets and heartbeats (``sendMessage``); the server by the
  heartbeats and envelopes its fetch answers carry. The server sends no heartbeats of its own (it has
  no client address). A stranger without the CA's certificate fails the TLS handshake; one with a
  certificate but without the job key has its ticket refused (PERMISSION_DENIED), and gets nothing.

Deviations from the GRPC transport: the cause of an unheard client is "has not fetched for N s" (there
is no address to diagnose); an envelope fetched but whose acknowledgement never came back is sent
again after the attempt's timeout (the client drops it as a duplicate).
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import threading
import time
from dataclasses import dataclass, field

import grpc

from .delivery import SendError
from .diagnose import Cause
from .security import BEAT, HELLO, Refused
from .transports import _STATUS, CONNECT_OUT, TRANSPORTS, QuietGrpcComm

log = logging.getLogger(__name__)

SERVICE = "ssfl.ConnectOut"
FETCH = f"/{SERVICE}/fetch"
NUMBER = struct.Struct("<Q")
ACK_CODES = ("OK", "ALREADY_EXISTS", "FAILED_PRECONDITION", "PERMISSION_DENIED")


@dataclass
class Pending:
    """One sealed envelope for a client, until its acknowledgement comes back."""

    number: int
    envelope: bytes
    done: threading.Event = field(default_factory=threading.Event)
    answer: tuple[str, str] = ("", "")


class Mailbox:
    """What the server has for one client, in order (thread-safe; fetches wait on the event loop).

    Cost per message O(1); per client one dict and one future at most (a client's fetch waits on
    one future, never a thread), so memory grows linearly in the clients.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: dict[int, Pending] = {}  # number -> pending, in number order
        self.by_envelope: dict[int, Pending] = {}  # id(envelope) -> pending: an outbox's retry is no new message
        self.number = 0
        self.waiter: asyncio.Future | None = None
        self.fetched = 0.0  # time.monotonic() of the last ticket
        self.lock = threading.Lock()

    def put(self, envelope: bytes) -> Pending:
        """Queue ``envelope`` (the same bytes again: the pending entry it already has)."""
        with self.lock:
            pending = self.by_envelope.get(id(envelope))
            if pending is not None and pending.envelope is envelope:
                return pending
            self.number += 1
            pending = Pending(self.number, envelope)
            self.items[pending.number] = pending
            self.by_envelope[id(envelope)] = pending
            waiter, self.waiter = self.waiter, None
        if waiter is not None:
            self.loop.call_soon_threadsafe(_wake, waiter)
        return pending

    def forget(self, pending: Pending) -> None:
        with self.lock:
            self.items.pop(pending.number, None)
            if self.by_envelope.get(id(pending.envelope)) is pending:
                del self.by_envelope[id(pending.envelope)]

    def ack(self, number: int, code: str, details: str) -> None:
        with self.lock:
            pending = self.items.pop(number, None)
            if pending is not None and self.by_envelope.get(id(pending.envelope)) is pending:
                del self.by_envelope[id(pending.envelope)]
        if pending is not None:
            pending.answer = (code, details)
            pending.done.set()

    def clear(self) -> int:
        with self.lock:
            n = len(self.items)
            dropped = list(self.items.values())
            self.items.clear()
            self.by_envelope.clear()
        for pending in dropped:
            pending.answer = ("FAILED_PRECONDITION", "dropped: the client restarted")
            pending.done.set()
        return n

    def first(self) -> Pending | None:
        with self.lock:
            return next(iter(self.items.values()), None)

    async def take(self, wait: float) -> Pending | None:
        """The oldest unacknowledged envelope, waiting up to ``wait`` s for one (None: none came)."""
        pending = self.first()
        if pending is not None:
            return pending
        fut = self.loop.create_future()
        with self.lock:
            self.waiter = fut
        pending = self.first()  # put() between first() and the waiter: seen now
        if pending is None:
            try:
                await asyncio.wait_for(fut, wait)
            except TimeoutError:
                pass
            pending = self.first()
        with self.lock:
            if self.waiter is fut:
                self.waiter = None
        return pending


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class ConnectOutComm(QuietGrpcComm):
    """:class:`~.transports.QuietGrpcComm` where only the server listens and clients fetch their
    messages (module docstring). A :class:`~.transport.Transport` with liveness and sessions."""

    liveness, sessions, whole_job = True, True, False

    # ---- the server's side ----------------------------------------------------------------------
    def _start_server(self, address: str) -> None:
        if self.client_rank != 0:  # a client listens nowhere: it fetches
            self._loop = asyncio.new_event_loop()  # never run (stop_receive_message checks)
            self.grpc_servicer = _NoServicer()
            self._acked = 0
            self._answer = ("OK", "")
            self._fetcher = threading.Thread(target=self._fetch_loop, name="ssfl-fetch", daemon=True)
            self._fetcher.start()
            return
        self.mailboxes: dict[int, Mailbox] = {}
        super()._start_server(address)

    def extra_handlers(self) -> tuple:
        if self.client_rank != 0:
            return ()
        handler = grpc.unary_unary_rpc_method_handler(self._fetch)  # bytes in, bytes out
        return (grpc.method_handlers_generic_handler(SERVICE, {"fetch": handler}),)

    def mailbox(self, rank: int) -> Mailbox:
        with self._lock:
            box = self.mailboxes.get(rank)
            if box is None:
                box = self.mailboxes[rank] = Mailbox(self._loop)
            return box

    async def _fetch(self, ticket: bytes, context) -> bytes:
        """One long poll of a client: acknowledge what it says it received, answer the next envelope."""
        loop = asyncio.get_running_loop()
        try:
            sender, answer = await loop.run_in_executor(self.grpc_servicer.pool, self._open_ticket, ticket)
        except Refused as exc:
            log.warning("rank 0 refused a fetch from %s: %s", context.peer(), exc)
            await context.abort(_STATUS[exc.code], f"rank 0 refused the fetch: {exc}")
        box = self.mailbox(sender)
        box.fetched = time.monotonic()
        number, code, details = answer
        if number:
            box.ack(number, code, details)
        pending = await box.take(self.limits.heartbeat)
        if pending is not None:
            return NUMBER.pack(pending.number) + pending.envelope
        return NUMBER.pack(0) + self.sealer.seal(sender, b"", BEAT)

    def _open_ticket(self, ticket: bytes) -> tuple[int, tuple[int, str, str]]:
        opened = self.opener.open(ticket)
        if opened.kind != HELLO:
            raise Refused("a fetch ticket must be a handshake envelope")
        if self.opener.session_of(opened.sender) == opened.session:
            self.heard[opened.sender] = time.monotonic()
        try:
            body = json.loads(bytes(opened.payload))
            answer = (int(body["ack"]), str(body["code"]), str(body.get("details", ""))[:500])
        except (ValueError, KeyError, TypeError):
            raise Refused("a fetch ticket that does not decode") from None
        if answer[1] not in ACK_CODES:
            raise Refused(f"a fetch ticket with an unknown status {answer[1]!r}")
        return opened.sender, answer

    def _send_to(self, receiver: int):
        if self.client_rank != 0:
            return super()._send_to(receiver)

        def send(envelope: bytes, timeout: float) -> None:
            box = self.mailbox(receiver)
            pending = box.put(envelope)
            if not pending.done.wait(timeout):
                box.forget(pending)  # the retry queues it again; a copy fetched meanwhile is a duplicate
                raise SendError("UNAVAILABLE", f"rank {receiver} did not fetch it within {timeout:.0f} s")
            code, details = pending.answer
            if code != "OK":
                raise SendError(code, details)

        return send

    def clear_outbox(self, receiver: int) -> int:
        n = super().clear_outbox(receiver)
        if self.client_rank == 0:
            n += self.mailbox(receiver).clear()
        return n

    def address(self, rank: int) -> tuple[str, int] | None:
        if self.client_rank == 0 and rank != 0:
            return None  # clients connect out: the server knows no client's address
        return super().address(rank)

    def diagnose(self, rank: int) -> Cause:
        if self.client_rank == 0:
            box = self.mailboxes.get(rank)
            if box is None or not box.fetched:
                return Cause(f"rank {rank} has not connected (it connects out to the server)")
            return Cause(f"rank {rank} has not fetched for {time.monotonic() - box.fetched:.0f} s (it connects out)")
        return super().diagnose(rank)

    def _beat_loop(self) -> None:
        if self.client_rank != 0:
            super()._beat_loop()  # the server's beats travel in the fetch answers

    # ---- the client's side ------------------------------------------------------------------
    def _fetch_loop(self) -> None:
        """Fetch the server's envelopes one at a time, acknowledging each in the next ticket."""
        while not self._stopping.is_set():
            number, code, details = self._acked, *self._answer
            ticket = self.sealer.seal(0, json.dumps({"ack": number, "code": code, "details": details}).encode(), HELLO)
            try:
                stub = self._stub(0)
                data = self._fetch_call(stub)(ticket, timeout=self.limits.heartbeat + 30.0)
            except grpc.RpcError as exc:
                if self._stopping.is_set():
                    return
                self.beat_cause[0] = f"{exc.code().name}: {exc.details() or ''}"
                self._stopping.wait(1.0)
                continue
            except ValueError:  # a closed channel: stopped, or dropped (the next call opens another)
                if self._stopping.is_set():
                    return
                self._stopping.wait(1.0)
                continue
            got = NUMBER.unpack_from(data)[0]
            envelope = data[NUMBER.size :]
            if got == 0:  # the server's heartbeat: counts once its session is admitted
                if self.opener.session_of(0) is not None:
                    try:
                        self.receive(envelope, "the server's fetch answer")
                    except Refused:
                        pass
                continue
            answer = ("OK", "")
            try:
                self.receive(envelope, "the server's fetch answer")
            except Refused as exc:
                answer = (exc.code, str(exc))
            self._acked, self._answer = got, answer

    def _fetch_call(self, stub):
        channel = self._channels[0][0]
        call = getattr(self, "_fetch_rpc", None)
        if call is None or self._fetch_channel is not channel:
            self._fetch_channel = channel
            call = self._fetch_rpc = channel.unary_unary(FETCH)
        return call


def _build(manager) -> ConnectOutComm:
    return ConnectOutComm(
        grpc_ipconfig_path=manager.args.grpc_ipconfig_path,
        client_rank=manager.rank,
        client_num=manager.size,
        args=manager.args,
        meter=manager.meter,
        limits=manager.limits,
    )


TRANSPORTS[CONNECT_OUT] = _build


class _NoServicer:
    """A client's stand-in for the servicer: nothing to serve, only a pool to shut down."""

    class pool:  # noqa: N801 - the attribute QuietGrpcComm.stop_receive_message shuts down
        @staticmethod
        def shutdown(wait: bool = False) -> None:
            return None
