"""Why a GRPC peer cannot be reached, in words: connection refused, no answer, plaintext against TLS,
a certificate expired, for another name or of another CA, or this process's certificate refused.

gRPC reports every one of these as ``UNAVAILABLE``; :func:`diagnose_peer` finds the true cause with
Python's own :mod:`ssl` against the peer's port (a TCP connect and one TLS handshake, presenting this
process's certificate as gRPC does). :func:`check_own_certificate` checks this process's certificate
before the process opens a port: expired or not yet valid, not valid for the address peers reach it
at, not signed by the job's CA.

Nothing here imports FedML or gRPC.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import ssl
import threading
import time
from dataclasses import dataclass

from ...config import ConfigError
from .security import Tls

_FIX_CERT = "make new certificates (deploy/make_test_certs.sh, or your CA)"


@dataclass(frozen=True)
class Cause:
    """Why a peer is unreachable; ``lasting`` causes (TLS settings) do not heal by waiting."""

    text: str
    lasting: bool = False
    by_close: bool = False  # the peer closed the connection: a refusal, or a process that died in mid-handshake


def _decode(path: str) -> dict | None:
    """A PEM certificate file's fields (dates, subjectAltName), or None where this Python cannot say."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None or not path:
        return None
    try:
        return decode(path)
    except (ssl.SSLError, OSError, ValueError):
        return None


def _names(fields: dict) -> list[tuple[str, str]]:
    return [(kind, value) for kind, value in fields.get("subjectAltName", ()) if kind in ("DNS", "IP Address")]


def _covers(names: list[tuple[str, str]], name: str) -> bool:
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        ip = None
    for kind, value in names:
        if ip is not None and kind == "IP Address":
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(value.strip()) == ip:
                    return True
        elif ip is None and kind == "DNS":
            value = value.lower()
            if value == name.lower() or (
                value.startswith("*.") and "." in name and name.lower().split(".", 1)[1] == value[2:]
            ):
                return True
    return False


def check_own_certificate(tls: Tls, name: str, rank: int, now: float | None = None) -> None:
    """Refuse this process's certificate before anything listens, naming what is wrong with it.

    ``name`` is the address peers reach this rank at (its ipconfig row), or ``comm_args.tls_server_name``.

    Raises
    ------
    ConfigError
        The certificate has expired or is not yet valid, does not name ``name`` among its
        subjectAltNames, or is not signed by ``comm_args.tls_ca``.
    """
    fields = _decode(tls.cert_file)
    where = f"comm_args.tls_cert ({tls.cert_file}, rank {rank})"
    if fields is not None:
        now = time.time() if now is None else now
        after, before = fields.get("notAfter"), fields.get("notBefore")
        if after and ssl.cert_time_to_seconds(after) < now:
            raise ConfigError(f"{where} expired on {after}; peers refuse it: {_FIX_CERT}")
        if before and ssl.cert_time_to_seconds(before) > now + 300:
            raise ConfigError(f"{where} is not valid before {before} (check this machine's clock, or {_FIX_CERT})")
        names = _names(fields)
        if names and not _covers(names, name):
            listed = ", ".join(f"{'IP' if k.startswith('IP') else k}:{v}" for k, v in names)
            key = (
                "comm_args.tls_server_name" if tls.server_name else f"rank {rank}'s row in comm_args.grpc_ipconfig_path"
            )
            raise ConfigError(
                f"{where} names {listed}, but peers reach rank {rank} as {name} ({key}): they would refuse it; "
                f"make its certificate with subjectAltName IP:{name} (or DNS:{name}), or set comm_args.tls_server_name "
                "to a name every certificate carries"
            )
    problem = _chain_problem(tls)
    if problem:
        raise ConfigError(f"{where} is not accepted by comm_args.tls_ca: {problem}; {_FIX_CERT}")


def _chain_problem(tls: Tls) -> str:
    """Whether ``tls.cert`` verifies against ``tls.ca`` (one TLS handshake over a socket pair)."""
    if not (tls.cert_file and tls.key_file):
        return ""
    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(tls.cert_file, tls.key_file)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname = False
        client.load_verify_locations(cadata=tls.ca.decode("ascii", "replace"))
    except (ssl.SSLError, OSError, ValueError) as exc:
        return f"cannot load it ({exc})"
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    result: list[BaseException] = []

    def serve():
        try:
            with server.wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError) as exc:
            result.append(exc)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with client.wrap_socket(b) as s:
            s.sendall(b"x")
    except ssl.SSLCertVerificationError as exc:
        return exc.verify_message or str(exc)
    except (ssl.SSLError, OSError):
        pass  # the server half's trouble: a key that does not match the certificate, say
    finally:
        t.join(10)
        a.close()
        b.close()
    return ""


_PLAINTEXT_PEER = (
    "WRONG_VERSION_NUMBER",
    "RECORD_LAYER_FAILURE",
    "PACKET_LENGTH_TOO_LONG",
    "HTTP_REQUEST",
    "UNEXPECTED_EOF_WHILE_READING",
    "UNEXPECTED_RECORD",
)


CLOSE_RECHECK = 2.0
"""Seconds before a second look at a peer that closed the connection in (or right after) the TLS
handshake: a refusal closes it again, a process killed in mid-handshake (a restart) does not."""


