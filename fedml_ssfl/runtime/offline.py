"""Keep a run offline: refuse, and record, any socket use that leaves this host.

FedML 0.9.6 reaches for its cloud in several places (config fetch in ``fedml.init``, MLOps
MQTT/S3, wandb, network diagnostics). The FedML runtime switches those off; this guard is the
belt to those braces. Once :func:`install` ran, in this process:

* ``connect`` / ``connect_ex`` / ``sendto`` on an IPv4/IPv6 socket to an address outside
  loopback raise :class:`OfflineViolation` (a ``ConnectionRefusedError``), unless the address is
  one of the explicitly allowed peers (the GRPC ipconfig's hosts);
* name lookups (``getaddrinfo``, ``gethostbyname``) of names other than ``localhost``, this
  host's own name, IP literals and the allowed peers raise ``socket.gaierror`` -- a DNS query is
  traffic too;
* every refusal is logged once per address and, when ``FEDML_SSFL_NET_RECORD`` names a file,
  appended to it (tests read that file to prove a run made no outside attempt).

Unix sockets and loopback are untouched. ``FEDML_SSFL_ALLOW_NETWORK=1`` disables the guard
(e.g. to use FedML's own platform on purpose). Sockets opened by C libraries that bypass
Python's ``socket`` module (gRPC core, Open MPI) are not seen here; the runtime only ever
points those at loopback or the configured peers.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import traceback
from collections.abc import Iterable

from .. import envvars

log = logging.getLogger(__name__)

ALLOW_ENV = "FEDML_SSFL_ALLOW_NETWORK"
RECORD_ENV = "FEDML_SSFL_NET_RECORD"


class OfflineViolation(ConnectionRefusedError):
    """A connection outside loopback was attempted while the offline guard is on."""


_lock = threading.Lock()
_state: dict = {"installed": False, "allow_ips": set(), "allow_names": set(), "seen": set(), "originals": {}}


def _local_names() -> set[str]:
    names = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback", ""}
    try:
        names.add(socket.gethostname().lower())
    except OSError:
        pass
    return names


def is_loopback(host: str) -> bool:
    """True for loopback IP literals (127.0.0.0/8, ::1) and the unspecified address."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return True
    except ValueError:
        return False


def _record(kind: str, target: str) -> None:
    key = (kind, target)
    with _lock:
        first = key not in _state["seen"]
        _state["seen"].add(key)
    if first:
        log.warning("offline guard: refused %s to %s (set %s=1 to allow network use)", kind, target, ALLOW_ENV)
    path = envvars.file_path(RECORD_ENV)
    if path:
        stack = "".join(traceback.format_stack(limit=12)[:-2])
        with _lock, open(path, "a", encoding="utf-8") as fh:
            fh.write(f"pid {os.getpid()}: {kind} {target}\n{stack}\n")


def _allowed_address(address) -> bool:
    if not isinstance(address, tuple) or not address:
        return True  # AF_UNIX paths and other families
    host = str(address[0])
    return is_loopback(host) or host in _state["allow_ips"] or host.lower() in _state["allow_names"]


def _allowed_name(host) -> bool:
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    host = str(host)
    return (
        _is_ip_literal(host)
        or host.lower() in _local_names()
        or host.lower() in _state["allow_names"]
        or host in _state["allow_ips"]
    )


def _inet(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6)


def install(allow_hosts: Iterable[str] = ()) -> bool:
    """Turn the guard on in this process (idempotent); ``allow_hosts`` are reachable peers.

    Returns False (and does nothing) when ``FEDML_SSFL_ALLOW_NETWORK=1``.
    """
    if envvars.flag(ALLOW_ENV):
        return False
    for host in allow_hosts:
        host = str(host).strip()
        if not host:
            continue
        if _is_ip_literal(host):
            _state["allow_ips"].add(host)
        else:
            _state["allow_names"].add(host.lower())
    if _state["installed"]:
        return True
    orig = _state["originals"]
    orig["connect"] = socket.socket.connect
    orig["connect_ex"] = socket.socket.connect_ex
    orig["sendto"] = socket.socket.sendto
    orig["getaddrinfo"] = socket.getaddrinfo
    orig["gethostbyname"] = socket.gethostbyname
    orig["gethostbyname_ex"] = socket.gethostbyname_ex

    def connect(self, address):
        if _inet(self) and not _allowed_address(address):
            _record("connect", repr(address))
            raise OfflineViolation(f"offline: connection to {address!r} refused ({ALLOW_ENV}=1 allows it)")
        return orig["connect"](self, address)

    def connect_ex(self, address):
        if _inet(self) and not _allowed_address(address):
            _record("connect", repr(address))
            raise OfflineViolation(f"offline: connection to {address!r} refused ({ALLOW_ENV}=1 allows it)")
        return orig["connect_ex"](self, address)

    def sendto(self, data, *args):
        address = args[-1] if args else None
        if _inet(self) and not _allowed_address(address):
            _record("sendto", repr(address))
            raise OfflineViolation(f"offline: datagram to {address!r} refused ({ALLOW_ENV}=1 allows it)")
        return orig["sendto"](self, data, *args)

    def getaddrinfo(host, *args, **kwargs):
        if not _allowed_name(host):
            _record("name lookup", repr(host))
            raise socket.gaierror(socket.EAI_NONAME, f"offline: lookup of {host!r} refused")
        return orig["getaddrinfo"](host, *args, **kwargs)

    def gethostbyname(host):
        if not _allowed_name(host):
            _record("name lookup", repr(host))
            raise socket.gaierror(socket.EAI_NONAME, f"offline: lookup of {host!r} refused")
        return orig["gethostbyname"](host)

    def gethostbyname_ex(host):
        if not _allowed_name(host):
            _record("name lookup", repr(host))
            raise socket.gaierror(socket.EAI_NONAME, f"offline: lookup of {host!r} refused")
        return orig["gethostbyname_ex"](host)

    socket.socket.connect = connect
    socket.socket.connect_ex = connect_ex
    socket.socket.sendto = sendto
    socket.getaddrinfo = getaddrinfo
    socket.gethostbyname = gethostbyname
    socket.gethostbyname_ex = gethostbyname_ex
    _state["installed"] = True
    return True


def uninstall() -> None:
    """Restore the original socket functions (tests; a long-lived process after a run)."""
    if not _state["installed"]:
        return
    orig = _state["originals"]
    socket.socket.connect = orig["connect"]
    socket.socket.connect_ex = orig["connect_ex"]
    socket.socket.sendto = orig["sendto"]
    socket.getaddrinfo = orig["getaddrinfo"]
    socket.gethostbyname = orig["gethostbyname"]
    socket.gethostbyname_ex = orig["gethostbyname_ex"]
    _state.update(installed=False, allow_ips=set(), allow_names=set())


def installed() -> bool:
    return bool(_state["installed"])
