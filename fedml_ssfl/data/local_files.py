"""Readers and a writer for a user's own images: an ``.npz`` archive or a folder of image files.

Two on-disk formats are read into a :class:`LocalImages` (uint8 ``(N, C, H, W)`` images, int64
labels with ``-1`` for unlabeled samples):

``.npz`` (written with ``np.savez``; read with ``allow_pickle=False``, nothing is unpickled)
    ``images``       uint8 ``(N, H, W)`` (grayscale) or ``(N, H, W, C)`` with ``C`` in 1, 3, 4
    ``labels``       optional, integer ``(N,)``; ``-1`` marks an unlabeled sample
    ``ids``          optional, ``(N,)`` strings or integers (kept as str)
    ``class_names``  optional, ``(d,)`` strings; label ``k`` is ``class_names[k]``

image folder (png, jpg/jpeg, bmp, gif, tif/tiff, webp; Pillow decodes them)
    ``path/<file>``          unlabeled (label ``-1``)
    ``path/<class>/<file>``  labeled; the sub-folder name is the class name

Four-channel images (RGBA) are accepted only when fully opaque (alpha 255 everywhere); the alpha
channel is then dropped, which loses nothing. Any transparency is refused, as compositing onto a
background is a choice the data's owner should make. Every problem raises a one-line
:class:`DataFormatError` naming the file, the key or image at fault and the fix.

Memory is bounded before anything is decoded: the shape and dtype of each npz member come from its
``.npy`` header, and each image's size from its file header; their sum must fit
:func:`fedml_ssfl.limits.input_limit` (``FEDML_SSFL_MAX_INPUT_BYTES``), an image may have at most
:data:`~fedml_ssfl.limits.MAX_IMAGE_PIXELS` pixels, a member whose header claims more bytes than the
archive holds for it is refused as damaged, and object (pickled) members are refused unread. Without
``class_names`` the class count is the number of distinct labels present (they must be ``0..d-1``),
never the largest label plus one (:func:`class_count`).
"""

from __future__ import annotations

import difflib
import logging
import math
import warnings
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..atomic import atomic_write
from ..limits import MAX_CLASSES, MAX_IMAGE_PIXELS, too_large

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
NPZ_KEYS = ("images", "labels", "ids", "class_names")
UNLABELED = -1


class DataFormatError(ValueError):
    """A user's data file or folder does not match the documented layout; the message says how to fix it."""


@dataclass
class LocalImages:
    """Images read from a user's file or folder.

    Attributes
    ----------
    images : torch.Tensor
        uint8 ``(N, C, H, W)``, contiguous; ``C`` is 1 (grayscale) or 3 (RGB).
    labels : torch.Tensor
        int64 ``(N,)``; ``-1`` marks an unlabeled sample.
    ids : list of str or None
        One identifier per sample, when the source has them (npz ``ids``; a folder's relative paths).
    class_names : list of str or None
        Name of each class index, when the source has them.
    source : str
        The path read, for messages.
    """

    images: torch.Tensor
    labels: torch.Tensor
    ids: list[str] | None
    class_names: list[str] | None
    source: str

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def num_labeled(self) -> int:
        """Number of samples with a label (``label >= 0``)."""
        return int((self.labels >= 0).sum())

    def __repr__(self) -> str:
        return (
            f"LocalImages(source={self.source!r}, images={tuple(self.images.shape)}, "
            f"labeled={self.num_labeled}, classes={self.class_names})"
        )


# --------------------------------------------------------------------------------------------
# shared checks
# --------------------------------------------------------------------------------------------


def _fail(source: str | Path, what: str) -> DataFormatError:
    """A :class:`DataFormatError` whose message starts with the path."""
    return DataFormatError(f"{source}: {what}")


def _drop_opaque_alpha(pixels: np.ndarray, source: str | Path, where: str) -> np.ndarray:
    """``(..., 4)`` RGBA pixels without alpha; refused unless alpha is 255 everywhere."""
    if np.any(pixels[..., 3] != 255):
        raise _fail(
            source,
            f"{where} has an alpha channel with transparent pixels (RGBA); transparency is refused rather than "
            "guessed: composite the images onto a background (or drop alpha) and save RGB",
        )
    return pixels[..., :3]


