"""The GRPC transport's receiving half (fedml_ssfl.runtime.fedml.transports.QuietGrpcComm.receive) fed real
sealed envelopes: a worker accepts the server's welcome once, only for a challenge it answered, from the
session that sent it, naming its own session, and only then takes the server's messages; bytes that
fail to decode, whatever the exception, are dropped with one line naming the peer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fedml_ssfl.runtime.fedml.launch import timeouts
from fedml_ssfl.runtime.fedml.security import HELLO, MESSAGE, Duplicate, JobSecurity, NotAdmitted, Refused, Sealer

pytest.importorskip("fedml")
pytest.importorskip("grpc")

KEY = b"k" * 64


@pytest.fixture
def worker():
    """Rank 1's transport (listening on 127.0.0.1), the server's sealer, and a message builder."""
    from fedml.core.distributed.communication.message import Message as FedMessage

    from fedml_ssfl.runtime.fedml.transports import QuietGrpcComm
    from fedml_ssfl.runtime.fedml.wire import WireMeter
    from tests.test_fedml_grpc import free_ports

    p0, p1 = free_ports(2)
    security = JobSecurity("job", KEY, None)
    args = SimpleNamespace(ssfl_grpc_table={0: ("127.0.0.1", p0), 1: ("127.0.0.1", p1)}, ssfl_security=security)
    comm = QuietGrpcComm(
        grpc_ipconfig_path="", client_rank=1, client_num=1, args=args, meter=WireMeter(FedMessage), limits=timeouts()
    )

    def envelope(sealer: Sealer, msg_type: str, kind: str = HELLO, **params) -> bytes:
        msg = FedMessage(msg_type, 0, 1)
        for k, v in params.items():
            msg.add_params(k, v)
        return sealer.seal(1, comm.meter.dumps(msg), kind)

    try:
        yield comm, Sealer(security, 0), envelope
    finally:
        comm.stop_receive_message()


def queued(comm):
    item = comm.message_q.get(timeout=5)
    return item if not isinstance(item, tuple) else comm._decode(*item)


def test_the_welcome_admits_the_server_only_for_an_answered_challenge_of_this_process(worker):
    from fedml_ssfl.runtime.fedml.transports import CHALLENGE, CLIENT_SESSION, SESSION, VERIFIED, WELCOME

    comm, server, envelope = worker
    mine = comm.sealer.session
    comm.receive(envelope(server, "check", **{CHALLENGE: "c1"}), "peer")
    assert queued(comm).get(SESSION) == server.session
    assert comm.answer("c1", server.session) and not comm.answer("c1", server.session)  # answered once

    for challenge, session in (("c2", mine), ("c1", "someone else's session")):  # not answered / not this process
        comm.receive(envelope(server, WELCOME, **{CHALLENGE: challenge, CLIENT_SESSION: session}), "peer")
        assert queued(comm).get(VERIFIED) is False and comm.admitted(0) is None
    other = Sealer(server.security, 0)  # another server process: it did not send c1
    comm.receive(envelope(other, WELCOME, **{CHALLENGE: "c1", CLIENT_SESSION: mine}), "peer")
    assert queued(comm).get(VERIFIED) is False and comm.admitted(0) is None
    with pytest.raises(NotAdmitted):  # no message of the run before a welcome
        comm.receive(envelope(server, "task", MESSAGE), "peer")

    welcome = envelope(server, WELCOME, **{CHALLENGE: "c1", CLIENT_SESSION: mine})
    comm.receive(welcome, "peer")
    assert queued(comm).get(VERIFIED) is True and comm.admitted(0) == server.session
    with pytest.raises(Duplicate):
        comm.receive(welcome, "peer")
    comm.receive(envelope(server, WELCOME, **{CHALLENGE: "c1", CLIENT_SESSION: mine}), "peer")
    assert queued(comm).get(VERIFIED) is False  # a challenge is welcomed once
    comm.receive(envelope(server, "task", MESSAGE), "peer")
    assert queued(comm).get_type() == "task" and 0 in comm.heard
    with pytest.raises(NotAdmitted):
        comm.receive(envelope(other, "task", MESSAGE), "peer")


def test_bytes_that_fail_to_decode_are_dropped_naming_the_peer_whatever_the_exception(worker, caplog):
    comm, server, envelope = worker
    comm.opener.admit(0, server.session)

    def explode(payload):
        raise RuntimeError("a decoder bug")

    comm.meter.loads = explode
    with pytest.raises(Refused, match="does not decode"):
        comm.receive(envelope(server, "check"), "ipv4:10.0.0.9:5555")
    comm.receive(envelope(server, "task", MESSAGE), "ipv4:10.0.0.9:5556")
    assert queued(comm) is None
    lines = [r.getMessage() for r in caplog.records if "could not decode" in r.getMessage()]
    assert len(lines) == 2 and all("ipv4:10.0.0.9:555" in x and "RuntimeError: a decoder bug" in x for x in lines)