def diagnose_peer(host: str, port: int, tls: Tls | None, timeout: float = 10.0) -> Cause:
    """Why ``host:port`` does not take this process's gRPC calls, or ``Cause("")`` when TCP and TLS
    both work (then the trouble is above them: the peer's own checks, or a slow link).

    A lasting cause seen as a closed connection is looked at twice (:data:`CLOSE_RECHECK` apart), so
    that a peer restarting in mid-handshake is not taken for one that refuses this process."""
    cause = _diagnose(host, port, tls, timeout)
    if cause.lasting and cause.by_close:
        time.sleep(CLOSE_RECHECK)
        cause = _diagnose(host, port, tls, timeout)
    return cause


def _diagnose(host: str, port: int, tls: Tls | None, timeout: float) -> Cause:
    addr = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        return Cause(f"connection refused at {addr}: no process listens there (not started yet, or stopped)")
    except TimeoutError:
        return Cause(f"no answer from {addr} within {timeout:.0f} s (the host is down, or the network is cut)")
    except OSError as exc:
        return Cause(f"cannot connect to {addr}: {exc.strerror or exc}")
    with sock:
        sock.settimeout(timeout)
        if tls is None:
            return _speaks_tls(sock, addr)
        return _tls_handshake(sock, host, addr, tls, timeout)


def _speaks_tls(sock: socket.socket, addr: str) -> Cause:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with ctx.wrap_socket(sock, do_handshake_on_connect=False) as s:
            s.do_handshake()
    except (ssl.SSLError, OSError):
        return Cause("")  # it does not speak TLS: as this process, plaintext
    return Cause(
        f"{addr} speaks TLS, but this process runs in plaintext (comm_args.insecure: true): "
        "give every process of the job the same TLS settings",
        lasting=True,
    )


def _tls_handshake(sock: socket.socket, host: str, addr: str, tls: Tls, timeout: float) -> Cause:
    name = tls.server_name or host
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.set_alpn_protocols(["h2"])
    try:
        ctx.load_verify_locations(cadata=tls.ca.decode("ascii", "replace"))
        if tls.cert_file and tls.key_file:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (ssl.SSLError, OSError, ValueError) as exc:
        return Cause(f"this process's TLS files cannot be loaded ({exc})", lasting=True)
    try:
        with ctx.wrap_socket(sock, server_hostname=name, do_handshake_on_connect=False) as s:
            s.do_handshake()
            # TLS 1.3: the peer checks this process's certificate after the handshake; its verdict
            # (an alert, or its HTTP/2 settings) is the first thing it sends
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            if not s.recv(1):
                return Cause(
                    f"{addr} closed the connection right after the TLS handshake: it refused this process's "
                    "certificate (expired, or not signed by the CA it trusts): check comm_args.tls_cert and "
                    f"comm_args.tls_ca on both ranks, or {_FIX_CERT}",
                    lasting=True,
                    by_close=True,
                )
    except ssl.SSLCertVerificationError as exc:
        return _verify_cause(exc, addr, name)
    except ssl.SSLError as exc:
        reason = (exc.reason or "").upper()
        if any(r in reason for r in _PLAINTEXT_PEER) or isinstance(exc, ssl.SSLEOFError):
            return Cause(
                f"{addr} answers in plaintext (its process runs with comm_args.insecure: true, or is not a "
                "fedml_ssfl rank): give every process of the job the same TLS settings",
                lasting=True,
            )
        if "ALERT" in reason:
            what = reason.split("ALERT_", 1)[-1].replace("_", " ").lower()
            return Cause(
                f"{addr} refused this process's certificate ({what}): check comm_args.tls_cert against the "
                f"job's CA and its dates, or {_FIX_CERT}",
                lasting=True,
            )
        return Cause(f"the TLS handshake with {addr} failed ({exc.reason or exc})")
    except TimeoutError:
        return Cause(f"no TLS handshake from {addr} within {timeout:.0f} s (a slow link, or not a TLS server)")
    except ConnectionResetError:
        return Cause(
            f"{addr} closed the connection during the TLS handshake (it answers in plaintext, or refused this "
            "process's certificate)",
            lasting=True,
            by_close=True,
        )
    except OSError as exc:
        return Cause(f"the TLS handshake with {addr} failed ({exc.strerror or exc})")
    return Cause("")


def _verify_cause(exc: ssl.SSLCertVerificationError, addr: str, name: str) -> Cause:
    why = exc.verify_message or str(exc)
    low = why.lower()
    if "expired" in low:
        text = f"the certificate presented at {addr} has expired: {_FIX_CERT} for that rank"
    elif "not yet valid" in low:
        text = f"the certificate presented at {addr} is not yet valid (check the clocks, or {_FIX_CERT})"
    elif "mismatch" in low:
        text = (
            f"the certificate presented at {addr} is not valid for the name {name} ({why}): make it with that "
            "address in its subjectAltName, or set comm_args.tls_server_name to a name it carries"
        )
    elif "issuer" in low or "self-signed" in low or "self signed" in low or "signature" in low:
        text = f"the certificate presented at {addr} is not signed by this job's CA, comm_args.tls_ca ({why})"
    else:
        text = f"the certificate presented at {addr} is refused: {why}"
    return Cause(text, lasting=True)