def _check_label_range(
    labels: np.ndarray, source: str | Path, key: str, num_classes: int | None, class_names: list[str] | None
) -> None:
    """Labels must be ``-1`` (unlabeled) or a class index below ``num_classes`` and ``len(class_names)``."""
    if labels.size == 0:
        return
    low = int(labels.min())
    if low < UNLABELED:
        raise _fail(source, f"{key} contains {low}; labels must be -1 (unlabeled) or a class index 0..d-1")
    high = int(labels.max())
    limits = []
    if num_classes is not None:
        limits.append((int(num_classes), "num_classes"))
    if class_names is not None:
        limits.append((len(class_names), "len(class_names)"))
    for limit, what in limits:
        if high >= limit:
            raise _fail(
                source, f"{key} contains class {high} but {what} is {limit}; labels must be -1 or 0..{limit - 1}"
            )


def class_count(labels: np.ndarray | torch.Tensor, source: str | Path) -> int:
    """The class count of labels that come without class names: the number of distinct labels present.

    Labels number the classes, so the distinct labels (``-1``, unlabeled, left out) must be exactly
    ``0..d-1``; a gap (a label of 10**9 among three distinct labels, or -1 saved as an unsigned
    4294967295) is refused, naming the label, instead of making 10**9 classes.

    Raises
    ------
    DataFormatError
        The labels skip a class, or there are more than :data:`~fedml_ssfl.limits.MAX_CLASSES` classes.
    """
    values = labels.numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    present = np.unique(values[values >= 0])
    d = int(present.size)
    if d and int(present[-1]) >= d:
        gap = int(np.setdiff1d(np.arange(d), present, assume_unique=True)[0])
        raise _fail(
            source,
            f"label {int(present[-1])} appears, but only {d} distinct labels do (no sample has label {gap}); "
            f"without class_names the labels must number the classes 0..{d - 1}: renumber them, or save class_names "
            "listing every class (label k is class_names[k])",
        )
    if d > MAX_CLASSES:
        raise _fail(source, f"{d} classes, more than the {MAX_CLASSES} a dataset may have; check the labels")
    return d


def _check_class_names(names: list[str], source: str | Path, key: str, num_classes: int | None = None) -> None:
    """Class names must be non-empty, unique, at most MAX_CLASSES and, when ``num_classes`` is given, that many."""
    if not names:
        raise _fail(source, f"{key} is empty; give one name per class or leave it out")
    if len(names) > MAX_CLASSES:
        raise _fail(source, f"{key} lists {len(names)} classes, more than the {MAX_CLASSES} a dataset may have")
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise _fail(source, f"{key} lists {name!r} twice; class names must be unique")
        seen.add(name)
    if num_classes is not None and len(names) != num_classes:
        raise _fail(source, f"{key} lists {len(names)} classes but num_classes is {num_classes}; make them agree")


# --------------------------------------------------------------------------------------------
# npz
# --------------------------------------------------------------------------------------------


def _npz_images(array: np.ndarray, source: str | Path) -> np.ndarray:
    """``images`` as uint8 ``(N, C, H, W)`` (C 1 or 3), checked."""
    if array.dtype != np.uint8:
        hint = (
            "convert to uint8 0..255, e.g. np.clip(np.rint(x * 255), 0, 255).astype(np.uint8) for floats in [0, 1]"
            if array.dtype.kind == "f"
            else "convert to uint8 0..255 with images.astype(np.uint8)"
        )
        raise _fail(source, f"key 'images' has dtype {array.dtype}; {hint}")
    if array.ndim == 3:
        array = array[..., None]
    if array.ndim != 4:
        raise _fail(source, f"key 'images' has shape {array.shape}; expected (N, H, W) or (N, H, W, C)")
    channels = array.shape[-1]
    if channels not in (1, 3, 4):
        hint = " (if it is (N, C, H, W), save images.transpose(0, 2, 3, 1))" if array.shape[1] in (1, 3, 4) else ""
        raise _fail(source, f"key 'images' has shape {array.shape}: last axis must be 1, 3 or 4 channels{hint}")
    if array.shape[0] == 0:
        raise _fail(source, "key 'images' holds no images (N = 0)")
    if array.shape[1] == 0 or array.shape[2] == 0:
        raise _fail(source, f"key 'images' has shape {array.shape}: height and width must be at least 1")
    if channels == 4:
        array = _drop_opaque_alpha(array, source, "key 'images'")
    return np.ascontiguousarray(array.transpose(0, 3, 1, 2))


