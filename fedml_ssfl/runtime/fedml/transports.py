"""FedML's MPI and GRPC transports, subclassed: sealed GRPC envelopes over TLS, outboxes, heartbeats.

Imports FedML: import it only when a FedML job starts.

Both implement :class:`~.transport.Transport`, all the round managers use of a transport, and are
registered in :data:`TRANSPORTS` by ``comm_args.backend``: a transport added later is a class here
and an entry there (docs/architecture.md, "The FedML runtime's seam").

The GRPC transport (:class:`QuietGrpcComm`):

* *receives* on gRPC's asyncio server, in a thread of its own: a request waiting for its bytes holds
  no thread, so requests that never finish cannot starve the others; gRPC refuses a message over the
  byte cap from its length prefix, before reading it (``grpc.max_receive_message_length``). Each
  envelope is opened (:mod:`.security`) off the event loop; handshake envelopes are decoded at once
  (a worker accepts the server's *welcome* before the next message can arrive), the others by the
  message thread. Any failure to decode drops the message with one line naming the peer.
* *sends* through one :class:`~.delivery.Outbox` per peer: the message thread only queues, the
  server's messages to the workers go out concurrently, each is retried within the outage budget.
* *beats*: every ``FEDML_SSFL_HEARTBEAT_INTERVAL`` seconds a heartbeat envelope goes to every peer
  whose session this process admitted, on the same channel; :attr:`QuietGrpcComm.heard` is when each
  peer's admitted session was last heard from (any envelope), which is what liveness is judged on.
  gRPC keepalive pings find a dead connection in about 30 s, and the channel reconnects.

What the transport learns (an envelope given up, a peer that does not know this process's session)
reaches the manager as a local message of type :data:`TRANSPORT` in the receive queue, so verdicts
never wait on a send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sys
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2, grpc_comm_manager_pb2_grpc
from fedml.core.distributed.communication.grpc.grpc_comm_manager import GRPCCommManager, GRPCMapping
from fedml.core.distributed.communication.message import Message as FedMessage
from fedml.core.distributed.communication.mpi.com_manager import MpiCommunicationManager
from fedml.cross_silo.server.message_define import MyMessage

from ...config import ConfigError
from ...errors import error_line
from . import wire
from .delivery import Item, Outbox, SendError, Undelivered, Unknown
from .diagnose import Cause, diagnose_peer
from .launch import port_in_use
from .security import (
    BEAT,
    HELLO,
    MAX_HEADER_BYTES,
    MESSAGE,
    Duplicate,
    JobSecurity,
    NotAdmitted,
    Opened,
    Opener,
    Refused,
    Sealer,
)
from .wire import WireMeter

log = logging.getLogger(__name__)

TRANSPORT = "ssfl_transport"
"""A local message from the transport to its manager (params ``event``, ``peer``, ``label``, ``cause``)."""
WATCHDOG = "ssfl_watchdog"
"""A local message from a manager's watchdog thread to its message thread (a verdict, a check, a hello)."""
WELCOME = "ssfl_welcome"
"""Server -> worker: the worker's ONLINE answered this challenge; its session is admitted."""
CHALLENGE, CLIENT_SESSION, VERIFIED = "ssfl_challenge", "ssfl_client_session", "ssfl_verified"
SESSION, KIND = "ssfl_session", "ssfl_kind"
"""Set by the receiving transport on every message: the envelope's session and kind (a peer's own
values for these keys are overwritten)."""
MEMBERSHIP, PROOF, REFUSED, FAILED = "ssfl_membership", "ssfl_proof", "ssfl_refused", "ssfl_failed"
LOCAL_TYPES = frozenset({TRANSPORT, WATCHDOG, MyMessage.MSG_TYPE_CONNECTION_IS_READY})
"""Message types a process says only to itself (its transport's and watchdog's verdicts): never taken from a peer."""

ENVELOPE_BYTES = 4 + 16 + MAX_HEADER_BYTES + 32  # magic, length, header, tag: over the payload's limit
GRPC_MAX_BYTES = 2**31 - 1  # protobuf and gRPC carry no more in one message
FINISHED_BUDGET = 10.0  # a worker's last status: the server may be gone already

