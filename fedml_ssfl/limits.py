"""The documented limit on what one input may make this process allocate.

A reader of a user's file (an npz archive, an image folder, an image, a dataset file) reads the
sizes its header declares, adds them up and compares the sum with :func:`input_limit` **before**
it decodes or allocates anything; a file whose header claims more is refused in one line naming
the file, the size and this limit. So a 2 MB zip bomb or an npz whose header claims 5.8 TiB costs
nothing to refuse, and nothing a file says makes the process allocate more than a bounded share
of its memory (a reader's working copies come on top: about twice the limit at most).

The limit is ``FEDML_SSFL_MAX_INPUT_BYTES`` when set (e.g. ``64GiB``), else a quarter of the
memory this process may use: the machine's RAM, or less where a cgroup's ``memory.max`` or an
address-space limit (``ulimit -v``, ``RLIMIT_AS``) allows less.
"""

from __future__ import annotations

import os
import resource
import stat
from pathlib import Path

from . import envvars
from .errors import ConfigError

MAX_CLASSES = 100_000
"""The most classes a dataset may have (ImageNet-21k has 21,841): a label, ``num_classes`` or a ``class_names``
list beyond it is refused before any per-class list is built."""

MAX_IMAGE_PIXELS = 4096 * 4096
"""The most pixels one image file may have (read from its header before it is decoded)."""

INPUT_ENV = "FEDML_SSFL_MAX_INPUT_BYTES"
"""The environment variable that sets :func:`input_limit`."""

DEFAULT_SHARE = 4
"""Without :data:`INPUT_ENV`, one input may take 1 / DEFAULT_SHARE of :func:`usable_memory`."""

_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _cgroup_limit() -> int | None:
    for name in _CGROUP_FILES:
        try:
            text = Path(name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # cgroup v1 says "no limit" with a huge number
            return int(text)
    return None


def _address_space_left() -> int | None:
    """Bytes of address space this process may still map under ``RLIMIT_AS`` (None: no such limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        mapped = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        mapped = 0
    return max(soft - mapped, 0)


def usable_memory() -> int:
    """The memory this process may use: RAM, a cgroup limit or the address space left, the smallest."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        ram = 8 * 2**30
    return min(x for x in (ram, _cgroup_limit(), _address_space_left()) if x is not None)


def input_limit() -> int:
    """Bytes one input may decode to: :data:`INPUT_ENV`, else a quarter of :func:`usable_memory`."""
    return envvars.nbytes(INPUT_ENV, usable_memory() // DEFAULT_SHARE)


def size_text(n: int | float) -> str:
    """``n`` bytes for a message: ``512 bytes``, ``1.5 MiB``, ``5.8 TiB``."""
    if n < 1024:
        return f"{int(n)} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def too_large(what: str, nbytes: int, limit: int | None = None) -> str | None:
    """The refusal text when ``what`` would decode to more than ``limit`` (default :func:`input_limit`)."""
    limit = input_limit() if limit is None else limit
    if nbytes <= limit:
        return None
    return (
        f"{what} would take {size_text(nbytes)} decoded, more than the {size_text(limit)} one input may take "
        f"({INPUT_ENV}; default a quarter of this machine's memory): split the data into smaller files, or raise "
        f"{INPUT_ENV} if the machine has the memory"
    )


MAX_SMALL_FILE = 2**20
"""The largest small input file read whole (a TLS PEM file, the job key, an ipconfig CSV, a GPU mapping): each is
a few KiB; a device (``/dev/zero``) or a huge file is refused unread."""


def read_small_file(path: str | Path, what: str, fix: str, limit: int = MAX_SMALL_FILE) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; else one :class:`ConfigError`.

    ``what`` names the input (``comm_args.tls_cert``) and ``fix`` says what to pass instead. A folder, a
    device, a pipe or a socket is refused by name without reading (a pipe is opened non-blocking, so
    naming one does not hang), and a file larger than ``limit`` after reading ``limit + 1`` bytes at most.
    """
    p = Path(path).expanduser()
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except IsADirectoryError:
        raise ConfigError(f"{what}: {p} is a folder, not a file; {fix}") from None
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {p} ({exc.strerror or exc}); {fix}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"{what}: {p} is a folder, not a file; {fix}")
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{what}: {p} is not a regular file (a device, pipe or socket); {fix}")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {p} ({exc.strerror or exc}); {fix}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise ConfigError(f"{what}: {p} is larger than {size_text(limit)}, too large for what it should hold; {fix}")
    return b"".join(chunks)


def text_position(data: bytes, offset: int) -> str:
    """``line L, column C`` of byte ``offset`` in ``data`` (both from 1; the column counts bytes)."""
    line = data.count(b"\n", 0, offset) + 1
    column = offset - (data.rfind(b"\n", 0, offset) + 1) + 1
    return f"line {line}, column {column}"
