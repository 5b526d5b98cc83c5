"""Per-client persistent state in bounded memory: resident up to a byte budget, the rest on disk.

A runtime keeps one ``state`` dict per client id and hands it to ``client_update``, which may
change it in place. With thousands of clients (FedSiam's per-client target net, FedMatch's held
copy of sigma and psi, FedSEAL's running ensemble) those states outgrow memory.
:class:`ClientStateStore` is a ``MutableMapping[int, dict]`` that keeps the most recently used
states in memory up to ``budget_bytes`` and writes the least recently used ones to a spill folder;
reading a spilled state loads it back bit for bit (same tensors, dtypes, shapes, strides, nested
dicts / lists / tuples / scalars), so algorithms see no difference.

Files are content addressed: ``<sha256 of the bytes>.pt``, written with :func:`torch.save` and read
with ``torch.load(weights_only=True)`` (tensors and plain containers only; no arbitrary pickle). A
file whose bytes do not hash to its name is refused with one line naming it.

Checkpoints (:func:`client_state_payload`) keep the resident states inline and list the spilled ones
by digest; their files are hard-linked (or, across file systems, copied) into the checkpoint's
``client_states/`` folder and fsynced before the checkpoint is renamed into place, and
:func:`prune_state_files` removes the files the new checkpoint no longer names only after it is
written. A spill file is verified (its bytes hashed against the digest in its name) as it is
linked, and a copy is verified as it is copied, so a spill file damaged since it was written never
reaches a checkpoint: the checkpoint is not written, the error names the file, and the previous
checkpoint, whose files are not that file, stays good. Once linked, a file is the checkpoint's, and
the store reads it from there (files a later checkpoint names again are not read again; every file
is verified on every read and on resume). :func:`open_client_states` rebuilds the states from such a
checkpoint. Without a budget the states are a plain ``dict``, as before: no overhead and the
checkpoint layout unchanged.

The same store keeps an algorithm's per-client records on the server side (its
``client_records``, e.g. FedMatch's ``views`` and ``client_psi``; :mod:`fedml_ssfl.runtime.common`):
their spilled files share the checkpoint's folder and are listed under :data:`RECORD_FILES_KEY`.

The contract for callers: the state returned by ``store[k]`` (or stored by ``store[k] = v``) may be
changed in place until the next access to the store, which re-measures it; a state obtained
earlier may have been spilled since, so changes to it after that are not kept.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .atomic import atomic_write

STATES_DIR = "client_states"
"""The folder beside a checkpoint holding the files of the states it lists by digest."""

FILES_KEY = "client_state_files"
"""The checkpoint key mapping a spilled client id to its file's digest (absent: every state inline)."""

RECORD_FILES_KEY = "server_record_files"
"""The checkpoint key mapping each of the algorithm's spilled per-client server records (FedMatch's
``views``, ``client_psi``) to ``{client id: digest}`` of files in :data:`STATES_DIR` (absent: every
record inline in the algorithm's state, the layout without a budget)."""

OBJECT_OVERHEAD = 64
"""Bytes counted for each Python object of a state besides tensor storage (dicts, lists, scalars)."""

TENSOR_OVERHEAD = 128
"""Bytes counted for each tensor object besides its storage."""

_SUFFIX = ".pt"
_CHUNK = 1 << 20


class ClientStateError(RuntimeError):
    """A spilled or checkpointed client state file is missing, damaged or unreadable.

    ``path`` is the file (None when the error is about a folder, e.g. one that cannot be written).
    """

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


# ---------------------------------------------------------------------------------------------
# sizes and files


