"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None], prefix: str | None = None) -> Path:
    """Write ``path`` through ``write(fh)`` into a temporary file beside it, fsync, then rename.

    The parent folder is created if needed. If ``write`` raises (or the process is interrupted),
    the temporary file is removed and ``path`` is untouched.

    Parameters
    ----------
    path : str or Path
        The target file.
    write : callable
        Writes the content to the binary file object it is given.
    prefix : str, optional
        The temporary file's name prefix (default ``<name>.``); it ends in ``.tmp``.
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
    return path
