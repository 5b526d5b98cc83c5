"""Atomic file writes (a reader sees the old file or the new one, never half of one) and output folders."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Give an :class:`OSError` the block raises without a file name (a full disk at a flush) the name ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise type(exc)(exc.errno, exc.strerror or str(exc), str(path)) from exc


class _WriteErrors:
    """The temporary file as ``write`` sees it, keeping the :class:`OSError` a write raised.

    Some writers hide it: ``torch.save`` turns a full disk into ``RuntimeError: [enforce fail at
    inline_container.cc] ... unexpected pos``. :func:`atomic_write` raises the kept error instead.
    """

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name: str) -> Any:  # tell, seek, flush ...: the file's own
        return getattr(self._fh, name)


def atomic_write(
    path: str | Path, write: Callable[[BinaryIO], None], prefix: str | None = None, durable: bool = False
) -> Path:
    """Write ``path`` through ``write(fh)`` into a temporary file beside it, fsync, then rename.

    The parent folder is created if needed. If ``write`` raises (or the process is interrupted),
    the temporary file is removed and ``path`` is untouched. A write that failed for want of space
    (or any other :class:`OSError`) is raised as that :class:`OSError`, naming ``path``, even where
    the writer turned it into another exception. With ``durable`` the folder is fsynced after the
    rename too, so that the new file, not the old one, is there after a power loss (a checkpoint
    that another process is told about: a silo's state before it answers the server).

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
        with naming(path), os.fdopen(fd, "wb") as fh:  # an error names the file asked for, not the temporary one
            target = _WriteErrors(fh)
            try:
                write(target)  # type: ignore[arg-type]
            except OSError:
                raise
            except Exception as exc:
                if target.error is None:
                    raise
                raise target.error from exc  # the disk's reason, not the writer's wrapping of it
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