def state_size(state: Any) -> int:
    """The bytes a state holds in memory: tensor storage (each storage once) plus a small overhead per object.

    Parameters
    ----------
    state : Any
        A client state: nested dicts / lists / tuples of tensors and scalars.

    Returns
    -------
    int
        Storage bytes of every distinct tensor storage (a view counts its whole storage, once), plus
        :data:`TENSOR_OVERHEAD` per tensor and :data:`OBJECT_OVERHEAD` per other object.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [state]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            total += TENSOR_OVERHEAD
            if x.layout != torch.strided:  # sparse: its indices and values
                stack.extend((x._indices(), x._values()) if x.is_sparse else ())
                continue
            storage = x.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(x, dict):
            total += OBJECT_OVERHEAD
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            total += OBJECT_OVERHEAD
            stack.extend(x)
        else:
            total += OBJECT_OVERHEAD
    return total


class _HashingWriter:
    """A binary file that also hashes what is written to it (SHA-256)."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.sha = fh, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha.update(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def _digest_of_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _damaged(path: Path, what: str) -> ClientStateError:
    return ClientStateError(
        f"client state file {path} {what}; it was left untouched. Resume from an intact checkpoint or start a new run.",
        Path(path),
    )


def write_state_file(folder: Path, state: Any) -> str:
    """Write ``state`` to ``folder/<sha256>.pt`` (kept if already there: same name, same bytes); return the digest.

    :func:`torch.save` streams into the file while the bytes are hashed, so no copy of the encoded
    state is held in memory (a bytes copy per spill fragments the heap: measured ~2x the budget).
    """
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".state.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as fh:
            out = _HashingWriter(fh)
            torch.save(state, out)
        digest = out.sha.hexdigest()
        path = folder / (digest + _SUFFIX)
        if path.exists():
            Path(tmp).unlink()
        else:
            os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise ClientStateError(
            f"cannot write a client state into {folder}: {exc.strerror or exc}; free disk space there, or set "
            "device_args.state_spill_dir to another folder (or device_args.state_memory_mb higher)"
        ) from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    return digest


def read_state_file(path: Path) -> Any:
    """Load a state file, checking that its bytes hash to its name.

    Raises
    ------
    ClientStateError
        One line naming the file: missing, damaged (hash mismatch) or not loadable as tensors and
        plain containers.
    """
    path = Path(path)
    verify_state_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for bytes it refuses
        raise _damaged(path, f"is not a client state ({type(exc).__name__})") from None


def verify_state_file(path: Path) -> None:
    """Check that ``path`` exists and its bytes hash to its name (read in chunks; nothing is loaded)."""
    try:
        digest = _digest_of_file(path)
    except OSError as exc:
        raise _damaged(path, f"cannot be read ({exc.strerror or exc})") from None
    if digest != path.stem:
        raise _damaged(path, "does not match the SHA-256 in its name (its bytes were damaged)")


def _place(src: Path, folder: Path) -> tuple[Path, bool]:
    """``src``, verified, under ``folder`` (same name): hard-linked, or else copied (and fsynced).

    ``src``'s bytes are hashed against its name once linked, before any checkpoint can name the link
    (a copy is hashed as it is copied), so a file damaged since it was written is refused
    (:class:`ClientStateError` naming it) and its link or copy removed. A file of that name already
    in ``folder`` (placed for an earlier checkpoint) is kept when it is intact, else replaced.
    Returns the new path and whether a link was made that still needs an fsync (spill files are
    written without one).
    """
    dst = folder / src.name
    if dst.exists():
        try:
            verify_state_file(dst)
            return dst, False
        except ClientStateError:
            dst.unlink(missing_ok=True)  # damaged; src, verified below, takes its place
    try:
        os.link(src, dst)
    except FileExistsError:
        return dst, False
    except OSError:  # another file system, or no hard links there: copy, hashing what is copied
        atomic_write(dst, lambda out: _copy_verified(src, out))
        return dst, False
    try:  # the link is not named by any checkpoint yet: one read of the bytes, then it may be
        verify_state_file(src)
    except ClientStateError:
        dst.unlink(missing_ok=True)
        raise
    return dst, True


