"""Who may speak in a GRPC job: TLS credentials, the job key, sealed messages, and membership.

A GRPC message between ranks travels as a *sealed envelope*::

    SSFLSEAL1 | 4-byte header length | header (JSON) | payload (a wire message) | HMAC-SHA256 tag

The header names the job (:func:`job_identity`: the run id, or a digest of the job key when the
run id is empty, so it is never empty), the sender and receiver
ranks, the sender's session (a fresh random nonce per process), a sequence number and the
envelope's kind: ``h`` (a handshake message), ``m`` (a message of the run) or ``b`` (a heartbeat).
The receiver drops, and logs naming the peer, an envelope that is too large, not an envelope,
carries a bad tag (forged or tampered: the key is the job's shared secret), comes from a rank the
job does not have or is meant for another rank or job, repeats a sequence number of its session
(a replay, or a retry of a message already received: :class:`Duplicate`), or is a message or a
heartbeat from a session that has not completed the handshake with this process
(:class:`NotAdmitted`: a process of an earlier run, or a peer that restarted). Only then is the
payload decoded (:mod:`~fedml_ssfl.runtime.wire`).

Sessions are admitted one level up, by the handshake (:mod:`.managers`): the server sends a
worker a fresh *challenge*; the worker answers ONLINE with :func:`membership` (the config keys
that make the job what it is) and a :func:`proof` binding the key, the job, its rank, that
config, the challenge and its own session; the server admits the session only for a challenge it
issued and has not seen answered (so nothing captured from an earlier process of the job, before
a ``--resume`` or a restart, is accepted), refuses a worker whose keys differ, naming them
(:func:`membership_diff`), and answers *welcome* naming the challenge and the worker's session,
which the worker accepts once, for a challenge it answered. An admitted session replaces the one
before it: a restarted worker or server rejoins, a replayed handshake does not.

Nothing here imports FedML or gRPC.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import envvars
from ...config import ConfigError, ExperimentConfig
from ...limits import read_small_file

log = logging.getLogger(__name__)

KEY_ENV = "FEDML_SSFL_JOB_KEY"
MAGIC = b"SSFLSEAL1"
TAG_BYTES = 32
MAX_HEADER_BYTES = 4096
REPLAY_WINDOW = 4096  # sequence numbers this far below the highest seen are refused outright
SESSIONS_KEPT = 8  # per rank, the sessions whose sequence numbers are remembered (the newest)
HELLO, MESSAGE, BEAT = "h", "m", "b"
"""Envelope kinds: a handshake message (any session), a message of the run, a heartbeat (the admitted
session only)."""

# keys that may differ between the processes of one job: where each keeps its files, its device,
# its own certificate, what it logs; everything else must match the server's
LOCAL_KEYS = (
    "common_args.run_name",
    "common_args.output_dir",
    "common_args.compare_with",
    "data_args.data_cache_dir",
    "data_args.download",
    "data_args.local_data",
    "data_args.server_data",
    "data_args.server_val_data",
    "data_args.test_data",
    "comm_args.grpc_ipconfig_path",
    "comm_args.tls_ca",
    "comm_args.tls_cert",
    "comm_args.tls_key",
    "comm_args.tls_server_name",
    "comm_args.job_key_file",
)
LOCAL_SECTIONS = ("device_args", "tracking_args")


class Refused(Exception):
    """An envelope was dropped; the text says why (logged with the peer's address)."""

    code = "PERMISSION_DENIED"
    """The gRPC status the receiver answers: the sender gives the message up."""


class NotAdmitted(Refused):
    """A message or heartbeat from a session that has not completed the handshake with this process
    (the sender or this process restarted): the sender drops it and the handshake runs again."""

    code = "FAILED_PRECONDITION"


class Duplicate(Refused):
    """A sequence number of this session already received: a retry of a delivered message (or a replay)."""

    code = "ALREADY_EXISTS"


@dataclass(frozen=True)
class Opened:
    """An envelope that passed every check: who sealed it, in which session, its kind and payload."""

    sender: int
    session: str
    kind: str
    payload: memoryview


@dataclass(frozen=True)
class Tls:
    """PEM bytes for mutual TLS."""

    ca: bytes
    cert: bytes
    key: bytes
    server_name: str = ""
    cert_file: str = ""
    key_file: str = ""


@dataclass(frozen=True)
class JobSecurity:
    """What one process of a GRPC job needs to seal, open and connect."""

    job: str
    key: bytes | None
    tls: Tls | None

    @property
    def insecure(self) -> bool:
        return self.tls is None


def pem_path(path: str, rank: int) -> Path:
    """A TLS file's path for ``rank``: ``{rank}`` in it replaced, ``~`` expanded."""
    return Path(path.replace("{rank}", str(rank))).expanduser()


def _read(cfg_key: str, path: str, rank: int) -> bytes:
    p = pem_path(path, rank)
    data = read_small_file(p, f"comm_args.{cfg_key}", _CERT_FIX)  # bounded: /dev/zero or 1 GiB is refused unread
    if not data.strip():
        raise ConfigError(f"comm_args.{cfg_key}: {p} is empty; {_CERT_FIX}")
    return data


_CERT_FIX = "make a test CA with deploy/make_test_certs.sh, or point the key at your PEM file"


def job_key(cfg: ExperimentConfig, rank: int = 0) -> bytes | None:
    """The job's shared key: ``FEDML_SSFL_JOB_KEY`` if set, else ``comm_args.job_key_file`` (``{rank}`` in it
    replaced by ``rank``, as in the TLS paths), else None."""
    text = envvars.text(KEY_ENV)
    source = KEY_ENV
    if not text and cfg.comm_args.job_key_file:
        path = pem_path(cfg.comm_args.job_key_file, rank)
        data = read_small_file(path, "comm_args.job_key_file", _KEY_FIX)
        try:
            text = data.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"comm_args.job_key_file: {path} is not text (byte {exc.start}: {exc.reason}); {_KEY_FIX}"
            ) from None
        source = str(path)
    if not text:
        return None
    if len(text) < 32:
        raise ConfigError(f"the job key in {source} has {len(text)} characters; use at least 32 ({_KEY_FIX})")
    return text.encode("utf-8")