_STATUS = {
    name: getattr(grpc.StatusCode, name) for name in ("PERMISSION_DENIED", "FAILED_PRECONDITION", "ALREADY_EXISTS")
}


def grpc_byte_cap(limit: int) -> int:
    """The bytes gRPC reads of one envelope at most: ``FEDML_SSFL_MAX_MESSAGE_BYTES`` plus the envelope,
    never more than gRPC's 2 GiB - 1."""
    return min(limit + ENVELOPE_BYTES, GRPC_MAX_BYTES)


class QuietMpiComm(MpiCommunicationManager):
    """FedML's MPI transport, waiting on its queue instead of spinning (frees a core).

    As a :class:`~.transport.Transport`: no liveness (``mpirun`` ends a job whose process dies), no
    sessions (every process is the launcher's), and :meth:`abort_job` ends the whole job.
    """

    liveness, sessions, whole_job = False, False, True
    session = ""

    @property
    def heard(self) -> dict[int, float]:
        return {}

    def stop_receive_message(self, drain: float = 0.0):
        super().stop_receive_message()  # MPI sends synchronously: nothing queued to wait for

    def admit(self, rank: int, session: str) -> str | None:
        return session

    def admitted(self, rank: int) -> str | None:
        return ""

    def answer(self, challenge: str, session: str) -> bool:
        return True

    def clear_outbox(self, rank: int) -> int:
        return 0

    def address(self, rank: int) -> tuple[str, int] | None:
        return None

    def cause_of(self, rank: int) -> str:
        return ""

    def abort_job(self, reason: str) -> None:
        """A rank that never answers (stalled) would hold every process in ``MPI_Finalize``: end them all."""
        sys.stderr.write(error_line(reason) + "\n")
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

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
    """FedML's GRPC service on gRPC's asyncio server: envelopes are opened off the event loop."""

    def __init__(self, comm: QuietGrpcComm):
        self.comm = comm
        self.pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="ssfl-open")

    async def sendMessage(self, request, context):
        peer = context.peer()
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.pool, self.comm.receive, request.message, peer)
        except Refused as exc:
            await context.abort(_STATUS[exc.code], f"rank {self.comm.client_rank} dropped the message: {exc}")
        return grpc_comm_manager_pb2.CommResponse()