def _copy_verified(src: Path, out: Any) -> None:
    """Copy ``src`` into ``out``, hashing the bytes copied; :class:`ClientStateError` unless they hash to its name."""
    sha = hashlib.sha256()
    try:
        with open(src, "rb") as inp:
            while chunk := inp.read(_CHUNK):
                sha.update(chunk)
                out.write(chunk)
    except OSError as exc:
        raise _damaged(src, f"cannot be read ({exc.strerror or exc})") from None
    if sha.hexdigest() != src.stem:
        raise _damaged(src, "does not match the SHA-256 in its name (its bytes were damaged)")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _place_all(srcs: list[Path], folder: Path) -> None:
    """:func:`_place` every file of ``srcs`` in ``folder`` and fsync the links made, before this returns.

    In threads: hashing releases the GIL (the check runs on every core), and one fsync after
    another costs a journal commit each (~100x slower). The first refusal is raised.
    """

    def place(src: Path) -> None:
        path, needs_sync = _place(src, folder)
        if needs_sync:
            _fsync(path)

    if len(srcs) <= 1:
        for src in srcs:
            place(src)
        return
    with ThreadPoolExecutor(max_workers=min(16, len(srcs))) as pool:
        list(pool.map(place, srcs))


# ---------------------------------------------------------------------------------------------
# the store