def _npz_labels(array: np.ndarray | None, n: int, source: str | Path) -> np.ndarray:
    """``labels`` as int64 ``(N,)``; all ``-1`` when absent."""
    if array is None:
        return np.full(n, UNLABELED, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise _fail(
            source,
            f"key 'labels' has dtype {array.dtype}; labels must be integers (-1 = unlabeled): "
            "save labels.astype(np.int64)",
        )
    if array.shape != (n,):
        raise _fail(source, f"key 'labels' has shape {array.shape}; expected ({n},), one label per image")
    if array.dtype.kind == "u" and array.size and int(array.max()) == np.iinfo(array.dtype).max:
        raise _fail(
            source,
            f"key 'labels' holds {int(array.max())}, the largest {array.dtype}: -1 (unlabeled) saved in an unsigned "
            "dtype? save labels as signed integers: labels.astype(np.int64)",
        )
    return array.astype(np.int64)


def _npz_strings(array: np.ndarray, source: str | Path, key: str) -> list[str]:
    """A 1-D array of strings (bytes decoded as UTF-8) or integers as a list of str."""
    if array.ndim != 1:
        raise _fail(source, f"key {key!r} has shape {array.shape}; expected a 1-D array")
    if array.dtype.kind == "U":
        return [str(v) for v in array]
    if array.dtype.kind == "S":
        return [bytes(v).decode("utf-8", errors="replace") for v in array]
    if array.dtype.kind in "iu":
        return [str(int(v)) for v in array]
    raise _fail(
        source, f"key {key!r} has dtype {array.dtype}; save strings or integers, e.g. np.array(values, dtype=str)"
    )


def _npz_ids(array: np.ndarray | None, n: int, source: str | Path) -> list[str] | None:
    """``ids`` as a list of ``n`` strings, or None."""
    if array is None:
        return None
    ids = _npz_strings(array, source, "ids")
    if len(ids) != n:
        raise _fail(source, f"key 'ids' has {len(ids)} entries but 'images' has {n}; give one id per image")
    return ids


def _npz_class_names(array: np.ndarray | None, source: str | Path, num_classes: int | None) -> list[str] | None:
    """``class_names`` as a list of unique strings (``num_classes`` of them when given), or None."""
    if array is None:
        return None
    if array.dtype.kind not in "US":
        raise _fail(source, f"key 'class_names' has dtype {array.dtype}; save np.array(names, dtype=str)")
    names = _npz_strings(array, source, "class_names")
    _check_class_names(names, source, "key 'class_names'", num_classes)
    return names


def _require_images_key(keys: list[str], source: str | Path) -> None:
    """The layout's one mandatory key."""
    if "images" not in keys:
        present = ", ".join(sorted(keys)) or "none"
        raise _fail(source, f"no 'images' key (keys present: {present}); save with np.savez(path, images=...)")


def _from_npz_arrays(arrays: dict[str, np.ndarray], source: str | Path, num_classes: int | None) -> LocalImages:
    """Validate the arrays of the npz layout and assemble a :class:`LocalImages`."""
    _require_images_key(list(arrays), source)
    images = _npz_images(arrays["images"], source)
    n = images.shape[0]
    labels = _npz_labels(arrays.get("labels"), n, source)
    class_names = _npz_class_names(arrays.get("class_names"), source, num_classes)
    _check_label_range(labels, source, "key 'labels'", num_classes, class_names)
    return LocalImages(
        images=torch.from_numpy(images),
        labels=torch.from_numpy(labels),
        ids=_npz_ids(arrays.get("ids"), n, source),
        class_names=class_names,
        source=str(source),
    )


def _warn_unknown_keys(keys: list[str], source: Path) -> None:
    """Log the keys that are not part of the layout (they are ignored), with the closest known key."""
    for key in keys:
        if key in NPZ_KEYS:
            continue
        close = difflib.get_close_matches(key, NPZ_KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        log.warning("%s: ignoring key %r%s; the keys read are %s", source, key, hint, ", ".join(NPZ_KEYS))


def npy_header(fh: Any, size: int, source: str | Path, key: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """Shape, dtype and data bytes an ``.npy`` stream's header declares; checked, nothing decoded.

    ``size`` is the stream's length (a zip member's declared size): a header claiming more data than
    that is refused as damaged, an object (pickled) dtype is refused.
    """
    try:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise ValueError(f"npy format version {version[0]}.{version[1]}")
        offset = fh.tell()
    except (ValueError, OSError, EOFError, SyntaxError, zipfile.BadZipFile) as exc:
        raise _fail(
            source, f"{key} is not a readable .npy array ({exc}); write it again with np.save / np.savez"
        ) from None
    if any(int(d) < 0 for d in shape):
        raise _fail(
            source,
            f"{key}'s header claims shape {tuple(shape)}, with a negative size: the file is damaged or was not "
            "written by NumPy; write it again with np.save / np.savez",
        )
    if dtype.hasobject:
        raise _fail(
            source,
            f"{key} is an object array (pickled Python objects, never loaded); save plain arrays, e.g. "
            "np.array(values, dtype=str)",
        )
    nbytes = math.prod(shape) * dtype.itemsize
    if offset + nbytes > size:
        raise _fail(
            source,
            f"{key}'s header claims shape {shape} of {dtype} ({nbytes} bytes), but the file holds {size - offset} "
            "bytes of data: it is damaged or cut short; write it again",
        )
    return tuple(shape), dtype, nbytes


def _npz_member_sizes(path: Path) -> dict[str, int]:
    """The decoded bytes of each known member of an npz archive, from the ``.npy`` headers (nothing decoded)."""
    sizes = {}
    try:
        with zipfile.ZipFile(path) as zf:
            members = {info.filename: info for info in zf.infolist()}
            for key in NPZ_KEYS:
                info = members.get(f"{key}.npy")
                if info is None:
                    continue
                with zf.open(info) as fh:
                    sizes[key] = npy_header(fh, info.file_size, path, f"key {key!r}")[2]
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise _fail(path, f"a damaged .npz archive ({exc}); write it again with np.savez") from None
    return sizes


def _load_npz_arrays(path: Path) -> dict[str, np.ndarray]:
    """The known arrays of an npz archive, their sizes checked from the headers first; nothing unpickled."""
    if not path.exists():
        raise _fail(path, "file not found; check the path (an .npz written with np.savez)")
    if not path.is_file() or not zipfile.is_zipfile(path):
        raise _fail(path, "not an .npz archive (a zip of .npy arrays); write it with np.savez(path, images=...)")
    sizes = _npz_member_sizes(path)
    refusal = too_large(f"its keys {', '.join(sizes)}", sum(sizes.values()))
    if refusal:
        raise _fail(path, refusal)
    arrays = {}
    try:
        with np.load(path, allow_pickle=False) as npz:
            _require_images_key(list(npz.files), path)
            _warn_unknown_keys(list(npz.files), path)
            for key in NPZ_KEYS:
                if key in npz.files:
                    arrays[key] = npz[key]
    except (zipfile.BadZipFile, OSError, EOFError) as exc:  # a bad CRC, a member cut short
        raise _fail(path, f"a damaged .npz archive ({exc}); write it again with np.savez") from None
    return arrays


def _expected_class_names(data: LocalImages, class_names: Sequence[str] | None) -> LocalImages:
    """Apply the caller's class order: the file's own names must equal it; labels must fit it."""
    if class_names is None:
        return data
    names = [str(c) for c in class_names]
    _check_class_names(names, data.source, "class_names")
    if data.class_names is not None and data.class_names != names:
        raise _fail(
            data.source,
            f"key 'class_names' is {data.class_names} but {names} is expected; save the same list (same order)",
        )
    _check_label_range(data.labels.numpy(), data.source, "key 'labels'", None, names)
    data.class_names = names
    return data


def read_npz(
    path: str | Path, num_classes: int | None = None, *, class_names: Sequence[str] | None = None
) -> LocalImages:
    """Read images (and optional labels, ids, class names) from an ``.npz`` archive.

    Parameters
    ----------
    path : str or Path
        The archive, laid out as described in this module's docstring.
    num_classes : int, optional
        When given, every label must be ``-1`` or below it and ``class_names`` (if stored) must have that
        many entries.
    class_names : sequence of str, optional
        The expected class order (e.g. the server's): the file's ``class_names``, if stored, must equal
        it, labels must be below its length, and the result carries it.

    Returns
    -------
    LocalImages
        uint8 ``(N, C, H, W)`` images; labels ``-1`` where the file has none.

    Raises
    ------
    DataFormatError
        The file is missing, not an npz, or a key does not match the layout (the message says which and how
        to fix it). Fully opaque RGBA images are accepted (alpha dropped); transparent ones are refused.
    """
    path = Path(path).expanduser()
    return _expected_class_names(_from_npz_arrays(_load_npz_arrays(path), path, num_classes), class_names)


def _to_numpy(value: Any) -> np.ndarray:
    """A NumPy array from a tensor, array or sequence."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _npz_layout(
    images: torch.Tensor | np.ndarray,
    labels: torch.Tensor | np.ndarray | Sequence[int] | None,
    ids: Sequence[str | int] | None,
    class_names: Sequence[str] | None,
    path: Path,
) -> dict[str, np.ndarray]:
    """The arrays :func:`write_npz` stores: images as ``(N, H, W)`` or ``(N, H, W, C)``."""
    x = _to_numpy(images)
    if x.ndim != 4 or x.shape[1] not in (1, 3):
        raise _fail(path, f"write_npz: images must be (N, C, H, W) with C 1 or 3, got shape {x.shape}")
    arrays = {"images": x[:, 0] if x.shape[1] == 1 else x.transpose(0, 2, 3, 1)}
    if labels is not None:
        arrays["labels"] = _to_numpy(labels)
    if ids is not None:
        arrays["ids"] = np.asarray([str(i) for i in ids], dtype=str)
    if class_names is not None:
        arrays["class_names"] = np.asarray(list(class_names), dtype=str)
    return arrays


def write_npz(
    path: str | Path,
    images: torch.Tensor | np.ndarray,
    labels: torch.Tensor | np.ndarray | Sequence[int] | None = None,
    ids: Sequence[str | int] | None = None,
    class_names: Sequence[str] | None = None,
) -> Path:
    """Write images in the layout :func:`read_npz` reads, atomically.

    The arrays are checked exactly as :func:`read_npz` checks them, written to a temporary file in the
    target folder and moved into place with ``os.replace``: a reader never sees a half-written file.
    The parent folder is created if needed.

    Parameters
    ----------
    path : str or Path
        Target file (conventionally ending in ``.npz``; the name is used as given).
    images : torch.Tensor or numpy.ndarray
        uint8 ``(N, C, H, W)`` with ``C`` 1 or 3; stored as ``(N, H, W)`` or ``(N, H, W, 3)``.
    labels : array-like of int, optional
        ``(N,)``; ``-1`` marks unlabeled samples.
    ids : sequence of str or int, optional
        One identifier per image, stored as strings.
    class_names : sequence of str, optional
        One name per class.

    Returns
    -------
    Path
        The written file.

    Raises
    ------
    DataFormatError
        The arrays do not match the layout (nothing is written).
    """
    path = Path(path).expanduser()
    arrays = _npz_layout(images, labels, ids, class_names, path)
    _from_npz_arrays(arrays, path, None)
    return atomic_write(path, lambda fh: np.savez(fh, **arrays), prefix=f".{path.name}.")


# --------------------------------------------------------------------------------------------
# image folder
# --------------------------------------------------------------------------------------------


def _is_image(p: Path) -> bool:
    """A visible file with one of :data:`IMAGE_SUFFIXES` (any case)."""
    return p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES


def _scan_folder(root: Path) -> tuple[list[Path], list[Path]]:
    """The image files directly in ``root`` and its visible sub-folders, both sorted by name."""
    if not root.exists():
        raise _fail(root, "folder not found; check the path (a folder of images, or of class sub-folders)")
    if not root.is_dir():
        raise _fail(root, "not a folder; give a folder of images (or an .npz file)")
    entries = sorted(root.iterdir(), key=lambda p: p.name)
    files = [p for p in entries if _is_image(p)]
    folders = [p for p in entries if p.is_dir() and not p.name.startswith(".")]
    return files, folders


def _class_files(folder: Path) -> list[Path]:
    """The sorted image files of a class sub-folder; a deeper folder is refused."""
    entries = sorted(folder.iterdir(), key=lambda p: p.name)
    nested = [p for p in entries if p.is_dir() and not p.name.startswith(".")]
    if nested:
        raise _fail(
            nested[0],
            "nested folder: only one level of class sub-folders is read; move its images up into "
            f"{folder.name}/ (or into a class folder of their own)",
        )
    return [p for p in entries if _is_image(p)]


def _class_index(
    folders: list[Path], class_names: Sequence[str] | None, num_classes: int | None, root: Path
) -> list[str]:
    """The class names, index order: ``class_names`` when given (every sub-folder must be in it), else sorted."""
    found = [f.name for f in folders]
    if class_names is None:
        if num_classes is not None and len(found) > num_classes:
            raise _fail(
                root, f"{len(found)} class sub-folders but num_classes is {num_classes}; remove or merge folders"
            )
        return found
    names = [str(c) for c in class_names]
    _check_class_names(names, root, "class_names", num_classes)
    for name in found:
        if name not in names:
            raise _fail(
                root / name, f"sub-folder {name!r} is not in class_names {names}; rename it or add it to class_names"
            )
    return names


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) from an image file's header, nothing decoded; refused beyond MAX_IMAGE_PIXELS pixels.

    Raises
    ------
    DataFormatError
        Not an image Pillow knows, or one with more pixels than an image here may have (a 400-megapixel
        PNG of 140 KB is refused before its pixels exist).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below, with the fix
            with Image.open(path) as img:
                width, height = img.size
    except Image.DecompressionBombError:
        width = height = None
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise _fail(path, f"unreadable or corrupt image ({exc}); re-save it or remove it") from None
    if width is None or width * height > MAX_IMAGE_PIXELS:
        size = f"{width}x{height} pixels" if width is not None else "more pixels than Pillow opens"
        raise _fail(
            path,
            f"{size}; an image here may have at most {MAX_IMAGE_PIXELS} ({math.isqrt(MAX_IMAGE_PIXELS)}x"
            f"{math.isqrt(MAX_IMAGE_PIXELS)}): resize the images to the size the model takes",
        )
    return width, height


def _check_sizes(files: list[Path], root: Path) -> tuple[int, int]:
    """(width, height) of every image, read from the headers: all alike, their decoded total within the limit."""
    first = files[0]
    w1, h1 = image_size(first)
    for p in files[1:]:
        w2, h2 = image_size(p)
        if (w2, h2) != (w1, h1):
            raise _fail(
                root,
                f"images differ in size: {first.relative_to(root)} is {w1}x{h1}, {p.relative_to(root)} is "
                f"{w2}x{h2} (width x height); resize them all to one size",
            )
    refusal = too_large(f"its {len(files)} images of {w1}x{h1} pixels", len(files) * w1 * h1 * 3)
    if refusal:
        raise _fail(root, refusal)
    return w1, h1


def _decode(path: Path) -> tuple[np.ndarray, bool]:
    """One image as uint8 ``(H, W, 3)`` pixels and whether it is grayscale."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.load()
            mode = img.mode
            if mode in ("I", "F") or mode.startswith("I;"):
                raise _fail(path, f"{mode} image (16-bit or float pixels); save it as 8-bit grayscale or RGB")
            rgba = np.asarray(img.convert("RGBA"))
    except DataFormatError:
        raise
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise _fail(path, f"unreadable or corrupt image ({exc}); re-save it or remove it") from None
    rgb = _drop_opaque_alpha(rgba, path, "image")
    grey = mode in ("1", "L", "LA") or (
        mode in ("P", "PA") and bool(np.all(rgb[..., 0] == rgb[..., 1]) and np.all(rgb[..., 1] == rgb[..., 2]))
    )
    return rgb, grey


def _stack(paths: list[Path], width: int, height: int, root: Path) -> np.ndarray:
    """uint8 ``(N, C, H, W)``: C 1 when every image is grayscale, else 3; a mix of the two is refused.

    The images are decoded one by one into one array allocated up front (sizes from the headers, checked
    by :func:`_check_sizes`), so decoding takes the images' bytes and one image more.
    """
    out = np.empty((len(paths), 3, height, width), dtype=np.uint8)
    grey = []
    for i, path in enumerate(paths):
        rgb, is_grey = _decode(path)
        out[i] = rgb.transpose(2, 0, 1)
        grey.append(is_grey)
    if any(grey) and not all(grey):
        g, c = grey.index(True), grey.index(False)
        raise _fail(
            root,
            f"mixes grayscale ({paths[g].relative_to(root)}) and colour ({paths[c].relative_to(root)}) images; "
            "convert them all to one mode (e.g. RGB)",
        )
    return np.ascontiguousarray(out[:, :1]) if all(grey) else out


def read_image_folder(
    path: str | Path, class_names: Sequence[str] | None = None, num_classes: int | None = None
) -> LocalImages:
    """Read a folder of image files: files directly in it are unlabeled, sub-folders are classes.

    Files are read in sorted order: first the unlabeled files in ``path``, then each sub-folder's
    files, sub-folders sorted by name. Hidden files and folders (a leading ``.``) and files without an
    image suffix are skipped. Folders nested inside a class sub-folder are refused (only one level of
    class folders is read). All images must have one size; all grayscale (modes ``1``, ``L``, grey
    palettes) gives ``C = 1``, all colour gives ``C = 3``; a mix is refused. Fully opaque RGBA images
    are accepted (alpha dropped); transparent ones are refused, and so are 16-bit and float images. Of a
    multi-frame GIF or TIFF only the first frame is read.

    Parameters
    ----------
    path : str or Path
        The folder.
    class_names : sequence of str, optional
        The class order: a sub-folder's index is its position here (a sub-folder not listed is an error).
        Default: the sorted sub-folder names. Pass it whenever a folder may lack some classes (a silo's
        data): sorted names of a subset would number the classes differently.
    num_classes : int, optional
        When given, ``class_names`` must have that many entries, or the sub-folders may not exceed it.

    Returns
    -------
    LocalImages
        ``ids`` are the files' paths relative to ``path`` (``"cat/001.png"``).

    Raises
    ------
    DataFormatError
        Missing or empty folder, an unreadable image, mixed sizes or modes, a nested folder, a sub-folder
        not in ``class_names``, or more classes than ``num_classes``.
    """
    root = Path(path).expanduser()
    unlabeled, folders = _scan_folder(root)
    names = _class_index(folders, class_names, num_classes, root)
    files = [(p, UNLABELED) for p in unlabeled]
    for folder in folders:
        files += [(p, names.index(folder.name)) for p in _class_files(folder)]
    if not files:
        raise _fail(root, f"no images found (looked for {', '.join(IMAGE_SUFFIXES)} in it and its sub-folders)")
    paths = [p for p, _ in files]
    width, height = _check_sizes(paths, root)  # from the headers, before any pixel is decoded
    return LocalImages(
        images=torch.from_numpy(_stack(paths, width, height, root)),
        labels=torch.tensor([label for _, label in files], dtype=torch.int64),
        ids=[p.relative_to(root).as_posix() for p, _ in files],
        class_names=names or None,
        source=str(root),
    )


def read_local_images(path: str | Path, **kwargs: Any) -> LocalImages:
    """Read an ``.npz`` archive (:func:`read_npz`) or an image folder (:func:`read_image_folder`).

    Parameters
    ----------
    path : str or Path
        A file ending in ``.npz`` (any case) or a folder.
    **kwargs
        Passed on: ``num_classes`` and ``class_names`` (both readers take them).

    Returns
    -------
    LocalImages

    Raises
    ------
    DataFormatError
        The path is neither, or the reader refuses its content.
    """
    p = Path(path).expanduser()
    if p.suffix.lower() == ".npz":
        return read_npz(p, **kwargs)
    if p.is_dir():
        return read_image_folder(p, **kwargs)
    if p.exists():
        raise _fail(p, "expected an .npz file or a folder of images")
    raise _fail(p, "not found; give an .npz file or a folder of images")