class QuietGrpcComm(GRPCCommManager):
    """FedML's GRPC transport over sealed envelopes (TLS, the job key), with outboxes, heartbeats and
    byte counts. Replaces FedML's ``__init__`` (the server: asyncio, TLS, no port sharing, the byte
    cap), ``send_message``, ``message_handling_subroutine`` and ``stop_receive_message``.

    As a :class:`~.transport.Transport`: liveness from :attr:`heard`, sessions admitted by the
    :class:`~.security.Opener`; each process ends alone."""

    liveness, sessions, whole_job = True, True, False

    def __init__(self, *, grpc_ipconfig_path, client_rank, client_num, args, meter: WireMeter, limits):
        self.meter, self.limits = meter, limits
        self._channels: dict[int, Any] = {}
        self._channel_lock = threading.Lock()
        self._topic, self._observers = "fedml", []
        self.grpc_ipconfig_path, self.args = grpc_ipconfig_path, args
        self.grpc_mappings: dict[int, Any] = {}
        self.client_rank = self.client_id = client_rank
        self.client_num = client_num
        self.node_type = "server" if client_rank == 0 else "client"
        self._init_grpc_mappings()
        self.security: JobSecurity = args.ssfl_security
        self.byte_cap = grpc_byte_cap(wire.max_message_bytes())
        self.opts = [
            ("grpc.max_send_message_length", self.byte_cap),
            ("grpc.max_receive_message_length", self.byte_cap),
            ("grpc.enable_http_proxy", 0),
            # a peer that comes up late is reached within 2 s (gRPC's default backoff grows to 2 min)
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 2000),
            # a connection that died silently (a cut link) is found by pings and replaced
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        if self.security.tls is not None and self.security.tls.server_name:
            self.opts.append(("grpc.ssl_target_name_override", self.security.tls.server_name))
        self.peers = {0} if client_rank else set(self.grpc_mappings) - {0}
        self.sealer = Sealer(self.security, client_rank)
        self.opener = Opener(self.security, client_rank, self.peers, self.byte_cap)
        self.message_q: queue.Queue = queue.Queue()
        self.heard: dict[int, float] = {}  # rank -> when its admitted session was last heard from
        self.answered: dict[str, str] = {}  # worker: challenge -> the server session that sent it
        self.welcomed: set[str] = set()
        self._outboxes: dict[int, Outbox] = {}
        self._beating: set[int] = set()
        self.beat_cause: dict[int, str] = {}
        self._quiet: set[tuple[int, str]] = set()  # (rank, session) already logged as not admitted
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        me = self.grpc_mappings[client_rank]
        self._start_server(f"{me.grpc_server_ip}:{me.grpc_server_port}")
        self._beats = threading.Thread(target=self._beat_loop, name="ssfl-heartbeat", daemon=True)
        self._beats.start()
        self.is_running = True

    # ---- the server (receiving) -----------------------------------------------------------------
    def _start_server(self, address: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="ssfl-grpc-server", daemon=True)
        self._loop_thread.start()
        self.grpc_servicer = SealedServicer(self)
        tls = self.security.tls
        options = [
            *self.opts,
            ("grpc.so_reuseport", 0),  # a second process cannot share the port
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
            ("grpc.http2.max_ping_strikes", 0),
        ]

        async def start():
            server = grpc.aio.server(options=options)
            grpc_comm_manager_pb2_grpc.add_gRPCCommManagerServicer_to_server(self.grpc_servicer, server)
            server.add_generic_rpc_handlers(self.extra_handlers())
            if tls is None:
                bound = server.add_insecure_port(address)
            else:
                creds = grpc.ssl_server_credentials([(tls.key, tls.cert)], tls.ca, require_client_auth=True)
                bound = server.add_secure_port(address, creds)
            if not bound:
                raise RuntimeError(f"cannot bind {address}")
            await server.start()
            return server

        try:
            self.grpc_server = asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=60)
        except RuntimeError:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise port_in_use(self.client_rank, address) from None

    def extra_handlers(self) -> tuple:
        """gRPC handlers a subclass serves besides FedML's ``sendMessage`` (:mod:`.connect_out`'s fetch)."""
        return ()

    def receive(self, data: bytes, peer: str) -> None:
        """Open one envelope (a gRPC handler's thread): queue what it carries, or raise :class:`Refused`."""
        try:
            opened = self.opener.open(data)
        except NotAdmitted as exc:
            self._log_not_admitted(peer, exc)
            raise
        except Duplicate as exc:
            log.warning("rank %d dropped a message from %s: %s", self.client_rank, peer, exc)
            raise
        except Refused as exc:
            log.warning("rank %d dropped a message from %s: %s", self.client_rank, peer, exc)
            raise
        if opened.kind != HELLO:
            self.heard[opened.sender] = time.monotonic()
        if opened.kind == BEAT:
            return
        if opened.kind == MESSAGE:
            self.message_q.put((opened, peer))
            return
        msg = self._decode(opened, peer)  # a handshake message: small, decoded at once
        if msg is None:
            raise Refused("a handshake message that does not decode")
        self._on_hello(opened, msg)
        self.message_q.put(msg)

    def _log_not_admitted(self, peer: str, exc: NotAdmitted) -> None:
        key = (peer, str(exc))
        if key not in self._quiet:  # once per peer and session: a restarted peer sends several
            self._quiet.add(key)
            log.warning("rank %d dropped a message from %s: %s", self.client_rank, peer, exc)

    def _decode(self, opened: Opened, peer: str) -> FedMessage | None:
        """The FedML message in an envelope, annotated with its session and kind; None (and one line
        naming the peer) for bytes that do not decode, whatever the error."""
        try:
            msg = self.meter.loads(opened.payload)
            claimed = int(msg.get_sender_id())
            msg.get_type()
        except Exception as exc:  # nothing was built from the bytes: drop them, say so
            log.warning(
                "rank %d dropped a message from %s (rank %d) it could not decode: %s: %s",
                self.client_rank,
                peer,
                opened.sender,
                type(exc).__name__,
                exc,
            )
            return None
        if claimed != opened.sender:
            log.warning(
                "rank %d dropped a message from %s: sealed by rank %d, claims rank %d",
                self.client_rank,
                peer,
                opened.sender,
                claimed,
            )
            return None
        if msg.get_type() in LOCAL_TYPES:
            log.warning(
                "rank %d dropped a message from %s (rank %d) of type %r, which only this process may send",
                self.client_rank,
                peer,
                opened.sender,
                msg.get_type(),
            )
            return None
        msg.add_params(SESSION, opened.session)
        msg.add_params(KIND, opened.kind)
        return msg

    def _on_hello(self, opened: Opened, msg: FedMessage) -> None:
        """A worker accepts the server's verdict on its handshake (welcome or refusal) here, before the
        next envelope can arrive: only for a challenge it answered, from the session that sent it, and
        naming this process's session; a welcome admits that server session."""
        if self.client_rank == 0:
            return
        kind = msg.get_type()
        if kind not in (WELCOME, MyMessage.MSG_TYPE_S2C_FINISH):
            return
        challenge = msg.get(CHALLENGE)
        with self._lock:
            ok = (
                isinstance(challenge, str)
                and self.answered.get(challenge) == opened.session
                and msg.get(CLIENT_SESSION) == self.sealer.session
                and challenge not in self.welcomed
            )
            if ok:
                self.welcomed.add(challenge)
        if ok and kind == WELCOME:
            self.admit(opened.sender, opened.session)
        msg.add_params(VERIFIED, ok)

    # ---- the handshake's state ------------------------------------------------------------------
    def admit(self, rank: int, session: str) -> str | None:
        """Admit ``rank``'s ``session`` (the one before it is no longer heard); the session it replaces."""
        before = self.opener.admit(rank, session)
        self.heard[rank] = time.monotonic()
        return before

    def answer(self, challenge: str, session: str) -> bool:
        """A worker is about to answer ``challenge`` from the server's ``session``: False if it answered
        that challenge before (a replayed challenge is not answered twice)."""
        with self._lock:
            if challenge in self.answered:
                return False
            self.answered[challenge] = session
            return True

    def admitted(self, rank: int) -> str | None:
        return self.opener.session_of(rank)

    @property
    def session(self) -> str:
        return self.sealer.session

    def abort_job(self, reason: str) -> None:
        pass  # each GRPC process ends alone (its manager stops the transport)

    # ---- sending ----------------------------------------------------------------------------
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

    def address(self, rank: int) -> tuple[str, int]:
        m = self.grpc_mappings[rank]
        return m.ingress_ip or m.grpc_server_ip, int(m.grpc_server_port)

    def _stub(self, receiver: int):
        with self._channel_lock:
            if receiver not in self._channels:
                host, port = self.address(receiver)
                channel = self.channel(f"{host}:{port}")
                self._channels[receiver] = (channel, grpc_comm_manager_pb2_grpc.gRPCCommManagerStub(channel))
            return self._channels[receiver][1]

    def _request(self, envelope: bytes):
        request = grpc_comm_manager_pb2.CommRequest()
        request.client_id = self.client_id
        request.message = envelope
        return request

    def _send_to(self, receiver: int):
        def send(envelope: bytes, timeout: float) -> None:
            try:
                self._stub(receiver).sendMessage(self._request(envelope), timeout=timeout)
            except grpc.RpcError as exc:
                raise SendError(exc.code().name, exc.details() or "") from None

        return send

    def outbox(self, receiver: int) -> Outbox:
        with self._lock:
            box = self._outboxes.get(receiver)
            if box is None:
                box = Outbox(
                    receiver,
                    self._send_to(receiver),
                    self.limits.outage,
                    self._report,
                    lambda: self.diagnose(receiver),
                )
                self._outboxes[receiver] = box
            return box

    def diagnose(self, rank: int) -> Cause:
        host, port = self.address(rank)
        return diagnose_peer(host, port, self.security.tls, timeout=10.0)

    def cause_of(self, rank: int) -> str:
        """Why ``rank`` is not heard from: a lasting cause or the last failed send's (its outbox's), else
        a diagnosis of its port now, else what the last heartbeat to it met ("" if nothing failed)."""
        box = self._outboxes.get(rank)
        for cause in (box.lasting_cause, box.last_cause) if box is not None else ():
            if cause.text:
                return cause.text
        return self.diagnose(rank).text or self.beat_cause.get(rank, "")

    def send_message(self, msg):
        m = self.grpc_mappings[self.client_id]
        msg.add_params(GRPCCommManager.MSG_ARG_KEY_SENDER_RANK, self.client_rank)
        msg.add_params(GRPCCommManager.MSG_ARG_KEY_SENDER_IP, m.ingress_ip or m.grpc_server_ip)
        msg.add_params(GRPCCommManager.MSG_ARG_KEY_SENDER_PORT, m.grpc_server_port)
        kind, droppable, budget = delivery_of(msg)
        receiver = int(msg.get_receiver_id())
        data = self.meter.dumps(msg)
        envelope = self.sealer.seal(receiver, data, kind)
        self.outbox(receiver).put(Item(envelope, label_of(msg), droppable, budget))

    def clear_outbox(self, receiver: int) -> int:
        box = self._outboxes.get(receiver)
        return box.clear() if box is not None else 0

    def _report(self, event: Undelivered | Unknown) -> None:
        msg = FedMessage(TRANSPORT, self.client_rank, self.client_rank)
        msg.add_params("event", "unknown" if isinstance(event, Unknown) else "undelivered")
        msg.add_params("peer", event.peer)
        msg.add_params("label", event.label)
        if isinstance(event, Undelivered):
            msg.add_params("cause", event.cause)
            msg.add_params("code", event.code)
        self.inject(msg)

    # ---- heartbeats -----------------------------------------------------------------------------
    def _beat_loop(self) -> None:
        interval = self.limits.heartbeat
        while not self._stopping.wait(interval):
            for peer in list(self.opener.admitted):
                with self._lock:
                    if peer in self._beating:
                        continue
                    self._beating.add(peer)
                try:
                    envelope = self.sealer.seal(peer, b"", BEAT)
                    call = self._stub(peer).sendMessage.future(self._request(envelope), timeout=max(30.0, 4 * interval))
                    call.add_done_callback(lambda f, p=peer: self._beat_done(p, f))
                except Exception as exc:  # a closing channel: the next beat tries again
                    self._beating.discard(peer)
                    self.beat_cause[peer] = str(exc)

    def _beat_done(self, peer: int, call) -> None:
        self._beating.discard(peer)
        if self._stopping.is_set():
            return
        try:
            call.result()
            self.beat_cause.pop(peer, None)
        except grpc.RpcError as exc:
            code = exc.code().name
            if code == "FAILED_PRECONDITION":
                self._report(Unknown(peer, "a heartbeat"))
            else:
                self.beat_cause[peer] = f"{code}: {exc.details() or ''}"
        except Exception as exc:
            self.beat_cause[peer] = str(exc)

    # ---- the message thread -----------------------------------------------------------------
    def message_handling_subroutine(self):
        while self.is_running:
            try:
                item = self.message_q.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(item, FedMessage):
                msg = item
            else:
                opened, peer = item
                msg = self._decode(opened, peer)
                if msg is None:
                    continue
            for observer in self._observers:
                observer.receive_message(msg.get_type(), msg)

    def inject(self, msg) -> None:
        self.message_q.put(msg)

    def drain(self, timeout: float) -> bool:
        """Wait until every outbox has sent or given up what it holds (at most ``timeout`` s in all)."""
        deadline = time.monotonic() + timeout
        return all(box.drain(max(0.0, deadline - time.monotonic())) for box in list(self._outboxes.values()))

    def stop_receive_message(self, drain: float = 0.0):
        if drain > 0:
            self.drain(drain)
        self._stopping.set()
        for box in list(self._outboxes.values()):
            box.close()
        with self._channel_lock:
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()
        if self._loop.is_running():
            with contextlib.suppress(Exception):  # calls in flight (a worker's last status) may complete
                asyncio.run_coroutine_threadsafe(self.grpc_server.stop(2.0), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self.grpc_servicer.pool.shutdown(wait=False)
        self.is_running = False


def delivery_of(msg) -> tuple[str, bool, float | None]:
    """How a message travels: its envelope kind, whether it is tried once, its own budget (None: the
    outage budget)."""
    kind = msg.get_type()
    if kind == MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS:
        return HELLO, True, None
    if kind == MyMessage.MSG_TYPE_C2S_CLIENT_STATUS:
        if msg.get(MyMessage.MSG_ARG_KEY_CLIENT_STATUS) == "ONLINE":
            return HELLO, True, None
        return MESSAGE, False, FINISHED_BUDGET
    if kind == WELCOME:
        return HELLO, False, None
    if kind == MyMessage.MSG_TYPE_S2C_FINISH:
        return (HELLO, False, FINISHED_BUDGET) if msg.get(REFUSED) else (MESSAGE, False, None)
    return MESSAGE, False, None


_NAMES = {
    MyMessage.MSG_TYPE_S2C_INIT_CONFIG: "the first task",
    MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT: "a task",
    MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER: "a reply",
    MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS: "a handshake challenge",
    MyMessage.MSG_TYPE_C2S_CLIENT_STATUS: "a status",
    MyMessage.MSG_TYPE_S2C_FINISH: "the stop notice",
    WELCOME: "the handshake's welcome",
}


def label_of(msg) -> str:
    """What a message carries, in words, for the messages that name it."""
    text = _NAMES.get(msg.get_type(), str(msg.get_type()))
    payload = msg.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)
    if isinstance(payload, dict):
        payload = payload.get("ssfl", payload)
    r = getattr(payload, "round", None)
    if isinstance(r, int) and not isinstance(r, bool):
        text += f" of round {r + 1}"
    return text