class ClientStateStore(MutableMapping):
    """Client states in memory up to ``budget_bytes``; least recently used ones spilled to ``spill_dir``.

    Parameters
    ----------
    budget_bytes : int
        Bytes of resident states (:func:`state_size`) kept in memory, >= 0. The state in use (the
        one last read or written) always stays resident, even when it alone exceeds the budget.
    spill_dir : Path
        An empty folder of this store's own; it is removed by :meth:`close` (or when the store is
        garbage collected, or at interpreter exit).
    fresh : iterable of int
        Client ids whose state is an empty dict not yet used (made on first access; costs nothing
        until then).
    """

    def __init__(self, budget_bytes: int, spill_dir: str | Path, fresh: Iterable[int] = ()) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget = int(budget_bytes)
        self.spill_dir = Path(spill_dir)
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.spill_dir), True)
        self._resident: OrderedDict[int, Any] = OrderedDict()  # least recently used first
        self._sizes: dict[int, int] = {}
        # spilled id -> (folder, digest) of its file, in spill_dir or a checkpoint's folder (a tuple, not a
        # Path: ~170 bytes a spilled state rather than ~500)
        self._files: dict[int, tuple[Path, str]] = {}
        self._refs: dict[tuple[Path, str], int] = {}  # ids per file (identical states share one)
        self._fresh: set[int] = set(fresh)
        self._in_use: int | None = None
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self.spills = 0
        self.loads = 0

    # ---- the mapping ------------------------------------------------------------------------
    def __getitem__(self, key: int) -> Any:
        self._settle(key)
        if key in self._resident:
            self._resident.move_to_end(key)
            value = self._resident[key]
        elif key in self._files:
            value = read_state_file(self.file_of(key))
            self.loads += 1
            self._release(key)
            self._admit(key, value)
        elif key in self._fresh:
            value = {}
            self._fresh.discard(key)
            self._admit(key, value)
        else:
            raise KeyError(key)
        self._in_use = key
        self._evict()
        return value

    def __setitem__(self, key: int, value: Any) -> None:
        self._settle()
        self._forget(key)
        self._admit(key, value)
        self._in_use = key
        self._evict()

    def __delitem__(self, key: int) -> None:
        if key not in self:
            raise KeyError(key)
        self._settle()
        self._forget(key)

    def __contains__(self, key: object) -> bool:
        return key in self._resident or key in self._files or key in self._fresh

    def __iter__(self) -> Iterator[int]:
        return iter(sorted([*self._resident, *self._files, *self._fresh]))

    def __len__(self) -> int:
        return len(self._resident) + len(self._files) + len(self._fresh)

    # ---- what is where ----------------------------------------------------------------------
    def is_resident(self, key: int) -> bool:
        """Whether ``key``'s state is in memory now."""
        return key in self._resident

    def spilled(self) -> list[int]:
        """The client ids whose state is on disk now, sorted."""
        return sorted(self._files)

    def file_of(self, key: int) -> Path:
        """The file holding ``key``'s spilled state."""
        folder, digest = self._files[key]
        return folder / (digest + _SUFFIX)

    def close(self) -> None:
        """Remove the spill folder. Files already linked into a checkpoint stay there."""
        self._cleanup()

    # ---- checkpoints ------------------------------------------------------------------------
    def checkpoint_entries(self, states_dir: str | Path) -> tuple[dict[int, Any], dict[int, str]]:
        """The states for a checkpoint: resident ones inline, spilled ones as digests of files in ``states_dir``.

        Every spilled state's file is verified and placed in ``states_dir`` (hard link, else copy;
        fsynced) before this returns, so the checkpoint written next can name it. Call
        :func:`prune_state_files` once that checkpoint is written.

        Raises
        ------
        ClientStateError
            A spill file was damaged since it was written (names it): write no checkpoint.
        """
        states_dir = Path(states_dir)
        states_dir.mkdir(parents=True, exist_ok=True)
        self._settle()
        inline: dict[int, Any] = dict(self._resident)
        inline.update({k: {} for k in self._fresh})
        files: dict[int, str] = {}
        moving: dict[str, Path] = {}  # digest -> the file to place (identical states share one)
        for key in sorted(self._files):
            folder, digest = self._files[key]
            if folder != states_dir:
                moving.setdefault(digest, self.file_of(key))
        _place_all(list(moving.values()), states_dir)  # verified, linked, durable: before anything changes here
        for key in sorted(self._files):
            folder, digest = self._files[key]
            if folder != states_dir:
                self._release(key)
                self._hold(key, states_dir, digest)
            files[key] = digest
        return inline, files

    def adopt(self, inline: Mapping[int, Any], files: Mapping[int, Path]) -> None:
        """Take states from a checkpoint: ``inline`` ones into memory (empty ones as fresh), ``files`` by path.

        Files are read only when their state is used; they are never removed by the store.
        """
        self._settle()
        folders: dict[Path, Path] = {}  # one Path object per folder, shared by its files' entries
        for key, path in files.items():
            self._forget(key)
            path = Path(path)
            self._hold(key, folders.setdefault(path.parent, path.parent), path.stem)
        for key, value in inline.items():
            self._forget(key)
            if isinstance(value, dict) and not value:
                self._fresh.add(key)
            else:
                self._admit(key, value)
                self._evict()

    # ---- internals --------------------------------------------------------------------------
    def _admit(self, key: int, value: Any) -> None:
        self._resident[key] = value
        size = self._sizes[key] = state_size(value)
        self.resident_bytes += size
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def _settle(self, next_key: int | None = None) -> None:
        """Re-measure the state in use (its holder may have changed it in place); it is in use no more,
        and the resident states are brought within the budget before another one comes in, keeping
        ``next_key`` (the one asked for) if it is resident."""
        key = self._in_use
        self._in_use = next_key if next_key in self._resident else None
        if key is not None and key in self._resident:
            size = state_size(self._resident[key])
            self.resident_bytes += size - self._sizes[key]
            self._sizes[key] = size
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        self._evict()

    def _evict(self) -> None:
        """Spill least recently used states until the resident ones fit the budget (the one in use stays)."""
        while self.resident_bytes > self.budget:
            key = next(iter(self._resident))
            if key == self._in_use:
                if len(self._resident) == 1:
                    return
                self._resident.move_to_end(key)
                continue
            digest = write_state_file(self.spill_dir, self._resident[key])  # on failure the state stays
            del self._resident[key]
            self.resident_bytes -= self._sizes.pop(key)
            self._hold(key, self.spill_dir, digest)
            self.spills += 1

    def _hold(self, key: int, folder: Path, digest: str) -> None:
        ref = (folder, digest)
        self._files[key] = ref
        self._refs[ref] = self._refs.get(ref, 0) + 1

    def _release(self, key: int) -> None:
        """Drop ``key``'s file reference; remove the file once no id uses it (own spill files only)."""
        ref = self._files.pop(key)
        n = self._refs[ref] - 1
        if n:
            self._refs[ref] = n
            return
        del self._refs[ref]
        folder, digest = ref
        if folder == self.spill_dir:
            (folder / (digest + _SUFFIX)).unlink(missing_ok=True)

    def _forget(self, key: int) -> None:
        if key in self._resident:
            del self._resident[key]
            self.resident_bytes -= self._sizes.pop(key)
        elif key in self._files:
            self._release(key)
        self._fresh.discard(key)


