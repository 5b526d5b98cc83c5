"""A network lab for tests: hosts in network namespaces of their own, joined through a hub whose
links delay, jitter, drop, cut and throttle frames (a test helper, not part of the package).

Topology, per :class:`Lab`::

    host "server" (netns <tag>-server, eth0 10.201.0.1/24) --link 0--+
    host "silo0"  (netns <tag>-silo0,  eth0 10.201.0.2/24) --link 1--+-- hub (netns <tag>-hub):
    host "silo1"  (netns <tag>-silo1,  eth0 10.201.0.3/24) --link 2--+   a user-space switch

Each link is a veth pair: ``eth0`` in the host's namespace, ``p<i>`` in the hub's. The hub is a
process of this module (``python tests/netlab.py hub ...``) in the hub namespace that reads every
frame from the ``p<i>`` ports with AF_PACKET sockets, learns where each MAC address lives and
writes the frame to the port of its destination (all other ports for broadcast). On its way a
frame passes two stages, each a FIFO with its own rules: *up* on its sender's link (host -> hub)
and *down* on its receiver's link (hub -> host). A stage delays a frame by ``delay`` plus a uniform
draw in [-``jitter``, +``jitter``] (frames keep their order: jitter never reorders them), drops it
with probability ``loss`` (a seeded stream per stage), and drops everything while its link is
*cut* (a cut also loses the frames queued on that link: they were on the wire). So a frame from
host A to host B takes ``up(A) + down(B)``, and with ``delay=1`` on A's link only, the round trip
between A and B is 2 s. Bandwidth is ``tc tbf``: on the host's ``eth0`` for *up*, on the hub's
``p<i>`` for *down* (netem is not needed anywhere). The hosts' transmit offloads are switched off,
so every frame is one real packet (a drop loses one segment, as on a wire) with its checksum filled.

The hosts have no route but their /24: nothing a process in a host namespace does can reach an
address outside the lab (nor the machine's own loopback services). Names start with
``nl<pid>-<n>-``, so parallel runs never collide; :meth:`Lab.close` removes everything, and every
process the lab starts (the hub too) gets SIGKILL when the test process dies, so a killed run
leaves only empty namespaces, which :func:`cleanup_stale` (run by every new lab, or
``python tests/netlab.py clean``) deletes.

Self-test tools, run inside a host (``python tests/netlab.py echo|probe|count|send|sink|source``):
UDP and TCP echo, probes that time round trips, a datagram counter and sender, a TCP sink and
source that time throughput. They print one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve()
NAME_RE = re.compile(r"^nl(\d+)-(\d+)-")
_labs_made = 0
_open_tags: set[str] = set()  # the labs of this process that are not closed


class NamespacesRefused(RuntimeError):
    """This machine or user may not create network namespaces (``ip netns add`` failed)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def namespaces() -> list[str]:
    """The names of the machine's named network namespaces (``ip netns list``)."""
    proc = _ip("netns", "list", check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL the processes still running in namespace ``ns`` (all of them started by a lab)."""
    for text in _ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(text), signal.SIGKILL)


def delete_namespace(ns: str) -> None:
    """SIGKILL the processes in namespace ``ns``, then delete it."""
    _kill_inside(ns)
    for _ in range(50):
        proc = _ip("netns", "del", ns, check=False)
        if proc.returncode == 0 or ns not in namespaces():
            return
        time.sleep(0.1)
    raise RuntimeError(f"could not delete network namespace {ns}: {proc.stderr.strip()}")


def cleanup_stale() -> list[str]:
    """Delete the namespaces of labs whose test process is gone (killed runs; one whose pid this
    process now has counts as gone unless its lab is open here); return their names."""
    removed = []
    for ns in namespaces():
        m = NAME_RE.match(ns)
        if not m or f"nl{m.group(1)}-{m.group(2)}" in _open_tags:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or not _pid_alive(pid):
            delete_namespace(ns)
            removed.append(ns)
    return removed


@contextlib.contextmanager
def terminate_as_interrupt():
    """While inside: SIGTERM raises KeyboardInterrupt in the main thread, so the ``finally`` blocks
    that tear labs down run when a CI job or a person terminates the test run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process (its parent thread) dies."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# Run inside a namespace at set-up: IPv6 off (no stray traffic); for a host's device (argv[1]) also
# transmit checksum, TSO and GSO off (one frame = one real packet with its checksum filled: the hub
# forwards bytes as they are), then print the device's MAC address.
_SETUP = r"""
import array, fcntl, socket, struct, sys
for name in ("all", "default"):
    try:
        with open(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6", "w") as fh:
            fh.write("1")
    except FileNotFoundError:  # a kernel without IPv6
        pass
if len(sys.argv) > 1:
    dev = sys.argv[1]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for cmd in (0x17, 0x1F, 0x24):  # ETHTOOL_STXCSUM, ETHTOOL_STSO, ETHTOOL_SGSO: off
            buf = array.array("I", [cmd, 0])
            fcntl.ioctl(s.fileno(), 0x8946, struct.pack("16sP", dev.encode(), buf.buffer_info()[0]) + bytes(16))
    with open(f"/sys/class/net/{dev}/address") as fh:
        print(fh.read().strip())
"""


@dataclass
class Host:
    """One machine of the lab: its name, namespace, address, MAC and link index."""

    name: str
    ns: str
    ip: str
    mac: str
    index: int


class Proc:
    """A process started by :meth:`Lab.spawn` in a host's namespace; its output goes to two files."""

    def __init__(self, lab: Lab, host: Host, name: str, argv: list[str], env: dict[str, str] | None):
        self.lab, self.host, self.name, self.argv, self.env = lab, host, name, list(argv), env
        logs = lab.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = logs / f"{name}.out", logs / f"{name}.err"
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.popen = subprocess.Popen(
                ["ip", "netns", "exec", host.ns, *self.argv],  # ip execs the command: same pid
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None if still running after ``timeout`` seconds."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, sig: int = signal.SIGKILL) -> int | None:
        """Send ``sig`` to the process's group (its own session) and, for SIGKILL, reap it."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            if sig == signal.SIGKILL:
                self.popen.wait(timeout=30)
        return self.popen.poll()

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for_output(self, text: str, timeout: float, stream: str = "stdout") -> str:
        """Wait until ``text`` appears in the process's stdout (or stderr); return that output."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.stdout if stream == "stdout" else self.stderr
            if text in out:
                return out
            if not self.alive:
                raise AssertionError(f"{self.name} exited ({self.returncode}) before printing {text!r}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not print {text!r} within {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.05)

    def tail(self, chars: int = 3000) -> str:
        return f"--- {self.name} stdout:\n{self.stdout[-chars:]}\n--- {self.name} stderr:\n{self.stderr[-chars:]}"


class Link:
    """Host ``host``'s link to the hub: faults on it, per direction (``up``: from the host)."""

    def __init__(self, lab: Lab, host: Host):
        self.lab, self.host = lab, host

    def _dirs(self, direction: str) -> tuple[str, ...]:
        if direction not in ("up", "down", "both"):
            raise ValueError(f"direction {direction!r}: use 'up', 'down' or 'both'")
        return ("up", "down") if direction == "both" else (direction,)

    def set(self, *, delay: float = 0.0, jitter: float = 0.0, loss: float = 0.0, direction: str = "both") -> None:
        """Delay (s), jitter (+- s, uniform, order kept) and loss (0..1) of frames on this link."""
        if delay < 0 or jitter < 0 or not 0 <= loss <= 1:
            raise ValueError(f"delay {delay}, jitter {jitter}, loss {loss}: need delay, jitter >= 0, 0 <= loss <= 1")
        for d in self._dirs(direction):
            self.lab.hub_call("set", port=self.host.index, dir=d, delay=delay, jitter=jitter, loss=loss)

    def cut(self, seconds: float | None = None) -> dict:
        """Drop everything on this link for ``seconds`` (timed by the hub), or until :meth:`restore`.

        Returns the hub's clock (``time.monotonic``, the same in every process here) at the cut's
        start and its planned end (None: until restored).
        """
        return self.lab.hub_call("cut", port=self.host.index, seconds=seconds)

    def restore(self) -> dict:
        """End a cut now; returns the hub's clock at that moment (``at``)."""
        return self.lab.hub_call("restore", port=self.host.index)

    def rate(self, kbit: float | None, direction: str = "both", latency_ms: float = 200.0) -> None:
        """Limit the link to ``kbit`` kbit/s with ``tc tbf`` (None: no limit).

        *up*: tbf on the host's ``eth0``; *down*: on the hub's port. The queue holds ``latency_ms``
        of traffic (tbf drops what does not fit); the bucket is 3000 bytes, two full frames, or a
        hundredth of a second's worth at high rates.
        """
        for d in self._dirs(direction):
            ns, dev = (self.host.ns, "eth0") if d == "up" else (self.lab.hub_ns, f"p{self.host.index}")
            if kbit is None:  # back to the device's default (none to delete: nothing to do)
                cmd = ["tc", "qdisc", "del", "dev", dev, "root"]
            else:
                burst = max(3000, int(kbit * 1000 / 8 / 100))
                cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{kbit}kbit"]
                cmd += ["burst", str(burst), "latency", f"{latency_ms}ms"]
            proc = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=30)
            if proc.returncode != 0 and not (kbit is None and "handle of zero" in proc.stderr):
                raise RuntimeError(f"{' '.join(cmd)} in {ns}: {proc.stderr.strip()}")

    def stats(self) -> dict:
        """The hub's counts for this link: frames passed, lost (loss), cut, failed (a full tbf queue)."""
        return self.lab.hub_call("stats")["ports"][self.host.index]


class Lab:
    """Hosts in network namespaces joined through the hub; see the module's docstring.

    ``hosts`` names the machines (lowercase letters and digits); host i gets ``<subnet>.<i + 1>``.
    Use as a context manager, or :meth:`start` then :meth:`close` (in a ``finally``).
    """

    def __init__(self, hosts: list[str], workdir: Path, subnet: str = "10.201.0", seed: int = 0):
        global _labs_made
        if len(set(hosts)) != len(hosts) or not all(re.fullmatch(r"[a-z][a-z0-9]{0,11}", h) for h in hosts):
            raise ValueError(f"hosts {hosts}: distinct names of lowercase letters and digits, at most 12")
        if "hub" in hosts:
            raise ValueError("hosts: 'hub' is the name of the lab's own namespace; call the host something else")
        if not 1 <= len(hosts) <= 250:
            raise ValueError(f"{len(hosts)} hosts: a lab has 1..250")
        self.tag = f"nl{os.getpid()}-{_labs_made}"
        _labs_made += 1
        _open_tags.add(self.tag)
        self.hub_ns = f"{self.tag}-hub"
        self.workdir = Path(workdir)
        self.subnet, self.seed = subnet, seed
        self.names = list(hosts)
        self.hosts: dict[str, Host] = {}
        self.links: dict[str, Link] = {}
        self.procs: list[Proc] = []
        self._made: list[str] = []
        self._hub: subprocess.Popen | None = None
        self._hub_lock = threading.Lock()
        self._hub_buf = b""
        self._next_id = 0
        self.closed = False

    # -- set-up and tear-down -------------------------------------------------------------------

    def __enter__(self) -> Lab:
        return self if self._made else self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> Lab:
        """Make the namespaces, links and hub. Raises :class:`NamespacesRefused` where ``ip netns
        add`` fails (not root, no namespaces); on any other failure undoes what it made."""
        cleanup_stale()
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            proc = subprocess.run(["ip", "netns", "add", self.hub_ns], capture_output=True, text=True, timeout=60)
        except FileNotFoundError as exc:
            raise NamespacesRefused(f"no `ip` command ({exc})") from None
        if proc.returncode != 0:
            raise NamespacesRefused(f"`ip netns add {self.hub_ns}` failed: {proc.stderr.strip()}")
        self._made.append(self.hub_ns)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _in_ns(self, ns: str, code: str, *args: str) -> str:
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-I", "-S", "-c", code, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"set-up in {ns} failed: {proc.stderr.strip()}")
        return proc.stdout.strip()

    def _build(self) -> None:
        hub = self.hub_ns
        _ip("-n", hub, "link", "set", "lo", "up")
        for i, name in enumerate(self.names):
            ns = f"{self.tag}-{name}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", hub, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            mac = self._in_ns(ns, _SETUP, "eth0")
            ip = f"{self.subnet}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", hub, "link", "set", f"p{i}", "up")
            host = Host(name=name, ns=ns, ip=ip, mac=mac, index=i)
            self.hosts[name], self.links[name] = host, Link(self, host)
        ports = ",".join(f"p{i}" for i in range(len(self.names)))
        self._in_ns(hub, _SETUP)  # the hub's own stack says nothing on the ports
        self._hub_err = (self.workdir / "hub.err").open("wb")
        self._hub = subprocess.Popen(
            ["ip", "netns", "exec", hub, sys.executable, "-I", "-S", str(HERE), "hub", ports, str(self.seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._hub_err,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        ready = self._hub_read(timeout=30)
        if not ready.get("ready"):
            raise RuntimeError(f"the hub did not start: {ready}")

    def close(self) -> None:
        """Kill every process started here, stop the hub, delete the namespaces (idempotent)."""
        if self.closed:
            return
        self.closed = True
        _open_tags.discard(self.tag)
        errors = []
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.kill()
        if self._hub is not None:
            with contextlib.suppress(Exception):
                self._hub.stdin.close()
            try:
                self._hub.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self._hub.pid, signal.SIGKILL)
                self._hub.wait(timeout=30)
            with contextlib.suppress(Exception):
                self._hub.stdout.close()
        with contextlib.suppress(Exception):
            self._hub_err.close()
        for ns in reversed(self._made):
            try:
                delete_namespace(ns)
            except RuntimeError as exc:
                errors.append(str(exc))
        if errors:
            raise RuntimeError("; ".join(errors))

    # -- the hub ----------------------------------------------------------------------------------

    def _hub_read(self, timeout: float) -> dict:
        fd = self._hub.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._hub_buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RuntimeError(f"the hub did not answer within {timeout:.0f} s ({self.workdir / 'hub.err'})")
            chunk = os.read(fd, 65536)
            if not chunk:
                err = (self.workdir / "hub.err").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the hub exited ({self._hub.poll()}): {err}")
            self._hub_buf += chunk
        line, self._hub_buf = self._hub_buf.split(b"\n", 1)
        return json.loads(line)

    def hub_call(self, op: str, **kw) -> dict:
        """Send the hub one command and return its answer (it has taken effect when this returns)."""
        if self._hub is None or self.closed:
            raise RuntimeError("the lab is not running")
        with self._hub_lock:
            self._next_id += 1
            self._hub.stdin.write(json.dumps({"id": self._next_id, "op": op, **kw}).encode() + b"\n")
            self._hub.stdin.flush()
            reply = self._hub_read(timeout=30)
        if reply.get("id") != self._next_id or "error" in reply:
            raise RuntimeError(f"hub {op} {kw}: {reply}")
        return reply

    # -- hosts and processes ----------------------------------------------------------------------

    def ip(self, host: str) -> str:
        return self.hosts[host].ip

    def link(self, host: str) -> Link:
        return self.links[host]

    def spawn(self, host: str, argv: list[str], env: dict[str, str] | None = None, name: str | None = None) -> Proc:
        """Start ``argv`` in ``host``'s namespace; stdout and stderr go to ``workdir/logs/<name>.out|err``."""
        base = name or host
        taken = {p.name for p in self.procs}
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}.{n}"
        proc = Proc(self, self.hosts[host], name, argv, env)
        self.procs.append(proc)
        return proc

    def restart(self, proc: Proc, argv: list[str] | None = None) -> Proc:
        """Kill ``proc`` if it still runs and start it again on its host (``argv``: a new command)."""
        proc.kill()
        return self.spawn(proc.host.name, argv or proc.argv, proc.env, proc.name.split(".")[0])

    def tool(self, host: str, *args: str, name: str | None = None) -> Proc:
        """Start one of this module's self-test tools (``echo``, ``probe``, ...) on ``host``."""
        return self.spawn(host, [sys.executable, "-I", "-S", str(HERE), *args], name=name or f"{host}-{args[0]}")

    def report(self, chars: int = 2000) -> str:
        """Every process's exit code and output tail, for a failing test's message."""
        parts = [f"{p.name} (pid {p.pid}, exit {p.returncode}):\n{p.tail(chars)}" for p in self.procs]
        return "\n".join(parts)


# =================================================================================================
# The hub: a user-space switch with a delay/loss/cut stage per link and direction (runs in the hub
# namespace as ``python tests/netlab.py hub p0,p1,... SEED``; commands on stdin, answers on stdout).

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_IGNORE_OUTGOING = 23
PACKET_OUTGOING = 4
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
INF = float("inf")


@dataclass
class Stage:
    """One direction of one link: a FIFO of (due time, frame) with its rules and counts."""

    rng: random.Random
    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    queue: deque = field(default_factory=deque)
    last_due: float = 0.0
    passed: int = 0
    lost: int = 0
    cut: int = 0
    failed: int = 0

    def admit(self, frame: bytes, t: float) -> bool:
        """Queue ``frame`` (arrived at ``t``) unless the loss draw drops it."""
        if self.loss and self.rng.random() < self.loss:
            self.lost += 1
            return False
        due = t + self.delay + (self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0)
        due = max(due, t, self.last_due)  # FIFO: jitter never reorders
        self.last_due = due
        self.queue.append((due, frame))
        return True

    def counts(self) -> dict:
        return {"passed": self.passed, "lost": self.lost, "cut": self.cut, "failed": self.failed}


class Port:
    def __init__(self, index: int, dev: str, seed: int):
        self.index, self.dev = index, dev
        self.up = Stage(random.Random(f"{seed}-{index}-up"))
        self.down = Stage(random.Random(f"{seed}-{index}-down"))
        self.cut_until = 0.0
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        with contextlib.suppress(OSError):
            s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        for opt in (SO_RCVBUFFORCE, SO_SNDBUFFORCE):
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
        s.bind((dev, ETH_P_ALL))
        s.setblocking(False)
        self.sock = s

    def is_cut(self, now: float) -> bool:
        return now < self.cut_until


class Hub:
    def __init__(self, devs: list[str], seed: int):
        self.ports = [Port(i, d, seed) for i, d in enumerate(devs)]
        self.by_fd = {p.sock.fileno(): p for p in self.ports}
        self.macs: dict[bytes, Port] = {}

    def ingress(self, port: Port, frame: bytes, now: float) -> None:
        self.macs[frame[6:12]] = port
        if port.is_cut(now):
            port.up.cut += 1
        else:
            port.up.admit(frame, now)

    def switch(self, src: Port, frame: bytes, t: float, now: float) -> None:
        """A frame leaves ``src``'s up stage at ``t``: hand it to its destinations' down stages."""
        if src.is_cut(now):
            src.up.cut += 1
            return
        src.up.passed += 1
        dst = None if frame[0] & 1 else self.macs.get(frame[:6])
        for p in (dst,) if dst is not None else self.ports:
            if p is src:
                continue
            if p.is_cut(now):
                p.down.cut += 1
            else:
                p.down.admit(frame, t)

    def release(self, now: float) -> None:
        for p in self.ports:
            q = p.up.queue
            while q and q[0][0] <= now:
                due, frame = q.popleft()
                self.switch(p, frame, due, now)
        for p in self.ports:
            q = p.down.queue
            while q and q[0][0] <= now:
                _, frame = q.popleft()
                if p.is_cut(now):
                    p.down.cut += 1
                    continue
                try:
                    p.sock.send(frame)
                    p.down.passed += 1
                except OSError:  # ENOBUFS / EAGAIN: tbf's queue is full; ENETDOWN
                    p.down.failed += 1

    def next_due(self) -> float | None:
        dues = [s.queue[0][0] for p in self.ports for s in (p.up, p.down) if s.queue]
        return min(dues) if dues else None

    def command(self, msg: dict) -> dict:
        op, now = msg.get("op"), time.monotonic()
        out: dict = {"id": msg.get("id"), "at": now}
        if op == "set":
            stage = getattr(self.ports[msg["port"]], msg["dir"])
            stage.delay, stage.jitter, stage.loss = float(msg["delay"]), float(msg["jitter"]), float(msg["loss"])
        elif op == "cut":
            port = self.ports[msg["port"]]
            seconds = msg.get("seconds")
            port.cut_until = INF if seconds is None else now + float(seconds)
            out.update(start=now, until=None if seconds is None else port.cut_until)
        elif op == "restore":
            self.ports[msg["port"]].cut_until = 0.0
        elif op == "stats":
            out["ports"] = [{"up": p.up.counts(), "down": p.down.counts()} for p in self.ports]
        elif op != "ping":
            out["error"] = f"unknown op {op!r}"
        return out

    def run(self, control: int) -> None:
        os.set_blocking(control, False)
        buf = b""
        sys.stdout.write(json.dumps({"ready": True, "ports": [p.dev for p in self.ports]}) + "\n")
        sys.stdout.flush()
        fds = [control, *self.by_fd]
        while True:
            now = time.monotonic()
            self.release(now)
            due = self.next_due()
            timeout = None if due is None else max(0.0, due - time.monotonic())
            ready, _, _ = select.select(fds, [], [], timeout)
            now = time.monotonic()
            for fd in ready:
                if fd == control:
                    chunk = os.read(control, 65536)
                    if not chunk:
                        return  # the test process closed the pipe (or died): the lab is over
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        try:
                            reply = self.command(json.loads(line))
                        except Exception as exc:  # a bad command is answered, the hub keeps running
                            reply = {"error": f"{type(exc).__name__}: {exc}"}
                        sys.stdout.write(json.dumps(reply) + "\n")
                        sys.stdout.flush()
                    continue
                port = self.by_fd[fd]
                for _ in range(512):  # then the other ports get their turn
                    try:
                        frame, addr = port.sock.recvfrom(65600)
                    except (BlockingIOError, InterruptedError):
                        break
                    if addr[2] != PACKET_OUTGOING:
                        self.ingress(port, frame, now)


# =================================================================================================
# Self-test tools (run inside a host: ``python tests/netlab.py TOOL ...``; one JSON line out).


def _addr(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def tool_echo(args) -> None:
    """UDP and TCP echo on ``--bind``; prints ``ready`` once both listen."""
    addr = _addr(args.bind)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    udp.bind(addr)
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(addr)
    tcp.listen(16)

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            conn, _ = tcp.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print("ready", flush=True)
    while True:
        data, peer = udp.recvfrom(65536)
        udp.sendto(data, peer)


def tool_probe(args) -> None:
    """``--count`` UDP probes to ``--to`` every ``--interval`` s, and (``--tcp``) at the same time a
    TCP connect and one echo; waits ``--wait`` s after the last probe. Prints send times and round
    trips (``time.monotonic``, the same clock in every process of the machine)."""
    target = _addr(args.to)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(0.1)
    sent: dict[int, float] = {}
    rtt: dict[int, float] = {}
    tcp_out: dict = {}
    stop = threading.Event()

    def receive() -> None:
        while not stop.is_set():
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            (k,) = struct.unpack("!I", data[:4])
            rtt.setdefault(k, time.monotonic() - sent[k])

    def tcp_probe() -> None:
        t0 = time.monotonic()
        with socket.create_connection(target, timeout=60) as c:
            t1 = time.monotonic()
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c.sendall(b"x" * 64)
            got = b""
            while len(got) < 64:
                got += c.recv(64)
            tcp_out.update(connect=t1 - t0, echo=time.monotonic() - t1)

    threads = [threading.Thread(target=receive, daemon=True)]
    if args.tcp:
        threads.append(threading.Thread(target=tcp_probe, daemon=True))
    for t in threads:
        t.start()
    start = time.monotonic()
    for k in range(args.count):
        time.sleep(max(0.0, start + k * args.interval - time.monotonic()))
        sent[k] = time.monotonic()
        sock.sendto(struct.pack("!I", k) + b"p" * 60, target)
    time.sleep(args.wait)
    if args.tcp:
        threads[1].join(timeout=60)
    stop.set()
    threads[0].join()
    print(
        json.dumps({"sent": [sent[k] for k in sorted(sent)], "rtt": [rtt.get(k) for k in sorted(sent)], "tcp": tcp_out})
    )


def tool_count(args) -> None:
    """Count UDP datagrams on ``--bind`` until ``--idle`` s pass without one (after the first)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind(_addr(args.bind))
    print("ready", flush=True)
    n = 0
    sock.settimeout(None)
    while True:
        try:
            sock.recv(65536)
        except TimeoutError:
            break
        n += 1
        sock.settimeout(args.idle)
    print(json.dumps({"received": n}), flush=True)


def tool_send(args) -> None:
    """Send ``--count`` UDP datagrams to ``--to``, one every ``--interval`` s."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    target, start = _addr(args.to), time.monotonic()
    for k in range(args.count):
        delay = start + k * args.interval - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sock.sendto(struct.pack("!I", k) + b"s" * 100, target)
    print(json.dumps({"sent": args.count}), flush=True)


def tool_sink(args) -> None:
    """Accept one TCP connection on ``--bind``, read it to the end; print bytes and their times."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(_addr(args.bind))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    total, marks = 0, []
    with conn:
        while data := conn.recv(65536):
            total += len(data)
            marks.append((time.monotonic(), total))
    print(json.dumps({"bytes": total, "marks": marks[:: max(1, len(marks) // 400)] + marks[-1:]}), flush=True)


def tool_source(args) -> None:
    """Send to ``--to`` over TCP as fast as the link takes it for ``--seconds`` s."""
    chunk = b"\0" * 16384
    with socket.create_connection(_addr(args.to), timeout=30) as c:
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            c.sendall(chunk)
    print(json.dumps({"done": True}), flush=True)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "hub":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        Hub(argv[1].split(","), int(argv[2])).run(sys.stdin.fileno())
        return 0
    p = argparse.ArgumentParser(prog="tests/netlab.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="tool", required=True)
    sub.add_parser("clean", help="delete the namespaces of labs whose test process is gone")
    s = sub.add_parser("echo")
    s.add_argument("--bind", required=True)
    s = sub.add_parser("probe")
    s.add_argument("--to", required=True)
    s.add_argument("--count", type=int, default=10)
    s.add_argument("--interval", type=float, default=0.1)
    s.add_argument("--wait", type=float, default=3.0)
    s.add_argument("--tcp", action="store_true")
    s = sub.add_parser("count")
    s.add_argument("--bind", required=True)
    s.add_argument("--idle", type=float, default=1.0)
    s = sub.add_parser("send")
    s.add_argument("--to", required=True)
    s.add_argument("--count", type=int, default=1000)
    s.add_argument("--interval", type=float, default=0.001)
    s = sub.add_parser("sink")
    s.add_argument("--bind", required=True)
    s = sub.add_parser("source")
    s.add_argument("--to", required=True)
    s.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args(argv)
    if args.tool == "clean":
        print("\n".join(cleanup_stale()) or "no stale lab namespaces")
        return 0
    globals()[f"tool_{args.tool}"](args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
