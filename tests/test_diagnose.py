"""The true cause of an unreachable GRPC peer (fedml_ssfl.runtime.fedml.diagnose), against real gRPC servers
on 127.0.0.1 with real certificates: refused, plaintext against TLS either way, an expired certificate,
one for another name, one of another CA, this process's certificate refused; and the start-up check of
a process's own certificate."""

from __future__ import annotations

import socket
import struct
import threading
from concurrent import futures
from pathlib import Path

import pytest

from fedml_ssfl.config import ConfigError
from fedml_ssfl.runtime.fedml.diagnose import check_own_certificate, diagnose_peer
from fedml_ssfl.runtime.fedml.security import Tls
from tests.pki import make_ca, make_cert

grpc = pytest.importorskip("grpc")
pytest.importorskip("fedml")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(root / "ca"), make_ca(root / "other")
    return {
        "ca": ca,
        "good": make_cert(ca, "good"),
        "good2": make_cert(ca, "good2"),
        "wrong": make_cert(ca, "wrong", "IP:10.9.9.9"),
        "expired": make_cert(ca, "expired", days=-1),
        "stranger": make_cert(other, "stranger"),
    }


def tls(pki, name: str) -> Tls:
    cert, key = pki[name]
    ca = (pki["ca"] / "ca.pem").read_bytes()
    return Tls(ca, cert.read_bytes(), key.read_bytes(), cert_file=str(cert), key_file=str(key))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(pki, name: str | None):
    """A gRPC server with the job's service, over mutual TLS with certificate ``name`` (None: plaintext)."""
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2_grpc

    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    grpc_comm_manager_pb2_grpc.add_gRPCCommManagerServicer_to_server(
        grpc_comm_manager_pb2_grpc.gRPCCommManagerServicer(), server
    )
    if name is None:
        server.add_insecure_port(f"127.0.0.1:{port}")
    else:
        cert, key = pki[name]
        ca = (pki["ca"] / "ca.pem").read_bytes()
        creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())], ca, require_client_auth=True)
        server.add_secure_port(f"127.0.0.1:{port}", creds)
    server.start()
    return server, port


@pytest.mark.parametrize(
    ("peer", "me", "expected", "lasting"),
    [
        ("good", "good2", "", False),
        (None, None, "", False),
        ("good", None, "speaks TLS, but this process runs in plaintext", True),
        (None, "good", "answers in plaintext", True),
        ("expired", "good", "certificate presented at 127.0.0.1:{port} has expired", True),
        ("wrong", "good", "not valid for the name 127.0.0.1", True),
        ("stranger", "good", "not signed by this job's CA", True),
        ("good", "expired", "refused this process's certificate", True),
        ("good", "stranger", "refused this process's certificate", True),
    ],
)
def test_the_cause_is_named(pki, peer, me, expected, lasting):
    server, port = serve(pki, peer)
    try:
        cause = diagnose_peer("127.0.0.1", port, tls(pki, me) if me else None)
    finally:
        server.stop(0)
    assert (cause.text == "") if not expected else (expected.format(port=port) in cause.text), cause
    assert cause.lasting is lasting


def test_nothing_listening_is_a_refused_connection_that_may_pass(pki):
    cause = diagnose_peer("127.0.0.1", free_port(), tls(pki, "good"))
    assert "connection refused at 127.0.0.1:" in cause.text and not cause.lasting


def test_a_process_refuses_its_own_certificate_before_it_listens(pki):
    check_own_certificate(tls(pki, "good"), "127.0.0.1", 1)  # fine
    with pytest.raises(ConfigError, match=r"comm_args\.tls_cert \(.*expired\.pem, rank 1\) expired on"):
        check_own_certificate(tls(pki, "expired"), "127.0.0.1", 1)
    with pytest.raises(ConfigError, match=r"names IP:10\.9\.9\.9, but peers reach rank 2 as 127\.0\.0\.1"):
        check_own_certificate(tls(pki, "wrong"), "127.0.0.1", 2)
    with pytest.raises(ConfigError, match=r"is not accepted by comm_args\.tls_ca"):
        check_own_certificate(tls(pki, "stranger"), "127.0.0.1", 1)
    with pytest.raises(ConfigError, match="names IP:127.0.0.1, but peers reach rank 1 as node7"):
        check_own_certificate(tls(pki, "good"), "node7", 1)


def test_wildcard_and_dns_names_are_matched(tmp_path):
    ca = make_ca(tmp_path / "ca")
    cert, key = make_cert(ca, "dns", "DNS:*.silos.example,DNS:server.example")
    t = Tls((ca / "ca.pem").read_bytes(), cert.read_bytes(), key.read_bytes(), cert_file=str(cert), key_file=str(key))
    check_own_certificate(t, "a.silos.example", 1)
    check_own_certificate(t, "server.example", 0)
    with pytest.raises(ConfigError, match="but peers reach rank 1 as a.b.silos.example"):
        check_own_certificate(t, "a.b.silos.example", 1)
    assert Path(cert).exists()


def resetting_peer(resets: int) -> tuple[int, threading.Thread]:
    """A TCP listener that resets ``resets`` connections in mid-handshake (it reads the ClientHello, then
    closes with an RST), then stops listening: a process killed while a peer's TLS handshake was under way."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve():
        with listener:
            for _ in range(resets):
                conn, _ = listener.accept()
                conn.recv(1024)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


def test_a_peer_killed_in_mid_handshake_is_not_taken_for_a_refusal(pki):
    """Once: the second look finds nobody listening (a restart: the outbox retries). Every time: lasting."""
    port, thread = resetting_peer(1)
    cause = diagnose_peer("127.0.0.1", port, tls(pki, "good"))
    thread.join(10)
    assert "connection refused at 127.0.0.1:" in cause.text and not cause.lasting, cause
    port, thread = resetting_peer(2)
    cause = diagnose_peer("127.0.0.1", port, tls(pki, "good"))
    thread.join(10)
    assert "closed the connection during the TLS handshake" in cause.text and cause.lasting, cause
