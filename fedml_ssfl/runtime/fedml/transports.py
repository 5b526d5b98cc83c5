"""FedML's MPI and GRPC transports, subclassed: blocking waits, sealed GRPC envelopes, TLS, byte counts.

Imports FedML: import it only when a FedML job starts.
"""

from __future__ import annotations

import contextlib
import logging
import queue
from concurrent import futures
from typing import Any

import grpc
from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2, grpc_comm_manager_pb2_grpc
from fedml.core.distributed.communication.grpc.grpc_comm_manager import GRPCCommManager, GRPCMapping
from fedml.core.distributed.communication.message import Message as FedMessage
from fedml.core.distributed.communication.mpi.com_manager import MpiCommunicationManager
from fedml.cross_silo.server.message_define import MyMessage

from ...config import ConfigError
from . import wire
from .launch import port_in_use
from .security import (
    JobSecurity,
    Opener,
    Refused,
    Sealer,
)
from .wire import WireError, WireMeter

log = logging.getLogger(__name__)


class DeliveryError(ConnectionError):
    """A GRPC message could not be delivered to ``receiver`` (its process died, or the network)."""

    def __init__(self, text: str, receiver: int, address: str, code: str):
        super().__init__(text)
        self.receiver, self.address, self.code = receiver, address, code


class QuietMpiComm(MpiCommunicationManager):
    """FedML's MPI transport, waiting on its queue instead of spinning (frees a core)."""

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
    """FedML's GRPC service, opening envelopes (:mod:`.security`) before anything is queued."""

    def __init__(self, opener: Opener, rank: int):
        self.opener, self.rank = opener, rank
        self.message_q: queue.Queue = queue.Queue()

    def sendMessage(self, request, context):
        try:
            sender, payload = self.opener.open(request.message)
        except Refused as exc:
            log.warning("rank %d dropped a message from %s: %s", self.rank, context.peer(), exc)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"rank {self.rank} dropped the message: {exc}")
        self.message_q.put((sender, payload, context.peer()))
        return grpc_comm_manager_pb2.CommResponse()


