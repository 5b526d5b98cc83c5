"""FedML's own dataset files read from a local folder: its MNIST (LEAF JSON) and FEMNIST (TFF's h5 files).

What ``fedml.data.load(args)`` reads (FedML 0.9.6) from ``data_args.data_cache_dir``, without FedML or a
download:

``fedml_mnist``
    FedML's MNIST (``fedml/data/MNIST/data_loader.py``), LEAF's layout:
    ``<data_cache_dir>/MNIST/train/*.json`` and ``<data_cache_dir>/MNIST/test/*.json``. Each file holds
    ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 values], ...], "y": [...]}}}``
    (``hierarchies`` optional): ``x`` one flat 28x28 image per sample, floats in ``[0, 1]`` (or
    integers 0..255), ``y`` its digit.
``femnist``
    FedML's FEMNIST, TensorFlow Federated's federated EMNIST (``fedml/data/FederatedEMNIST``):
    ``<data_cache_dir>/fed_emnist_train.h5`` and ``fed_emnist_test.h5``, each with a group
    ``examples/<writer id>/`` holding ``pixels`` ``(n, 28, 28)`` floats in ``[0, 1]`` and ``label``
    ``(n,)``: 62 classes (digits, upper-case, lower-case letters). Reading them needs ``h5py``.

Every sample keeps its user (LEAF) or writer (FEMNIST) in the order read (:class:`FedMLFiles`' ``users``).
Each file's declared size is checked against :func:`~fedml_ssfl.limits.input_limit` before it is
decoded, and a file that does not match the layout is refused in one line naming the file and what
is wrong (:class:`~fedml_ssfl.data.local_files.DataFormatError`).

Deviations
----------
* The clients are the registry's partitions of the pooled samples (``data_args.partition_method``),
  not LEAF's users / the FEMNIST writers that FedML's loaders make its clients; the users are read
  and kept, not yet used as a partition.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..limits import too_large
from .local_files import DataFormatError

JSON_BLOWUP = 8
"""Bytes a decoded JSON number list may take per byte of file (Python floats in lists): the size check's factor."""

FEMNIST_FILES = ("fed_emnist_train.h5", "fed_emnist_test.h5")
FEMNIST_CLASSES = [str(d) for d in range(10)] + [chr(c) for c in range(65, 91)] + [chr(c) for c in range(97, 123)]
"""FEMNIST's 62 classes in label order: digits, A-Z, a-z."""


@dataclass
class FedMLFiles:
    """One split of FedML's files: uint8 images ``(N, 1, s, s)``, int64 labels, each sample's user / writer."""

    images: np.ndarray
    labels: np.ndarray
    users: list[str]


def _pixels(x: np.ndarray, source: Path, where: str) -> np.ndarray:
    """Pixels as uint8: floats in [0, 1] scaled by 255 and rounded, integers 0..255 kept."""
    if x.size and not np.isfinite(x).all():
        raise DataFormatError(f"{source}: {where} holds NaN or infinite pixel values")
    low, high = (float(x.min()), float(x.max())) if x.size else (0.0, 1.0)
    if np.issubdtype(x.dtype, np.floating) and high <= 1.0 + 1e-6 and low >= -1e-6:
        return np.round(x.astype(np.float64) * 255.0).clip(0, 255).astype(np.uint8)
    if low < 0 or high > 255 or (np.issubdtype(x.dtype, np.floating) and not np.all(x == np.round(x))):
        raise DataFormatError(
            f"{source}: {where} holds pixel values in [{low:.3g}, {high:.3g}]; FedML's files hold floats in [0, 1] "
            "(or integers 0..255)"
        )
    return x.astype(np.uint8)


def _square(flat: np.ndarray, source: Path, where: str) -> np.ndarray:
    """``(n, s * s)`` or ``(n, s, s)`` pixels as ``(n, 1, s, s)``."""
    n = flat.shape[0]
    if flat.ndim == 3 and flat.shape[1] == flat.shape[2]:
        return flat.reshape(n, 1, flat.shape[1], flat.shape[2])
    side = math.isqrt(flat.shape[1]) if flat.ndim == 2 else 0
    if flat.ndim != 2 or side * side != flat.shape[1] or side == 0:
        raise DataFormatError(f"{source}: {where} samples have shape {flat.shape[1:]}, not a square grey image")
    return flat.reshape(n, 1, side, side)


