"""Atomic file writes (a reader sees the old file or the new one, never half of one) and output folders."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(
    path: str | Path, write: Callable[[BinaryIO], None], prefix: str | None = None, durable: bool = False
) -> Path:
    """Write ``path`` through ``write(fh)`` into a temporary file beside it, fsync, then rename.

    The parent folder is created if needed. If ``write`` raises (or the process is interrupted),
    the temporary file is removed and ``path`` is untouched. With ``durable`` the folder is fsynced
    after the rename too, so that the new file, not the old one, is there after a power loss (a
    checkpoint that another process is told about: a silo's state before it answers the server).

    Parameters
    ----------
    path : str or Path
        The target file.
    write : callable
        Writes the content to the binary file object it is given.
    prefix : str, optional
        The temporary file's name prefix (default ``<name>.``); it ends in ``.tmp``.
    durable : bool
        Also fsync the folder after the rename (where the file system allows it).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix if prefix is not None else path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_folder(path.parent)
    return path


def _fsync_folder(folder: Path) -> None:
    """fsync a folder, so that a rename in it survives a power loss (skipped where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def make_folder(path: str | Path) -> Path:
    """Create folder ``path`` and its parents (an existing folder is fine), or say what is in the way.

    Parameters
    ----------
    path : str or Path
        The folder.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    OSError
        One line from :func:`folder_error`: ``path`` or a parent is a file, a folder on the way is
        not writable, or the system's own reason, naming the path.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise folder_error(path, exc) from None
    return path


def folder_error(path: str | Path, exc: OSError) -> OSError:
    """``exc``, raised creating or writing in folder ``path``, as one line naming the culprit and the fix.

    A file where ``path`` or one of its parents should be becomes a :class:`NotADirectoryError`
    naming that file; a permission error names the nearest existing folder; anything else keeps the
    system's reason and names the file it was about.
    """
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    in_the_way = isinstance(exc, (FileExistsError, NotADirectoryError))
    if in_the_way and existing is not None and not existing.is_dir():
        return NotADirectoryError(f"{existing} is a file, not a folder: move it away or rename it")
    if isinstance(exc, PermissionError):
        return PermissionError(f"{existing or path} is not writable (permission denied): make it writable")
    return type(exc)(f"{exc.filename or path}: {exc.strerror or exc}")
