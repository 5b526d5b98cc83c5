"""Atomic checkpoints that a resumed run can trust, or refuse with a reason."""

from __future__ import annotations

import hashlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from .atomic import atomic_write

FORMAT_VERSION = 1
DIGEST_KEY = "sha256"
"""The key of the content digest every checkpoint carries (:func:`content_digest`)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or belongs to a different run."""


def content_digest(obj: Any) -> str:
    """SHA-256 over a checkpoint's content: every tensor's dtype, shape and bytes, every other value's repr.

    Dicts are walked in sorted key order, so the digest does not depend on insertion order. torch's
    zip reader does not check the archive's CRCs; this digest is what catches damaged tensor bytes.
    """
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor) and x.layout == torch.sparse_coo:
            t = x.detach().cpu().coalesce()
            h.update(f"S{tuple(t.shape)}".encode())
            walk(t.indices())
            walk(t.values())
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[" if isinstance(x, list) else b"(")
            for v in x:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``path`` atomically and durably (temporary file, fsync, rename, fsync of the folder),
    with a content digest.

    A crash mid-write leaves the previous checkpoint intact; once this returns, the new one survives
    a power loss too. Temporary files that earlier killed writes left beside ``path`` are removed first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(path.name + ".*.tmp"):
        stale.unlink(missing_ok=True)
    body = {"format": FORMAT_VERSION, **payload}
    body[DIGEST_KEY] = content_digest(body)
    return atomic_write(path, lambda fh: torch.save(body, fh), durable=True)


def load_checkpoint(
    path: str | Path, fingerprint: str | None = None, config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Read a checkpoint, checking its format, its content digest and (optionally) the run's config.

    Parameters
    ----------
    path : str or Path
        The checkpoint.
    fingerprint : str, optional
        The resuming run's config fingerprint; a checkpoint written under another is refused.
    config : dict, optional
        The resuming run's config (``ExperimentConfig.to_dict()``): a refusal then names the keys
        that differ from the config kept in the checkpoint (``payload["config"]``; for older
        checkpoints, the run's ``config.yaml`` beside the checkpoint folder), with both values.

    Raises
    ------
    CheckpointError
        With the path and what is wrong: missing, unreadable/corrupt, content that does not match
        its digest, unknown format, or written by a run with a different configuration.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder, not a checkpoint file; pass the checkpoint (a run's checkpoints/last.pt), or the "
            "run folder where the command takes one"
        )
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: nothing to resume (run without --resume to start)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a damaged file
        if isinstance(exc, pickle.UnpicklingError) and "weights only load failed" in str(exc).lower():
            raise _unsafe_pickle(path, exc) from None
        raise CheckpointError(
            f"checkpoint {path} is corrupt or unreadable ({type(exc).__name__}: {exc}); it was left untouched. "
            "Resume from an intact copy or start a new run."
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} is not a fedml_ssfl checkpoint of format {FORMAT_VERSION}")
    digest = payload.pop(DIGEST_KEY, None)
    if digest is None or digest != content_digest(payload):
        what = "carries no content digest" if digest is None else "does not match its content digest"
        raise CheckpointError(
            f"checkpoint {path} {what}: its bytes were damaged or it was not written by fedml_ssfl; it was left "
            "untouched. Resume from an intact copy or start a new run."
        )
    if fingerprint is not None and payload.get("fingerprint") != fingerprint:
        raise CheckpointError(_refusal(path, payload, fingerprint, config))
    return payload


def _unsafe_pickle(path: Path, exc: Exception) -> CheckpointError:
    """A pickle holding more than tensors and plain containers: refused, without PyTorch's advice to unpickle it."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
    what = f" ({found.group(1)})" if found else ""
    return CheckpointError(
        f"{path} is not a fedml_ssfl checkpoint: it holds pickled Python objects{what} beyond tensors, and unpickling "
        "them could run code, so it is refused; pass a checkpoint `fedml-ssfl run` wrote (checkpoints/last.pt)"
    )


IGNORED_KEYS = (
    "common_args.run_name",
    "common_args.output_dir",
    "common_args.run_id",
    "tracking_args.progress_bar",
    "device_args.state_memory_mb",
    "device_args.state_spill_dir",
    "device_args.data_on_device",
)
"""Config keys a resume may change (where outputs go, the run id, the progress bar, where client states
and images live): not in the fingerprint."""

ADDED_KEYS = {"model_args.logits": ""}
"""Config keys added after checkpoints were first written, with their defaults: a checkpoint's config without
one held the default (so it is no difference)."""

_SHOWN = 8
"""How many differing keys a refusal names before it counts the rest."""


def _refusal(path: Path, payload: dict[str, Any], fingerprint: str, config: dict[str, Any] | None) -> str:
    """The one-line refusal of a checkpoint written under another config, naming the keys that differ."""
    run_dir = path.parent.parent
    own = run_dir / "config.yaml"
    fix = (
        f"resume with the run's own config (`fedml-ssfl run {own} --resume {run_dir}`) or start a new run"
        if own.is_file()
        else "resume with the config that wrote it, or start a new run"
    )
    saved = payload.get("config")
    if not isinstance(saved, dict):  # checkpoints written before the config was kept in them
        saved = _saved_config(own)
    differ = config_difference(saved, config) if saved is not None and config is not None else []
    if not differ:
        return (
            f"resume refused: {path} was written under another config (fingerprint {payload.get('fingerprint')}, "
            f"now {fingerprint}); {fix}"
        )
    shown = "; ".join(differ[:_SHOWN]) + (f"; and {len(differ) - _SHOWN} more" if len(differ) > _SHOWN else "")
    return f"resume refused: the config differs from the checkpoint's ({path}): {shown}; {fix}"


def _saved_config(path: Path) -> dict[str, Any] | None:
    """The run's ``config.yaml`` as a mapping, or None when it is missing or unreadable."""
    import yaml

    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def config_difference(saved: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """``section.key (checkpoint A, now B)`` for every key in which two sectioned configs differ.

    Keys in :data:`IGNORED_KEYS` are left out; a key one side lacks shows as ``unset``.
    """
    missing = object()

    def show(value: Any) -> str:
        return "unset" if value is missing else repr(value) if isinstance(value, str) else str(value)

    keys = []
    for section in sorted(set(saved) | set(config)):
        a, b = saved.get(section) or {}, config.get(section) or {}
        if not isinstance(a, dict) or not isinstance(b, dict):
            continue
        for key in sorted(set(a) | set(b)):
            dotted = f"{section}.{key}"
            default = ADDED_KEYS.get(dotted, missing)
            old, new = a.get(key, default), b.get(key, default)
            if dotted not in IGNORED_KEYS and old != new:
                keys.append(f"{dotted} (checkpoint {show(old)}, now {show(new)})")
    return keys