def read_leaf_json(folder: str | Path) -> FedMLFiles:
    """Every ``*.json`` file of a LEAF split folder (FedML's ``MNIST/train`` or ``MNIST/test``), in name order.

    Raises
    ------
    DataFormatError
        No JSON file there, a file too large to decode, not JSON, or not LEAF's layout (names the
        file and the key).
    """
    folder = Path(folder).expanduser()
    files = sorted(p for p in folder.glob("*.json") if p.is_file()) if folder.is_dir() else []
    if not files:
        raise DataFormatError(
            f"{folder}: no LEAF .json file there (FedML's MNIST: MNIST/train/*.json, MNIST/test/*.json)"
        )
    images, labels, users = [], [], []
    for path in files:
        refusal = too_large(f"the LEAF file {path.name}", path.stat().st_size * JSON_BLOWUP)
        if refusal:
            raise DataFormatError(f"{path}: {refusal}")
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise DataFormatError(f"{path}: not a readable JSON file ({type(exc).__name__}: {exc})") from None
        data = doc.get("user_data") if isinstance(doc, dict) else None
        if not isinstance(data, dict):
            raise DataFormatError(f"{path}: no 'user_data' mapping; LEAF's layout is {{users, num_samples, user_data}}")
        declared = dict(zip(doc.get("users") or [], doc.get("num_samples") or []))
        for user, entry in data.items():
            where = f"user_data[{user!r}]"
            if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
                raise DataFormatError(f"{path}: {where} needs 'x' (the images) and 'y' (the labels)")
            try:
                x = np.asarray(entry["x"])
                y = np.asarray(entry["y"])
            except ValueError as exc:
                raise DataFormatError(f"{path}: {where} is ragged ({exc}); every image needs the same size") from None
            if x.ndim == 1 and x.size == 0:
                x = x.reshape(0, 784)
            if y.ndim != 1 or len(y) != len(x) or (y.size and not np.issubdtype(y.dtype, np.integer)):
                raise DataFormatError(
                    f"{path}: {where} has {len(x)} images and labels {y.shape} {y.dtype}; give one "
                    "integer label per image"
                )
            if user in declared and declared[user] != len(y):
                raise DataFormatError(f"{path}: {where} holds {len(y)} samples, num_samples says {declared[user]}")
            if not np.issubdtype(x.dtype, np.number):
                raise DataFormatError(f"{path}: {where}.x holds {x.dtype} values, not pixel numbers")
            images.append(_square(_pixels(x, path, where + ".x"), path, where + ".x"))
            labels.append(y.astype(np.int64))
            users += [str(user)] * len(y)
    return _joined(images, labels, users, folder)


def _joined(images: list[np.ndarray], labels: list[np.ndarray], users: list[str], source: Path) -> FedMLFiles:
    shapes = {im.shape[1:] for im in images if len(im)}
    if len(shapes) > 1:
        raise DataFormatError(f"{source}: images of several sizes {sorted(shapes)}; every image needs one size")
    if not users:
        raise DataFormatError(f"{source}: holds no samples")
    x = np.concatenate([im for im in images if len(im)])
    y = np.concatenate(labels)
    if y.min() < 0:
        raise DataFormatError(f"{source}: a label is {int(y.min())}; labels are classes 0, 1, ...")
    return FedMLFiles(images=np.ascontiguousarray(x), labels=y, users=users)


def read_fed_emnist_h5(path: str | Path) -> FedMLFiles:
    """One of FEMNIST's h5 files (``examples/<writer>/pixels``, ``label``), writers in the file's order.

    Raises
    ------
    DataFormatError
        Missing, not an HDF5 file, too large, or not the layout (names the file and the entry).
    """
    path = Path(path).expanduser()
    try:
        import h5py
    except ImportError:
        raise DataFormatError(f"{path}: reading FEMNIST's h5 files needs h5py (pip install h5py)") from None
    if not path.is_file():
        raise DataFormatError(f"{path}: not found")
    try:
        fh = h5py.File(path, "r")
    except OSError as exc:
        raise DataFormatError(f"{path}: not a readable HDF5 file ({exc})") from None
    with fh:
        examples = fh.get("examples")
        if not isinstance(examples, h5py.Group):
            raise DataFormatError(f"{path}: no group 'examples'; FEMNIST's layout is examples/<writer>/pixels, label")
        writers = list(examples.keys())
        total = 0
        for writer in writers:  # the declared sizes first, nothing read yet
            group = examples[writer]
            pixels, label = group.get("pixels"), group.get("label")
            if not isinstance(pixels, h5py.Dataset) or not isinstance(label, h5py.Dataset):
                raise DataFormatError(f"{path}: examples/{writer} needs the datasets 'pixels' and 'label'")
            total += pixels.size * max(pixels.dtype.itemsize, 8) + label.size * 8
        refusal = too_large(f"the FEMNIST file {path.name}", total)
        if refusal:
            raise DataFormatError(f"{path}: {refusal}")
        images, labels, users = [], [], []
        for writer in writers:
            where = f"examples/{writer}"
            x = np.asarray(examples[writer]["pixels"][()])
            y = np.asarray(examples[writer]["label"][()]).reshape(-1)
            if len(y) != len(x) or (y.size and not np.issubdtype(y.dtype, np.integer)):
                raise DataFormatError(f"{path}: {where} has {len(x)} images and {len(y)} labels ({y.dtype})")
            if not np.issubdtype(x.dtype, np.number):
                raise DataFormatError(f"{path}: {where}/pixels holds {x.dtype} values, not pixel numbers")
            images.append(_square(_pixels(x, path, where + "/pixels"), path, where + "/pixels"))
            labels.append(y.astype(np.int64))
            users += [writer] * len(y)
    return _joined(images, labels, users, path)


def _check_classes(name: str, splits: dict[str, FedMLFiles], num_classes: int, source: Any) -> None:
    for split, data in splits.items():
        if data.labels.size and int(data.labels.max()) >= num_classes:
            raise DataFormatError(
                f"{source}: the {split} labels reach {int(data.labels.max())}; {name} has {num_classes} classes"
            )
