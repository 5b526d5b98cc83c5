"""Atomic checkpoints that a resumed run can trust, or refuse with a reason."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or belongs to a different run."""


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``path`` atomically (temporary file, fsync, rename).

    A crash mid-write leaves the previous checkpoint intact.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({"format": FORMAT_VERSION, **payload}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | Path, fingerprint: str | None = None) -> dict[str, Any]:
    """Read a checkpoint, checking its format and (optionally) the run's config fingerprint.

    Raises
    ------
    CheckpointError
        With the path and what is wrong: missing, unreadable/corrupt, unknown format, or
        written by a run with a different configuration.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: nothing to resume (run without --resume to start)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a damaged file
        raise CheckpointError(
            f"checkpoint {path} is corrupt or unreadable ({type(exc).__name__}: {exc}); it was left untouched. "
            "Resume from an intact copy or start a new run."
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} is not a fedml_ssfl checkpoint of format {FORMAT_VERSION}")
    if fingerprint is not None and payload.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} was written by a run with a different configuration (fingerprint "
            f"{payload.get('fingerprint')} vs {fingerprint}); refusing to resume. Resume with the run's own "
            "config.yaml, or start a new run."
        )
    return payload