def _mpi(manager) -> QuietMpiComm:
    return QuietMpiComm(manager.comm, manager.rank, manager.size)


def _grpc(manager) -> QuietGrpcComm:
    return QuietGrpcComm(
        grpc_ipconfig_path=manager.args.grpc_ipconfig_path,
        client_rank=manager.rank,
        client_num=manager.size,
        args=manager.args,
        meter=manager.meter,
        limits=manager.limits,
    )


CONNECT_OUT = "GRPC_CONNECT_OUT"
"""The transport of ``comm_args.backend: GRPC`` with ``comm_args.connect_out: true``: :mod:`.connect_out`
registers it here when imported (:mod:`.run` imports it with the managers; it subclasses
:class:`QuietGrpcComm`, so this module cannot import it)."""

TRANSPORTS: dict[str, Any] = {"MPI": _mpi, "GRPC": _grpc}
"""``comm_args.backend`` (``GRPC_CONNECT_OUT``: GRPC with ``comm_args.connect_out``) -> a function of the
manager building its :class:`~.transport.Transport`."""


def transport_name(manager) -> str:
    """The :data:`TRANSPORTS` entry of a manager's job."""
    if manager.backend == "GRPC" and getattr(manager.args, "ssfl_connect_out", False):
        return CONNECT_OUT
    return manager.backend


def make_comm(manager) -> None:
    """Install the backend's transport on a FedML comm manager (called from ``_init_manager``)."""
    build = TRANSPORTS.get(transport_name(manager))
    if build is None:
        raise ConfigError(f"comm_args.backend {manager.backend}: only MPI and GRPC are supported")
    manager.com_manager = build(manager)
    manager.com_manager.add_observer(manager)
