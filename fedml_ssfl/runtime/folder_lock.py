"""One process per run folder: an exclusive lock on a file in it, held for the run's life.

A run, a resume, the FedML server and a deployed silo each hold the lock of the folder they write
(``fcntl.flock`` on ``<folder>/.lock``, taken without waiting). A second process that wants the same
folder is refused at once with one line naming the folder, the holder (pid, host and start time,
which the holder writes into the lock file) and the fix, before it reads or writes anything there:
two resumes of one folder would otherwise both run and write their rounds twice. The lock goes with
the process: released when the run ends, and by the operating system when the process exits or is
killed, so a crashed run never leaves its folder locked (the file itself stays; it holds nothing).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from ..atomic import folder_error
from ..errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
"""The file in a run folder whose lock marks the folder in use."""


class FolderInUse(ConfigError):
    """Another process holds the folder (the message names the folder, the holder and the fix)."""


class FolderLock:
    """The lock on one folder, held until :meth:`release` (or the process ends).

    Parameters
    ----------
    folder : Path
        The locked folder.
    fd : int or None
        The lock file's descriptor (None: the file system refused locks; nothing is held).
    """

    def __init__(self, folder: Path, fd: int | None) -> None:
        self.folder, self.fd = Path(folder), fd

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        """Let the folder go (closing the file releases the lock; the file stays)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:  # a lock nobody holds any more lets the folder go
        self.release()

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_folder(folder: str | Path, what: str = "the run folder") -> FolderLock:
    """Take ``folder``'s lock for this process (``folder`` must exist), or refuse at once.

    Parameters
    ----------
    folder : path
        The folder to hold.
    what : str
        What the folder is, as the refusal names it (``the run folder``, ``silo 2's folder``).

    Returns
    -------
    FolderLock
        Held until released or the process ends. Where the file system does not support locks
        (some network file systems) a warning says so and nothing is held.

    Raises
    ------
    FolderInUse
        Another process holds it: one line naming the folder, the holder and the fix.
    ConfigError
        The lock file cannot be made there (the folder is not writable; names it).
    """
    folder = Path(folder)
    path = folder / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot lock {what} {folder}: {folder_error(folder, exc)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise FolderInUse(
            f"{what} {folder} is in use by another process ({holder}): a second run or resume of one folder "
            "would write its rounds twice; wait for that one to end (or stop it), then run again, or give this "
            "run another folder"
        ) from None
    except OSError as exc:  # ENOLCK / EINVAL: no locks on this file system
        os.close(fd)
        log.warning("cannot lock %s %s (%s): a second run of it at once would not be refused", what, folder, exc)
        return FolderLock(folder, None)
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200],
    }
    with contextlib.suppress(OSError):  # who holds it, for the refusal of the next one
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    return FolderLock(folder, fd)


def _read_holder(fd: int) -> str:
    """``pid N on host H since T`` from the lock file the holder wrote (what is known of it)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "holder unknown"
    text = f"pid {info['pid']}"
    if info.get("host"):
        text += f" on host {info['host']}"
    if info.get("since"):
        text += f" since {info['since']}"
    if info.get("command"):
        text += f": {info['command']}"
    return text