_KEY_FIX = "make one with `openssl rand -hex 32` (deploy/make_test_certs.sh writes job.key)"


def load_security(cfg: ExperimentConfig, rank: int) -> JobSecurity:
    """TLS files and the job key for ``rank``, checked before anything binds a port.

    Raises
    ------
    ConfigError
        TLS or the key is missing while ``comm_args.insecure`` is false, or a file cannot be read.
    """
    c = cfg.comm_args
    key = job_key(cfg, rank)
    named = {k: getattr(c, k) for k in ("tls_ca", "tls_cert", "tls_key")}
    if c.insecure:
        log.warning(
            "comm_args.insecure: GRPC runs in plaintext; anyone on the network can read the models%s",
            "" if key else f", and with no job key ({KEY_ENV}) anyone who reaches a port can send messages",
        )
        return JobSecurity(job=job_identity(cfg, key), key=key, tls=None)
    missing = [f"comm_args.{k}" for k, v in named.items() if not v]
    if key is None:
        missing.append(f"comm_args.job_key_file (or {KEY_ENV})")
    if missing:
        raise ConfigError(
            f"GRPC needs TLS and a job key: {', '.join(missing)} not set; {_CERT_FIX} "
            "(docs/deploy.md, Security), or set comm_args.insecure: true to run in plaintext on a network you trust"
        )
    files = {k: str(Path(v.replace("{rank}", str(rank))).expanduser()) for k, v in named.items()}
    tls = Tls(
        *(_read(k, v, rank) for k, v in named.items()),
        server_name=c.tls_server_name,
        cert_file=files["tls_cert"],
        key_file=files["tls_key"],
    )
    return JobSecurity(job=job_identity(cfg, key), key=key, tls=tls)