# ---------------------------------------------------------------------------------------------
# runtime helpers


def client_state_payload(states: MutableMapping[int, Any], states_dir: str | Path) -> dict[str, Any]:
    """A checkpoint's entries for ``states``: ``client_states`` and, for a store that spilled, :data:`FILES_KEY`.

    A plain dict gives ``{"client_states": states}``, the layout every checkpoint had before.
    """
    if not isinstance(states, ClientStateStore):
        return {"client_states": states}
    inline, files = states.checkpoint_entries(states_dir)
    return {"client_states": inline, FILES_KEY: files} if files else {"client_states": inline}


def prune_state_files(states_dir: str | Path, payload: Mapping[str, Any]) -> None:
    """Remove files in ``states_dir`` that the checkpoint ``payload`` (just written) does not name.

    Named are the client states' files (:data:`FILES_KEY`) and the server records' (:data:`RECORD_FILES_KEY`):
    the stores of one run share the folder (content-addressed names, so a file two of them name is one file).
    """
    states_dir = Path(states_dir)
    if not states_dir.is_dir():
        return
    keep = {d + _SUFFIX for d in payload.get(FILES_KEY, {}).values()}
    for digests in payload.get(RECORD_FILES_KEY, {}).values():
        keep.update(d + _SUFFIX for d in digests.values())
    for p in states_dir.iterdir():
        if p.name not in keep and p.is_file():
            p.unlink(missing_ok=True)


def open_client_states(
    keys: Iterable[int],
    budget_bytes: int | None,
    spill_dir: str | Path | None,
    resumed: Mapping[str, Any] | None = None,
    states_dir: str | Path | None = None,
) -> MutableMapping[int, Any]:
    """The client states a run starts with: empty ones for ``keys``, or a checkpoint's.

    Parameters
    ----------
    keys : iterable of int
        Every client id (a new run's states are empty dicts).
    budget_bytes : int or None
        None: a plain dict, all in memory (a checkpoint's spilled states are all loaded). An int: a
        :class:`ClientStateStore` with that budget spilling into ``spill_dir``.
    spill_dir : path or None
        The store's own folder (must not exist yet or be empty); unused without a budget.
    resumed : mapping, optional
        A loaded checkpoint payload (``client_states`` and perhaps :data:`FILES_KEY`).
    states_dir : path, optional
        The checkpoint's :data:`STATES_DIR` folder, where the files of ``resumed`` are.

    Raises
    ------
    ClientStateError
        A file the checkpoint names is missing or damaged (checked here, before the run starts).
    """
    inline: Mapping[int, Any] = resumed["client_states"] if resumed is not None else {k: {} for k in keys}
    digests: Mapping[int, str] = resumed.get(FILES_KEY, {}) if resumed is not None else {}
    files = {k: Path(states_dir or ".") / (d + _SUFFIX) for k, d in digests.items()}
    for path in sorted(set(files.values())):
        verify_state_file(path)
    if budget_bytes is None:
        states = dict(inline)
        states.update({k: read_state_file(p) for k, p in files.items()})
        return states
    if spill_dir is None:
        raise ValueError("a state budget needs a spill folder")
    store = ClientStateStore(budget_bytes, spill_dir)
    store.adopt(inline, files)
    return store


def close_client_states(states: MutableMapping[int, Any]) -> None:
    """Remove a store's spill folder (nothing to do for a plain dict)."""
    if isinstance(states, ClientStateStore):
        states.close()