class QuietGrpcComm(GRPCCommManager):
    """FedML's GRPC transport over sealed envelopes (TLS, the job key), with blocking waits, cached
    channels, wait-for-ready sends and byte counts. Replaces FedML's ``__init__`` (server creation:
    TLS, no port sharing), ``send_message``, ``message_handling_subroutine`` and ``stop_receive_message``."""

    def __init__(self, *, grpc_ipconfig_path, client_rank, client_num, args, meter: WireMeter, connect_timeout):
        self.meter, self.connect_timeout = meter, connect_timeout
        self._channels: dict[int, Any] = {}
        self._topic, self._observers = "fedml", []
        self.grpc_ipconfig_path, self.args = grpc_ipconfig_path, args
        self.grpc_mappings: dict[int, Any] = {}
        self.client_rank = self.client_id = client_rank
        self.client_num = client_num
        self.node_type = "server" if client_rank == 0 else "client"
        self._init_grpc_mappings()
        self.security: JobSecurity = args.ssfl_security
        limit = wire.max_message_bytes()
        # up to twice the limit is read and dropped by name; gRPC itself refuses more
        grpc_limit = min(2 * limit, 2**31 - 1)
        self.opts = [
            ("grpc.max_send_message_length", grpc_limit),
            ("grpc.max_receive_message_length", grpc_limit),
            ("grpc.enable_http_proxy", 0),
            # a peer that comes up late is reached within 2 s (gRPC's default backoff grows to 2 min)
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if self.security.tls is not None and self.security.tls.server_name:
            self.opts.append(("grpc.ssl_target_name_override", self.security.tls.server_name))
        peers = {0} if client_rank else set(self.grpc_mappings) - {0}
        self.sealer = Sealer(self.security, client_rank)
        self.grpc_servicer = SealedServicer(Opener(self.security, client_rank, peers, limit), client_rank)
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max(2, client_num)),
            options=[*self.opts, ("grpc.so_reuseport", 0)],  # a second process cannot share the port
        )
        grpc_comm_manager_pb2_grpc.add_gRPCCommManagerServicer_to_server(self.grpc_servicer, self.grpc_server)
        me = self.grpc_mappings[client_rank]
        address = f"{me.grpc_server_ip}:{me.grpc_server_port}"
        tls = self.security.tls
        try:
            if tls is None:
                self.grpc_server.add_insecure_port(address)
            else:
                creds = grpc.ssl_server_credentials([(tls.key, tls.cert)], tls.ca, require_client_auth=True)
                self.grpc_server.add_secure_port(address, creds)
        except RuntimeError:
            raise port_in_use(client_rank, address) from None
        self.grpc_server.start()
        self.is_running = True

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

    def renew_channel(self, receiver: int) -> None:
        """Drop the channel to ``receiver``; the next message opens a fresh one.

        For a peer that has just spoken: a channel whose earlier probe found it not yet up may still
        be backing off (gRPC waits up to seconds before reconnecting), longer than a stop notice waits.
        """
        old = self._channels.pop(receiver, None)
        if old is not None:
            old[0].close()

    def _stub(self, receiver: int):
        if receiver not in self._channels:
            m = self.grpc_mappings[receiver]
            url = f"{m.ingress_ip or m.grpc_server_ip}:{m.grpc_server_port}"
            channel = self.channel(url)
            self._channels[receiver] = (channel, grpc_comm_manager_pb2_grpc.gRPCCommManagerStub(channel))
        return self._channels[receiver][1]

    def send_message(self, msg):
        m = self.grpc_mappings[self.client_id]
        msg.add_params(GRPCCommManager.MSG_ARG_KEY_SENDER_RANK, self.client_rank)
        msg.add_params(GRPCCommManager.MSG_ARG_KEY_SENDER_IP, m.ingress_ip or m.grpc_server_ip)
        msg.add_params(GRPCCommManager.MSG_ARG_KEY_SENDER_PORT, m.grpc_server_port)
        data = self.meter.dumps(msg)
        request = grpc_comm_manager_pb2.CommRequest()
        request.client_id = self.client_id
        request.message = self.sealer.seal(int(msg.get_receiver_id()), data)
        # A status probe to a worker not up yet may fail at once (the worker announces itself); a stop
        # notice (a refusal too) waits a few seconds for the peer, whose channel may still be backing
        # off from such a probe; everything else waits up to the connect timeout.
        kind = msg.get_type()
        probe = kind == MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS
        timeout = 5.0 if probe or kind == MyMessage.MSG_TYPE_S2C_FINISH else self.connect_timeout
        receiver = int(msg.get_receiver_id())
        try:
            self._stub(receiver).sendMessage(request, timeout=timeout, wait_for_ready=not probe)
        except grpc.RpcError as exc:
            r = self.grpc_mappings[receiver]
            address = f"{r.ingress_ip or r.grpc_server_ip}:{r.grpc_server_port}"
            code = exc.code().name
            finished = (
                msg.get_type() == MyMessage.MSG_TYPE_C2S_CLIENT_STATUS
                and msg.get(MyMessage.MSG_ARG_KEY_CLIENT_STATUS) == "FINISHED"
            )
            if finished and code in ("UNAVAILABLE", "CANCELLED"):
                # the run is over: the server may stop while this last notice is in flight
                log.info("rank %d: the server stopped while it was told this rank finished", self.client_rank)
                return
            if code == "DEADLINE_EXCEEDED":
                waited = f"within {self.connect_timeout:.0f} s (FEDML_SSFL_CONNECT_TIMEOUT)"
            elif code == "PERMISSION_DENIED":  # the receiver dropped it: say why (another key, ...)
                waited = f"({code}: {exc.details()})"
            else:
                waited = f"({code})"
            raise DeliveryError(
                f"rank {self.client_rank} could not deliver a message to rank {receiver} at {address} {waited}",
                receiver,
                address,
                code,
            ) from exc

    def message_handling_subroutine(self):
        while self.is_running:
            try:
                item = self.grpc_servicer.message_q.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(item, FedMessage):
                msg = item
            else:
                sender, payload, peer = item
                try:
                    msg = self.meter.loads(payload)
                    claimed = int(msg.get_sender_id())
                except (WireError, AttributeError, TypeError, ValueError) as exc:
                    # nothing was built from the bytes: drop them, say so
                    log.warning(
                        "rank %d dropped a message from %s it could not decode: %s", self.client_rank, peer, exc
                    )
                    continue
                if claimed != sender:
                    log.warning(
                        "rank %d dropped a message from %s: sealed by rank %d, claims rank %d",
                        self.client_rank,
                        peer,
                        sender,
                        claimed,
                    )
                    continue
            for observer in self._observers:
                observer.receive_message(msg.get_type(), msg)

    def inject(self, msg) -> None:
        self.grpc_servicer.message_q.put(msg)

    def stop_receive_message(self):
        for channel, _ in self._channels.values():
            channel.close()
        self._channels.clear()
        self.grpc_server.stop(grace=2.0)  # calls in flight (a worker's last status) may complete
        self.is_running = False


def make_comm(manager) -> None:
    """Install the quiet transport on a FedML comm manager (called from ``_init_manager``)."""
    if manager.backend == "MPI":
        manager.com_manager = QuietMpiComm(manager.comm, manager.rank, manager.size)
    elif manager.backend == "GRPC":
        manager.com_manager = QuietGrpcComm(
            grpc_ipconfig_path=manager.args.grpc_ipconfig_path,
            client_rank=manager.rank,
            client_num=manager.size,
            args=manager.args,
            meter=manager.meter,
            connect_timeout=manager.limits.connect,
        )
    else:
        raise ConfigError(f"comm_args.backend {manager.backend}: only MPI and GRPC are supported")
    manager.com_manager.add_observer(manager)


def grpc_reachable(comm, rank: int) -> bool:
    """Whether ``rank``'s gRPC port accepts a connection within 2 s (its process is alive)."""
    m = comm.grpc_mappings[rank]
    channel = comm.channel(f"{m.ingress_ip or m.grpc_server_ip}:{m.grpc_server_port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=2.0)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()