def job_identity(cfg: ExperimentConfig, key: bytes | None) -> str:
    """The job's name in every envelope: ``common_args.run_id``, or (when it is empty) a digest of the
    job key. Never empty.

    Nothing else goes in: the rest of the config may differ between the processes of a job where it is
    local (the ipconfig's path and rows, behind NAT or a proxy), and a worker started with another seed
    must reach the handshake, which names the keys that differ (:func:`membership_diff`). What keeps a
    process from taking messages of an earlier process of the same job (or of another job under the
    same key) is the handshake's fresh challenge and the admitted sessions, not this name."""
    if cfg.common_args.run_id:
        return cfg.common_args.run_id
    return "job-" + hashlib.sha256(b"ssfl-job|" + (key or b"")).hexdigest()[:24]


# ---- membership -----------------------------------------------------------------------------


def membership(cfg: ExperimentConfig) -> dict[str, Any]:
    """The dotted config keys every process of one job must share (JSON values)."""
    out = {}
    for section, values in cfg.to_dict().items():
        if section in LOCAL_SECTIONS:
            continue
        for key, value in values.items():
            if f"{section}.{key}" not in LOCAL_KEYS:
                out[f"{section}.{key}"] = value
    return out


def membership_diff(mine: dict[str, Any], theirs: Any, rank: int) -> list[str]:
    """The keys on which ``theirs`` (rank ``rank``'s) differs from ``mine``, each with both values."""
    if not isinstance(theirs, dict):
        return ["(no config sent: the worker runs another version of fedml_ssfl)"]
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key, "<unset>"), theirs.get(key, "<unset>")
        if a != b:
            out.append(f"{key} (server {a!r}, rank {rank} {b!r})")
    return out


def new_challenge() -> str:
    """A fresh nonce for one handshake (the server sends it; the worker's ONLINE must answer it)."""
    return secrets.token_hex(16)


def proof(
    key: bytes | None, job: str, rank: int, config: dict[str, Any], challenge: str = "", session: str = ""
) -> str:
    """HMAC of (job, rank, membership, the server's challenge, the worker's session): shows the sender
    holds the job key and answers this challenge from this process ("" with no key)."""
    if key is None:
        return ""
    text = json.dumps([job, rank, config, challenge, session], sort_keys=True, default=str).encode()
    return hmac.new(key, b"online|" + text, hashlib.sha256).hexdigest()


# ---- envelopes ------------------------------------------------------------------------------


class Sealer:
    """Seals this rank's outgoing messages (thread-safe)."""

    def __init__(self, security: JobSecurity, rank: int) -> None:
        self.security, self.rank = security, rank
        self.session = secrets.token_hex(16)  # this process's nonce: every envelope names it
        self._seq = 0
        self._lock = threading.Lock()

    def seal(self, receiver: int, payload: bytes, kind: str = MESSAGE) -> bytes:
        with self._lock:
            self._seq += 1
            seq = self._seq
        header = json.dumps(
            {
                "job": self.security.job,
                "from": self.rank,
                "to": receiver,
                "session": self.session,
                "seq": seq,
                "kind": kind,
            },
            separators=(",", ":"),
        ).encode()
        body = b"".join((MAGIC, struct.pack("<I", len(header)), header, payload))
        if self.security.key is None:
            return body
        return body + hmac.new(self.security.key, body, hashlib.sha256).digest()


class Opener:
    """Checks incoming envelopes for rank ``rank`` of a job with ranks ``ranks`` (thread-safe).

    A handshake envelope (kind ``h``) is accepted from any session; a message or a heartbeat only from
    the session :meth:`admit` admitted for its rank. Sequence numbers are remembered per session.
    """

    def __init__(self, security: JobSecurity, rank: int, ranks: set[int], limit: int) -> None:
        self.security, self.rank, self.ranks, self.limit = security, rank, set(ranks), limit
        self.admitted: dict[int, str] = {}
        # (sender, session) -> (highest seq, seqs within the window); the newest SESSIONS_KEPT per sender
        self.seen: dict[tuple[int, str], tuple[int, set[int]]] = {}
        self.sessions: dict[int, dict[str, None]] = {}  # sender -> its sessions in seen, the newest last
        self._lock = threading.Lock()

    def admit(self, sender: int, session: str) -> str | None:
        """Accept messages from ``sender``'s ``session`` from now on (replacing its session before);
        returns the session it replaces (None if there was none)."""
        with self._lock:
            before = self.admitted.get(sender)
            self.admitted[sender] = session
            return before

    def session_of(self, sender: int) -> str | None:
        with self._lock:
            return self.admitted.get(sender)

    def open(self, data: bytes) -> Opened:
        """The envelope's sender, session, kind and payload; :class:`Refused` for anything else."""
        view = memoryview(data)
        tag = TAG_BYTES if self.security.key is not None else 0
        if view.nbytes > self.limit:
            raise Refused(f"oversized: {view.nbytes} bytes, over the limit of {self.limit}")
        head = len(MAGIC) + 4
        if view.nbytes < head + tag or bytes(view[: len(MAGIC)]) != MAGIC:
            raise Refused("not a sealed message (another program, or a peer of another version)")
        (n,) = struct.unpack("<I", view[len(MAGIC) : head])
        if n > MAX_HEADER_BYTES or head + n + tag > view.nbytes:
            raise Refused("malformed envelope header")
        if tag:
            body, got = view[: view.nbytes - tag], bytes(view[view.nbytes - tag :])
            want = hmac.new(self.security.key, body, hashlib.sha256).digest()
            if not hmac.compare_digest(got, want):
                raise Refused("bad tag: forged or tampered, or sealed with another job key")
        try:
            h = json.loads(bytes(view[head : head + n]))
            sender, receiver, session, seq, job = (h["from"], h["to"], h["session"], h["seq"], h["job"])
            kind = h.get("kind", MESSAGE)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise Refused("malformed envelope header") from None
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (sender, receiver, seq)):
            raise Refused("malformed envelope header")
        if not isinstance(session, str) or not session or len(session) > 64 or kind not in (HELLO, MESSAGE, BEAT):
            raise Refused("malformed envelope header")
        if job != self.security.job:
            raise Refused(f"from another job (job id {job!r}, this job's is {self.security.job!r})")
        if sender not in self.ranks or sender == self.rank:
            raise Refused(f"unknown rank {sender}: this job has ranks {sorted(self.ranks)}")
        if receiver != self.rank:
            raise Refused(f"addressed to rank {receiver}, not this rank")
        with self._lock:
            if kind != HELLO and self.admitted.get(sender) != session:
                raise NotAdmitted(
                    f"rank {sender}'s session {session[:8]} has not completed the handshake with this process "
                    "(one of the two restarted, or it is a message of an earlier process)"
                )
            self._check_fresh(sender, session, seq)
        return Opened(sender, session, kind, view[head + n : view.nbytes - tag])

    def _check_fresh(self, sender: int, session: str, seq: int) -> None:
        key = (sender, session)
        highest, window = self.seen.get(key, (0, set()))
        if seq <= highest - REPLAY_WINDOW or seq in window:
            raise Duplicate(f"replayed: rank {sender}'s message {seq} was already received (a retry, or a replay)")
        window.add(seq)
        if seq > highest:
            highest = seq
            window = {s for s in window if s > highest - REPLAY_WINDOW}
        self.seen[key] = (highest, window)
        # this sender's sessions, the newest last: a dict per sender, so an envelope costs the same
        # whatever the number of ranks (scanning every sender's sessions made a round quadratic)
        mine = self.sessions.setdefault(sender, {})
        mine.pop(session, None)
        mine[session] = None
        for old in list(mine)[: max(0, len(mine) - SESSIONS_KEPT)]:
            if old != self.admitted.get(sender):
                del mine[old]
                self.seen.pop((sender, old), None)
