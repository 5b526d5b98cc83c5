"""On-device pseudo-labeling with an exported fedml_ssfl model: numpy and onnxruntime only.

Copy this one file and a ``model.onnx`` / ``model.ort`` (or ``model.int8.*``) to a device, then::

    python edge_label.py model.int8.ort unlabeled.npy --out labels/
    python edge_label.py model.int8.ort photos/ --out labels/ --ensemble-state ensemble.npz

Input: a ``.npy`` batch of uint8 images ``(N, C, H, W)``, a ``.npz`` with ``images`` (and
optionally ``ids``), or a folder of image files (PNG/JPEG/..., read with Pillow) of any size and
mode, which the image rule brings to the model's input (:func:`prepare_image`: EXIF orientation,
8 bits, alpha over black, scaled to cover H x W and centre-cropped, luma or R, G, B). Output, in
``--out``: ``pseudo_labels.csv`` and ``pseudo_labels.jsonl`` (id, label, class name, confidence,
mask; probabilities in the JSONL) and ``pseudo_labels.npz`` (the same as arrays, to feed back
into training). Throughput is printed. The ``.ort`` files are exported for phones with a fixed
batch (1 by default) and run image by image; ``model.onnx`` takes any batch, for bulk labeling.

Self-ensemble (FedSEAL, Bian et al. Eq. 8): with ``--ensemble-state FILE`` the runner keeps,
per sample id, the running mean of the probabilities the sample received from successive
model versions, ``p_t = p_{t-1} + (p(x; w_t) - p_{t-1}) / t``, and labels from that mean:
label = argmax, confidence = max, mask = confidence >= threshold[label] (Eq. 9/10). Running the
same model version twice does not count twice. The state is a small ``.npz`` (ids, mean
probabilities, counts), written atomically.

Inputs are bounded before anything is decoded: a model file may have :data:`MAX_MODEL_BYTES`; the
shape and dtype of a ``.npy`` (or of an ``.npz`` member) come from its header, object (pickled)
arrays are refused unread, and the decoded size must fit :func:`input_budget` (a quarter of the
memory this process may use); an image file's size is read from its header and refused beyond
:data:`MAX_IMAGE_PIXELS`, so a decompression bomb is refused before its pixels exist. Every refusal is
one line naming the file and the fix (``edge_label: error: ...``, exit 2; a file that cannot be written, exit 1).

This module must not import torch (a test runs it where importing torch fails) nor fedml_ssfl (it
is copied to devices alone); the only optional dependency is Pillow, for image folders.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import errno
import json
import math
import os
import re
import sys
import tempfile
import time
import warnings
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The edge contract, defined here once (the exporter and its checks import it; this file runs alone).
EDGE_FORMAT_VERSION = 3
"""Version of the contract below. Written as the model's ``model_version`` (ModelProto) and in its
``format`` metadata; apps check it before trusting names and dtypes. 3: ``thresholds`` is a constant of
the graph, ``images`` the only input (2 had it as an optional input, which onnxruntime warned about on
every load), and the image rule's metadata keys. 2: ``mask`` uint8 (was bool), ``thresholds`` optional
with the defaults baked in (was required)."""
FORMAT_TAG = f"fedml_ssfl.edge/{EDGE_FORMAT_VERSION}"
READABLE_FORMATS = {"fedml_ssfl.edge/1": 1, "fedml_ssfl.edge/2": 2, FORMAT_TAG: EDGE_FORMAT_VERSION}
"""``format`` metadata this runner reads, and the contract version each one means."""
STATE_FORMAT = "fedml_ssfl.edge.ensemble/1"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm", ".pnm")
INPUT_NAMES = ("images",)  # uint8 images (N, C, H, W): the graph's only input
THRESHOLDS = "thresholds"
"""The graph's constant (K,) of per-class default thresholds (metadata ``default_thresholds``). An input in
contracts 1 (required) and 2 (optional, with that default)."""
OUTPUT_NAMES = ("probs", "label", "confidence", "mask")  # the edge graph's outputs, in order
INPUT_DTYPES = {"images": "uint8"}
OUTPUT_DTYPES = {"probs": "float32", "label": "int64", "confidence": "float32", "mask": "uint8"}
"""numpy names of the graph's element types. ``mask`` is 0/1 uint8: onnxruntime's Objective-C / Swift
API has no bool tensor type."""

# The image rule: how any picture becomes the model's input (:func:`prepare_image`; docs/edge.md).
LAYOUT = "NCHW"
RESIZE_RULE = "shorter_side_center_crop"
"""Scale so that the image covers H x W with its aspect ratio kept (the shorter side, for a square
model), then take the centre H x W: the largest centred region of the model's aspect ratio, resampled."""
RESAMPLE = "bilinear"
"""The resampling filter of :data:`RESIZE_RULE`: Pillow's bilinear filter, which widens to the scale
when shrinking (every source pixel under an output pixel counts)."""
LUMA_WEIGHTS = (299, 587, 114)
"""ITU-R BT.601 luma, per mille: ``L = (299 R + 587 G + 114 B + 500) // 1000`` (rounded)."""


def channel_order(channels: int) -> str:
    """The ``channel_order`` metadata: ``L`` (luma) for 1 channel, ``RGB`` for 3."""
    return {1: "L", 3: "RGB"}.get(channels, f"{channels} channels, as in the training data")


def image_rule_metadata(channels: int) -> dict[str, str]:
    """The image rule's metadata keys for a model of ``channels`` channels (the exporter writes them)."""
    return {"layout": LAYOUT, "channel_order": channel_order(channels), "resize": RESIZE_RULE, "resample": RESAMPLE}


MAX_MODEL_BYTES = 2**31
"""The largest model file loaded: 2 GiB, the most one ONNX protobuf can hold (checked before onnxruntime reads it)."""


class EdgeInputError(ValueError):
    """Input the model cannot take (shape, dtype, channels, thresholds, state file); says what it expects."""


def input_budget() -> int:
    """Bytes one input may decode to: a quarter of the memory this process may use.

    That is the machine's RAM, or the address space an ``RLIMIT_AS`` (``ulimit -v``) leaves, the
    smaller (the rule of ``fedml_ssfl.limits``, restated here because this file runs alone).
    """
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        ram = 2**31
    try:
        import resource  # Unix only
    except ImportError:
        return ram // 4
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        try:
            mapped = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            mapped = 0
        ram = min(ram, max(soft - mapped, 0))
    return ram // 4


@contextlib.contextmanager
def _naming(path: Path):
    """Give an OSError the block raises without a file name (a full disk at a flush) the name ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None


def _check_budget(source: Path, what: str, nbytes: int) -> None:
    budget = input_budget()
    if nbytes > budget:
        raise EdgeInputError(
            f"{source}: {what} would take {nbytes / 2**20:.1f} MiB decoded, more than the "
            f"{budget / 2**20:.1f} MiB one input may take here (a quarter of the memory); "
            "split it into smaller batches"
        )


def _npy_header(fh, size: int, source: Path, key: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype a ``.npy`` stream's header declares, checked (no object dtype, data present); nothing decoded."""
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
        raise EdgeInputError(f"{source}: {key} is not a readable .npy array ({exc}); save it with np.save") from None
    if any(int(d) < 0 for d in shape):
        raise EdgeInputError(
            f"{source}: {key}'s header claims shape {tuple(shape)}, with a negative size: the file is damaged or was "
            "not written by NumPy; save it again with np.save"
        )
    if dtype.hasobject:
        raise EdgeInputError(
            f"{source}: {key} is an object array (pickled Python objects, never loaded); save "
            "uint8 images (N, C, H, W) with np.save"
        )
    nbytes = math.prod(shape) * dtype.itemsize
    if offset + nbytes > size:
        raise EdgeInputError(
            f"{source}: {key}'s header claims shape {tuple(shape)} of {dtype} ({nbytes} bytes), but "
            f"the file holds {size - offset} bytes of data: it is damaged or cut short; save it again"
        )
    _check_budget(source, f"{key} {tuple(shape)} of {dtype}", nbytes)
    return tuple(shape), dtype


def _read_npy(path: Path) -> np.ndarray:
    with open(path, "rb") as fh:
        _npy_header(fh, path.stat().st_size, path, "the array")
    return np.load(path, allow_pickle=False)


def _read_npz(path: Path) -> tuple[np.ndarray, list[str] | None]:
    """``images`` and the ``ids`` of an ``.npz``, every member's header checked first (no ``images``: refused)."""
    try:
        with zipfile.ZipFile(path) as zf:
            members = {i.filename[:-4]: i for i in zf.infolist() if i.filename.endswith(".npy")}
            key = "images"
            if key not in members:  # another array is not taken for the images (it was, silently, when alone)
                raise EdgeInputError(
                    f"{path}: an .npz needs an 'images' array (found {', '.join(members) or 'nothing'}); save it "
                    "with np.savez(path, images=...), or pass a .npy of the images"
                )
            for name in (key, "ids"):
                if name in members:
                    with zf.open(members[name]) as fh:
                        _npy_header(fh, members[name].file_size, path, f"key {name!r}")
        with np.load(path, allow_pickle=False) as data:
            images = data[key]
            ids = [str(v) for v in data["ids"]] if "ids" in members else None
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise EdgeInputError(f"{path}: not a readable .npz archive ({exc}); save it with np.savez") from None
    return images, ids


@dataclass
class ModelInfo:
    """What an exported model says about itself (its ONNX metadata)."""

    path: Path
    class_names: list[str]
    channels: int
    height: int
    width: int
    default_thresholds: list[float]
    model_version: str
    config_hash: str
    precision: str
    algorithm: str
    round: int
    format_version: int = EDGE_FORMAT_VERSION
    batch_size: int | None = None  # fixed by the model (``.ort`` files are exported with batch 1), or None: any

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def shape(self) -> tuple[int, int, int]:
        """One image as the model takes it: (C, H, W)."""
        return self.channels, self.height, self.width

    @property
    def expected(self) -> str:
        return f"uint8 images of shape (N, {self.channels}, {self.height}, {self.width}) (N, C, H, W)"


def model_batch_size(session) -> int | None:
    """The batch size an onnxruntime session's ``images`` input is fixed to, or None when it is dynamic."""
    dim = next((i.shape[0] for i in session.get_inputs() if i.name == INPUT_NAMES[0]), None)
    return dim if isinstance(dim, int) and dim > 0 else None


def run_batches(session, images: np.ndarray, thresholds=None, batch_size: int = 256) -> list[np.ndarray]:
    """Run an edge model over ``images``; the outputs in :data:`OUTPUT_NAMES` order, one row per image.

    ``thresholds`` None feeds ``images`` alone: the model's own thresholds apply (a graph constant
    since contract 3, the baked-in default of an optional input in contract 2; a contract-1 model
    needs them given). Given, they are fed where the model takes them as an input (contracts 1 and
    2); otherwise ``mask`` is recomputed from the outputs as the graph computes it,
    ``confidence >= thresholds[label]``. A model with a fixed batch runs in batches of that size, the
    last one padded with zeros and the padding dropped from the outputs; ``batch_size`` applies
    otherwise. With no images every entry is None.
    """
    fixed = model_batch_size(session)
    step = fixed or batch_size
    thr = None if thresholds is None else np.asarray(thresholds, dtype=np.float32)
    takes = {i.name for i in (*session.get_inputs(), *session.get_overridable_initializers())}
    feed = {THRESHOLDS: thr} if thr is not None and THRESHOLDS in takes else {}
    parts: list[list[np.ndarray]] = [[] for _ in OUTPUT_NAMES]
    for start in range(0, len(images), step):
        chunk = images[start : start + step]
        n = len(chunk)
        if fixed and n < fixed:
            chunk = np.concatenate([chunk, np.zeros((fixed - n, *chunk.shape[1:]), dtype=chunk.dtype)])
        out = session.run(list(OUTPUT_NAMES), {INPUT_NAMES[0]: chunk, **feed})
        for acc, arr in zip(parts, out):
            acc.append(arr[:n])
    result = [np.concatenate(p) if p else None for p in parts]
    if thr is not None and not feed and result[0] is not None:
        _, label, confidence, mask = result
        result[3] = (confidence >= thr[label]).astype(mask.dtype)
    return result


def _ort_reason(exc: BaseException) -> str:
    """onnxruntime's load error in a few words: its type and the message without the code and source location."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"^Load model from .*? failed:", "", text)
    text = re.sub(r"^\S+\.cc:\d+ \S+ ", "", text).strip()
    return f"{type(exc).__name__}: {text}"[:160] if text else type(exc).__name__


class EdgeLabeler:
    """An exported edge model in an onnxruntime session.

    Parameters
    ----------
    model_path : path
        ``.onnx`` or ``.ort`` file written by ``mobile_export.export``.
    threads : int
        onnxruntime intra-op threads (0: its default, one per physical core).

    Raises
    ------
    EdgeInputError
        The file is missing, is not an ONNX / ORT model (a text file, a truncated model), or is a
        model that ``mobile_export`` did not write.
    """

    def __init__(self, model_path: str | Path, threads: int = 0) -> None:
        import onnxruntime as ort

        path = Path(model_path)
        if path.is_dir():
            raise EdgeInputError(
                f"model file {path} is a folder; pass the model.onnx / model.ort in it that `fedml-ssfl export` wrote"
            )
        if not path.is_file():
            raise EdgeInputError(f"model file {path} does not exist")
        if path.stat().st_size > MAX_MODEL_BYTES:
            raise EdgeInputError(
                f"{path} has {path.stat().st_size / 2**30:.1f} GiB, more than the 2 GiB an ONNX model "
                "file can hold: not an exported edge model; pass the model.onnx / model.ort that "
                "`fedml-ssfl export` wrote"
            )
        if threads < 0:
            raise EdgeInputError(f"threads must be >= 0 (0: onnxruntime's own choice), got {threads}")
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime's own types: InvalidProtobuf, Fail, ...
            reason = "an empty file" if path.stat().st_size == 0 else _ort_reason(exc)
            raise EdgeInputError(
                f"{path} is not an ONNX model onnxruntime can load ({reason}): another "
                "kind of file, or truncated; export the model with `fedml-ssfl export RUN_DIR` and "
                "pass its model.onnx / model.ort (or model.int8.*)"
            ) from None
        meta = self.session.get_modelmeta().custom_metadata_map
        if meta.get("format") not in READABLE_FORMATS:
            raise EdgeInputError(
                f"{path} is not a fedml_ssfl edge model (metadata 'format' is "
                f"{meta.get('format')!r}, expected {FORMAT_TAG!r}); export it with mobile_export"
            )
        try:
            # the input's own dimensions: the one source of truth for the shape (metadata input_shape copies them)
            _, c, h, w = next(i.shape for i in self.session.get_inputs() if i.name == INPUT_NAMES[0])
            self.info = ModelInfo(
                path=path,
                class_names=[str(n) for n in json.loads(meta["class_names"])],
                channels=int(c),
                height=int(h),
                width=int(w),
                default_thresholds=[float(v) for v in json.loads(meta["default_thresholds"])],
                model_version=meta.get("model_version", ""),
                config_hash=meta.get("config_hash", ""),
                precision=meta.get("precision", ""),
                algorithm=meta.get("algorithm", ""),
                round=int(meta.get("round", -1)),
                format_version=READABLE_FORMATS[meta["format"]],
                batch_size=model_batch_size(self.session),
            )
        except (KeyError, ValueError, TypeError, StopIteration) as exc:
            raise EdgeInputError(
                f"{path}: its edge metadata is incomplete or damaged ({type(exc).__name__}: {exc}); "
                "export the model again with `fedml-ssfl export`"
            ) from None

    def thresholds(self, values=None) -> np.ndarray:
        """The model's default thresholds, or ``values`` (one tau for all classes, or one per class)."""
        k = self.info.num_classes
        if values is None:
            return np.asarray(self.info.default_thresholds, dtype=np.float32)
        arr = np.asarray(values, dtype=np.float64).reshape(-1)
        if arr.size == 1:
            arr = np.full(k, arr[0])
        if arr.size != k:
            raise EdgeInputError(
                f"thresholds: got {arr.size} values for a model with {k} classes; "
                f"give one tau or {k} values, one per class"
            )
        if not np.all((arr >= 0) & (arr <= 1)):
            raise EdgeInputError("thresholds: every value must lie in [0, 1]")
        return arr.astype(np.float32)

    def check_images(self, images, where: str = "images") -> np.ndarray:
        """``images`` if they are what the model takes, else an error naming the expected input."""
        arr = np.asarray(images)
        info = self.info
        want = (info.channels, info.height, info.width)
        got = f"got {arr.dtype} array of shape {tuple(arr.shape)}"
        if arr.ndim == 3 and info.channels == 1 and tuple(arr.shape[1:]) == want[1:]:
            raise EdgeInputError(f"{where}: expected {info.expected}; {got}: add the channel axis, images[:, None]")
        if arr.ndim != 4:
            raise EdgeInputError(f"{where}: expected {info.expected}; {got}")
        if tuple(arr.shape[1:]) != want:
            hint = ""
            if arr.shape[-1] == info.channels and tuple(arr.shape[1:3]) == want[1:]:
                hint = ": channels-last (N, H, W, C) data; transpose with images.transpose(0, 3, 1, 2)"
            elif arr.shape[1] != info.channels and tuple(arr.shape[2:]) == want[1:]:
                hint = f": {arr.shape[1]} channels, the model takes {info.channels}"
            raise EdgeInputError(f"{where}: expected {info.expected}; {got}{hint}")
        if arr.dtype != np.uint8:
            hint = ""
            if np.issubdtype(arr.dtype, np.floating):
                hint = " (floats in [0, 1]? use (images * 255).round().astype(np.uint8); the model normalizes itself)"
            raise EdgeInputError(f"{where}: expected {info.expected}; {got}{hint}")
        return np.ascontiguousarray(arr)

    def prepare(self, image) -> np.ndarray:
        """Any image (a file, a Pillow image, an array) as this model takes it: :func:`prepare_image`."""
        return prepare_image(image, self.info.shape)

    def predict(self, images: np.ndarray, thresholds=None, batch_size: int = 256) -> dict[str, np.ndarray]:
        """Run the model in batches: ``probs`` (N, K), ``label``, ``confidence``, ``mask``, and ``seconds``.

        ``mask`` comes back as a numpy bool array (the graph's 0/1 uint8, so that ``images[mask]``
        selects). Without ``thresholds`` only ``images`` is fed and the model's baked-in defaults
        apply. A model with a fixed batch (the ``.ort`` files) runs in batches of that size.
        """
        images = self.check_images(images)
        if batch_size < 1:
            raise EdgeInputError(f"batch size must be >= 1, got {batch_size}")
        thr = self.thresholds(thresholds) if thresholds is not None or self.info.format_version < 2 else None
        t = time.perf_counter()
        outputs = run_batches(self.session, images, thr, batch_size)
        seconds = time.perf_counter() - t
        k = self.info.num_classes
        empty = (np.zeros((0, k), np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.uint8))
        res = {name: (out if out is not None else e) for name, out, e in zip(OUTPUT_NAMES, outputs, empty)}
        res["mask"] = res["mask"] != 0
        res["seconds"] = np.float64(seconds)
        return res


# ---------------------------------------------------------------------------------------------
# reading images


def load_images(
    path: str | Path, labeler: EdgeLabeler | None = None, steps: Counter | None = None
) -> tuple[list[str], np.ndarray]:
    """Read unlabeled images and their sample ids from a ``.npy`` / ``.npz`` batch or a folder of files.

    A batch must hold the model's input as it is, uint8 ``(N, C, H, W)``; image files of any size
    and mode are brought to it by the image rule (:func:`prepare_image`), and ``steps``, when
    given, counts what the rule did to them (``resized``, ``rotated``, ``to L``, ...). Ids:
    ``<file name>#<index>`` for a batch (or the ``ids`` array of an ``.npz``), the path relative to
    the folder for image files. They key the self-ensemble state, so keep them stable from round
    to round.
    """
    p = Path(path)
    if not p.exists():
        raise EdgeInputError(f"input {p} does not exist")
    if p.is_dir():
        if labeler is None:
            raise EdgeInputError("reading an image folder needs the model (for the expected channels and size)")
        return _load_folder(p, labeler.info, Counter() if steps is None else steps)
    if p.suffix == ".npy":
        images = _read_npy(p)
        ids = [f"{p.name}#{i}" for i in range(len(images))]
    elif p.suffix == ".npz":
        images, ids = _read_npz(p)
        ids = ids if ids is not None else [f"{p.name}#{i}" for i in range(len(images))]
        if len(ids) != len(images):
            raise EdgeInputError(f"{p}: 'ids' has {len(ids)} entries for {len(images)} images")
    else:
        raise EdgeInputError(
            f"input {p}: expected a .npy or .npz batch of uint8 (N, C, H, W) images, or a folder "
            f"of image files ({', '.join(IMAGE_SUFFIXES)})"
        )
    if len(set(ids)) != len(ids):
        raise EdgeInputError(f"{p}: sample ids must be unique")
    if labeler is not None:
        images = labeler.check_images(images, where=str(p))
    return ids, images


def _load_folder(folder: Path, info: ModelInfo, steps: Counter) -> tuple[list[str], np.ndarray]:
    try:
        import PIL.Image  # noqa: F401  (is Pillow there? prepare_image reads files with it)
    except ImportError as exc:
        raise EdgeInputError(
            f"reading image files from {folder} needs Pillow (pip install pillow); "
            f"or pass a .npy/.npz batch of {info.expected}"
        ) from exc
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise EdgeInputError(f"{folder} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
    _rule_channels(info.shape, folder)
    _check_budget(
        folder,
        f"{len(files)} images of {info.width}x{info.height}",
        len(files) * info.channels * info.height * info.width,
    )
    out = np.empty((len(files), *info.shape), dtype=np.uint8)
    for i, f in enumerate(files):
        out[i], done = _prepare(f, info.shape)
        steps.update(done)
    return [f.relative_to(folder).as_posix() for f in files], out


# ---------------------------------------------------------------------------------------------
# the image rule: any picture -> the model's input


MAX_IMAGE_PIXELS = 8192 * 8192
"""The most pixels one image file may have, read from its header before any is decoded (a 48-megapixel
phone photo has 8064 x 6048)."""
BYTES_PER_PIXEL = 16
"""About what decoding and converting one image takes at most, per source pixel (a 16-bit image's copies)."""


def prepare_image(image, shape: tuple[int, int, int]) -> np.ndarray:
    """Any image as a model of input ``shape`` = (C, H, W) takes it: uint8 (C, H, W), the contract's rule applied.

    The rule (docs/edge.md, "Any image to the input"), in order:

    1. a file's EXIF orientation is applied (a photo taken sideways is turned upright);
    2. pixels become 8-bit: 16-bit ones (Pillow modes ``I;16``, ``I``, uint16 arrays) are scaled,
       ``round(v / 257)`` (values outside 0..65535 clipped), palettes looked up, 1-bit ones 0 / 255,
       other colour spaces (CMYK, YCbCr, ...) converted to RGB; float images are refused;
    3. alpha is composited over black: ``round(c * a / 255)`` per channel (premultiplied);
    4. an image not of size H x W is scaled, its aspect ratio kept, until it covers H x W, and the
       centre H x W is kept (:data:`RESIZE_RULE`: the largest centred region of the model's aspect
       ratio, resampled with :data:`RESAMPLE`); an image of size H x W is left as it is;
    5. channels: a 1-channel model takes luma, ``L = (299 R + 587 G + 114 B + 500) // 1000``
       (:data:`LUMA_WEIGHTS`); a 3-channel model takes R, G, B in that order, a grey image's value
       in all three.

    Parameters
    ----------
    image : path, PIL.Image.Image or numpy.ndarray
        An image file (any format Pillow reads; its size is checked from the header first, at most
        :data:`MAX_IMAGE_PIXELS`), a Pillow image, or an array as image libraries give one: ``(H, W)``
        grey, ``(H, W, C)`` channels last with C 1 (grey), 2 (grey + alpha), 3 (R, G, B) or 4
        (R, G, B, alpha), uint8 or uint16. OpenCV's arrays are B, G, R: reverse them first,
        ``img[..., ::-1]``.
    shape : (int, int, int)
        The model's (C, H, W), C 1 or 3 (``EdgeLabeler.info.shape``; :meth:`EdgeLabeler.prepare`).

    Returns
    -------
    numpy.ndarray
        uint8 (C, H, W), C-contiguous: one row of the model's ``images`` input.

    Raises
    ------
    EdgeInputError
        An unreadable or oversized file, a float or otherwise unsupported image, a model of other
        than 1 or 3 channels. Pillow is needed for files, Pillow images and any resizing; an array of
        the model's size is prepared with numpy alone.
    """
    return _prepare(image, tuple(int(v) for v in shape))[0]


def _rule_channels(shape: tuple[int, int, int], where) -> None:
    if shape[0] not in (1, 3):
        raise EdgeInputError(
            f"{where}: the image rule feeds 1- (L) or 3-channel (RGB) models; this one takes "
            f"{shape[0]} channels: pass a .npy/.npz batch of uint8 (N, {shape[0]}, {shape[1]}, "
            f"{shape[2]}) images"
        )


def _prepare(image, shape: tuple[int, int, int]) -> tuple[np.ndarray, list[str]]:
    """:func:`prepare_image`, and the names of the steps that changed something (for the labeller's summary)."""
    _rule_channels(shape, image if isinstance(image, (str, Path)) else "image")
    done: list[str] = []
    if isinstance(image, (str, Path)):
        arr, where = _read_file(Path(image), done), str(image)
    elif isinstance(image, np.ndarray):
        arr, where = _from_array(image, done), "image"
    elif hasattr(image, "getbands"):  # a Pillow image
        arr, where = _from_pillow(image, "image", done), "image"
    else:
        got = type(image).__name__
        raise EdgeInputError(f"image: expected a file path, a Pillow image or a numpy array, got {got}")
    arr = _resize_and_crop(arr, shape[1], shape[2], where, done)
    c = shape[0]
    if c == 1 and arr.ndim == 3:
        wide = arr.astype(np.uint32)
        luma = sum(wide[..., i] * weight for i, weight in enumerate(LUMA_WEIGHTS))
        arr = ((luma + 500) // 1000).astype(np.uint8)
        done.append("to L")
    if arr.ndim == 2:
        out = np.repeat(arr[None], c, axis=0)
        if c == 3:
            done.append("to RGB")
    else:
        out = arr.transpose(2, 0, 1)
    return np.ascontiguousarray(out, dtype=np.uint8), done


def _read_file(path: Path, done: list[str]) -> np.ndarray:
    """An image file as uint8 (H, W) or (H, W, 3): size checked from its header, then decoded and made 8-bit."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:
        raise EdgeInputError(f"{path}: reading image files needs Pillow (pip install pillow)") from exc
    if not path.is_file():
        raise EdgeInputError(f"image file {path} does not exist")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the size check below refuses it
            with Image.open(path) as img:
                width, height = img.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise EdgeInputError(
                        f"{path}: {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS} "
                        f"({math.isqrt(MAX_IMAGE_PIXELS)}x{math.isqrt(MAX_IMAGE_PIXELS)}) an image "
                        "may have here; scale it down first"
                    )
                _check_budget(path, f"a {width}x{height} image", width * height * BYTES_PER_PIXEL)
                return _from_pillow(img, str(path), done)
    except Image.DecompressionBombError:
        raise EdgeInputError(
            f"{path}: more pixels than Pillow opens (a decompression bomb?); an image may have at "
            f"most {MAX_IMAGE_PIXELS} pixels here; scale it down first"
        ) from None
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise EdgeInputError(f"{path}: unreadable or corrupt image ({exc}); save it again, or remove it") from None


_TO_RGB = {
    "RGBX": "RGB",
    "CMYK": "RGB",
    "YCbCr": "RGB",
    "LAB": "RGB",
    "HSV": "RGB",
    "RGBa": "RGBA",
    "La": "LA",
    "PA": "RGBA",
    "1": "L",
}
"""Pillow modes converted by Pillow before the rest of the rule (a palette goes to RGB or RGBA, see below)."""


def _from_pillow(img, where: str, done: list[str]) -> np.ndarray:
    """A Pillow image as uint8 (H, W) or (H, W, 3), upright, 8-bit and without alpha (steps 1 to 3 of the rule)."""
    if img.getexif().get(0x0112, 1) in range(2, 9):  # EXIF Orientation: 1 is upright
        from PIL import ImageOps

        img = ImageOps.exif_transpose(img)
        done.append("rotated")
    mode = img.mode
    if mode == "F":
        raise EdgeInputError(
            f"{where}: a 32-bit float image (Pillow mode F); the model takes 8-bit pixels: save it "
            "as 8-bit grayscale or RGB"
        )
    if mode == "I" or mode.startswith("I;16"):  # 16-bit grey (32-bit I clipped to 16 bits); scaled in _from_array
        return _from_array(np.clip(np.asarray(img), 0, 65535).astype(np.uint16), done)
    if mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    elif mode in _TO_RGB:
        img = img.convert(_TO_RGB[mode])
    elif mode not in ("L", "LA", "RGB", "RGBA"):
        try:
            img = img.convert("RGB")
        except ValueError as exc:
            raise EdgeInputError(
                f"{where}: a Pillow mode {mode} image cannot be read as RGB ({exc}); save it as 8-bit grayscale or RGB"
            ) from None
    return _from_array(np.asarray(img), done)


def _from_array(arr: np.ndarray, done: list[str]) -> np.ndarray:
    """An (H, W) / (H, W, C) array as uint8 (H, W) or (H, W, 3): 16-bit scaled, alpha over black (steps 2, 3)."""
    shape = f"{arr.dtype} array of shape {arr.shape}"
    if arr.ndim == 3 and arr.shape[-1] not in (1, 2, 3, 4) and arr.shape[0] in (1, 3, 4):
        raise EdgeInputError(f"image: a {shape}: channels first? pass image.transpose(1, 2, 0), channels last")
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[-1] not in (1, 2, 3, 4)) or 0 in arr.shape[:2]:
        raise EdgeInputError(
            f"image: a {shape}; expected (H, W) grey or (H, W, C) with C 1 (grey), 2 (grey, "
            "alpha), 3 (R, G, B) or 4 (R, G, B, alpha)"
        )
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 2:  # 16-bit: round(v / 257), exact in integers
        wide = arr.astype(np.uint32)
        wide += 128
        wide //= 257
        arr = wide.astype(np.uint8)
        done.append("16-bit to 8-bit")
    elif arr.dtype != np.uint8:
        hint = (
            " (floats in [0, 1]? use (image * 255).round().astype(np.uint8))"
            if arr.dtype.kind == "f"
            else " (values 0..255? use image.astype(np.uint8); 16-bit ones: image.astype(np.uint16))"
        )
        raise EdgeInputError(f"image: a {shape}; expected uint8 or uint16 pixels{hint}")
    if arr.ndim == 3 and arr.shape[-1] in (2, 4):
        alpha = arr[..., -1]
        colour = arr[..., :-1]
        if (alpha == 255).all():
            arr = colour
        else:  # over black: round(c * a / 255); c * a + 127 never ends in .5 (255 is odd), so // rounds exactly
            a = alpha.astype(np.uint16)
            arr = np.empty(colour.shape, dtype=np.uint8)
            for i in range(colour.shape[-1]):
                arr[..., i] = (colour[..., i].astype(np.uint16) * a + 127) // 255
            done.append("alpha over black")
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    return arr


def _resize_and_crop(arr: np.ndarray, height: int, width: int, where: str, done: list[str]) -> np.ndarray:
    """Step 4: scale to cover height x width, aspect ratio kept, and keep the centre; as it is at that size."""
    h, w = arr.shape[:2]
    if (h, w) == (height, width):
        return arr
    try:
        from PIL import Image
    except ImportError as exc:
        raise EdgeInputError(
            f"{where}: a {w}x{h} image for a {width}x{height} model: resizing needs Pillow (pip install pillow)"
        ) from exc
    scale = max(width / w, height / h)
    box_w, box_h = width / scale, height / scale  # the source region that becomes the model's input
    left, top = (w - box_w) / 2, (h - box_h) / 2
    img = Image.fromarray(np.ascontiguousarray(arr))
    out = img.resize((width, height), Image.Resampling.BILINEAR, box=(left, top, left + box_w, top + box_h))
    done.append("resized" if scale != 1 else "cropped")
    return np.asarray(out)


# ---------------------------------------------------------------------------------------------
# the on-device self-ensemble (FedSEAL Eq. 8)


class EnsembleState:
    """Per-sample running mean of probabilities over model versions, kept in a small ``.npz``."""

    def __init__(self, class_names: list[str], config_hash: str) -> None:
        self.class_names = list(class_names)
        self.config_hash = config_hash
        self.ids: list[str] = []
        self.probs = np.zeros((0, len(class_names)), dtype=np.float64)
        self.counts = np.zeros(0, dtype=np.int64)
        self.versions: list[str] = []
        self._index: dict[str, int] = {}

    @classmethod
    def load(cls, path: str | Path, info: ModelInfo, reset: bool = False) -> EnsembleState:
        """Read ``path`` (a fresh state when missing or ``reset``); refuse a state from another run or label set."""
        state = cls(info.class_names, info.config_hash)
        p = Path(path)
        if p.is_dir():
            raise EdgeInputError(f"ensemble state {p} is a folder; pass a file name (e.g. {p / 'ensemble.npz'})")
        if reset or not p.is_file():
            return state
        try:
            with np.load(p, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                ids, probs = [str(v) for v in data["ids"]], np.asarray(data["probs"], dtype=np.float64)
                counts, versions = np.asarray(data["counts"], dtype=np.int64), [str(v) for v in data["versions"]]
        except (OSError, KeyError, ValueError) as exc:
            raise EdgeInputError(
                f"ensemble state {p} is unreadable ({exc}); remove it or pass --reset-ensemble"
            ) from exc
        if meta.get("format") != STATE_FORMAT:
            raise EdgeInputError(f"{p} is not an ensemble state file ({STATE_FORMAT})")
        if meta.get("class_names") != info.class_names:
            raise EdgeInputError(
                f"ensemble state {p} holds probabilities over other classes "
                f"({meta.get('class_names')}); the model labels {info.class_names}"
            )
        if meta.get("config_hash") != info.config_hash:
            raise EdgeInputError(
                f"ensemble state {p} was built from run {meta.get('config_hash')}, this model comes from run "
                f"{info.config_hash}; the self-ensemble averages one run's rounds. Use another state file or "
                "pass --reset-ensemble"
            )
        state.ids, state.probs, state.counts, state.versions = ids, probs, counts, versions
        state._index = {sid: i for i, sid in enumerate(ids)}
        return state

    def update(self, ids: list[str], probs: np.ndarray, version: str) -> tuple[np.ndarray, np.ndarray]:
        """Fold one model version's probabilities in (Eq. 8); return the mean probabilities and counts for ``ids``."""
        rows = np.array([self._index.get(sid, -1) for sid in ids], dtype=np.int64)
        new = rows < 0
        if new.any():
            start = len(self.ids)
            fresh = [sid for sid, is_new in zip(ids, new) if is_new]
            self.ids.extend(fresh)
            self.versions.extend([""] * len(fresh))
            self._index.update({sid: start + i for i, sid in enumerate(fresh)})
            self.probs = np.concatenate([self.probs, np.zeros((len(fresh), self.probs.shape[1]))])
            self.counts = np.concatenate([self.counts, np.zeros(len(fresh), dtype=np.int64)])
            rows[new] = np.arange(start, start + len(fresh))
        seen = np.array([self.versions[r] == version for r in rows], dtype=bool)
        todo = rows[~seen]
        t = self.counts[todo] + 1
        self.probs[todo] += (probs[~seen].astype(np.float64) - self.probs[todo]) / t[:, None]
        self.counts[todo] = t
        for r in todo:
            self.versions[r] = version
        return self.probs[rows].astype(np.float32), self.counts[rows].copy()

    def save(self, path: str | Path) -> Path:
        """Write atomically (temporary file, then rename)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        meta = json.dumps({"format": STATE_FORMAT, "class_names": self.class_names, "config_hash": self.config_hash})
        fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(
                    fh,
                    meta=np.array(meta),
                    ids=np.array(self.ids, dtype=str),
                    counts=self.counts,
                    probs=self.probs.astype(np.float32),
                    versions=np.array(self.versions, dtype=str),
                )
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return p


# ---------------------------------------------------------------------------------------------
# the job


def label_images(
    model: str | Path,
    source: str | Path,
    out_dir: str | Path,
    *,
    thresholds=None,
    batch_size: int = 256,
    ensemble_state: str | Path | None = None,
    reset_ensemble: bool = False,
    threads: int = 0,
) -> dict:
    """Pseudo-label the images at ``source`` with ``model``; write CSV, JSONL and NPZ to ``out_dir``.

    Image files of any size and mode go through the image rule (:func:`prepare_image`).

    Returns
    -------
    dict
        Summary: counts, mask rate, seconds, images per second, output paths, ``image_shape``
        (C, H, W), and ``prepared``: how many image files the rule resized, rotated, converted
        (empty for a batch).
    """
    labeler = EdgeLabeler(model, threads=threads)
    steps: Counter = Counter()
    ids, images = load_images(source, labeler, steps)
    thr = labeler.thresholds(thresholds)
    res = labeler.predict(images, thresholds, batch_size=batch_size)
    probs, label, conf, mask = res["probs"], res["label"], res["confidence"], res["mask"]
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        in_the_way = next((p for p in (out, *out.parents) if p.exists()), out)
        why = f"{in_the_way} is a file, not a folder" if not in_the_way.is_dir() else exc.strerror
        raise EdgeInputError(f"output folder {out} cannot be created ({why}); pass --out a writable folder") from None
    counts = None
    if ensemble_state is not None:
        state = EnsembleState.load(ensemble_state, labeler.info, reset=reset_ensemble)
        probs, counts = state.update(ids, probs, labeler.info.model_version)
        label = probs.argmax(axis=1).astype(np.int64)
        conf = probs[np.arange(len(label)), label]
        mask = conf >= thr[label]
        state.save(ensemble_state)
    names = labeler.info.class_names
    with _naming(out / "pseudo_labels.csv"), open(out / "pseudo_labels.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        extra = ["ensemble_size"] if counts is not None else []
        writer.writerow(["id", "label", "class_name", "confidence", "mask", *extra])
        for i, sid in enumerate(ids):
            row = [sid, int(label[i]), names[label[i]], f"{float(conf[i]):.6f}", int(mask[i])]
            writer.writerow(row + ([int(counts[i])] if counts is not None else []))
    with _naming(out / "pseudo_labels.jsonl"), open(out / "pseudo_labels.jsonl", "w", encoding="utf-8") as fh:
        for i, sid in enumerate(ids):
            rec = {
                "id": sid,
                "label": int(label[i]),
                "class_name": names[label[i]],
                "confidence": round(float(conf[i]), 6),
                "mask": bool(mask[i]),
                "probs": [round(float(v), 6) for v in probs[i]],
            }
            if counts is not None:
                rec["ensemble_size"] = int(counts[i])
                rec["model_label"] = int(res["label"][i])
                rec["model_confidence"] = round(float(res["confidence"][i]), 6)
            fh.write(json.dumps(rec) + "\n")
    with _naming(out / "pseudo_labels.npz"):
        np.savez(
            out / "pseudo_labels.npz",
            ids=np.array(ids, dtype=str),
            label=label,
            confidence=conf,
            mask=mask,
            probs=probs,
            thresholds=thr,
        )
    seconds = float(res["seconds"])
    n = len(ids)
    return {
        "images": n,
        "passed_threshold": int(mask.sum()),
        "mask_rate": float(mask.mean()) if n else 0.0,
        "seconds": seconds,
        "images_per_second": n / seconds if seconds > 0 else float("inf"),
        "batch_size": labeler.info.batch_size or batch_size,
        "model": str(model),
        "precision": labeler.info.precision,
        "model_version": labeler.info.model_version,
        "ensemble": ensemble_state is not None,
        "prepared": dict(steps),
        "image_shape": list(labeler.info.shape),
        "outputs": [str(out / f"pseudo_labels.{ext}") for ext in ("csv", "jsonl", "npz")],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="edge_label",
        description="Pseudo-label unlabeled images on device "
        "with an exported fedml_ssfl model (numpy + onnxruntime only)",
    )
    parser.add_argument("model", help="model.onnx / model.ort / model.int8.ort from mobile_export")
    parser.add_argument(
        "input",
        help=".npy or .npz batch of uint8 (N, C, H, W) images, or a folder of image files "
        "(any size and mode: resized and converted by the image rule, see prepare_image)",
    )
    parser.add_argument("--out", required=True, help="output directory for pseudo_labels.{csv,jsonl,npz}")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=256,
        help="images per run (default 256); a model "
        "exported with a fixed batch (the .ort files: 1) runs at its own batch size",
    )
    parser.add_argument(
        "--threshold",
        dest="thresholds",
        type=float,
        nargs="+",
        metavar="TAU",
        help="one tau for every class, or one per class (default: the model's own)",
    )
    parser.add_argument(
        "--ensemble-state",
        help="self-ensemble state file (.npz): label from the running mean of "
        "successive model versions' probabilities (FedSEAL Eq. 8)",
    )
    parser.add_argument("--reset-ensemble", action="store_true", help="start the ensemble state afresh")
    parser.add_argument("--threads", type=int, default=0, help="onnxruntime threads (default: its own choice)")
    # image files are always converted by the image rule now; --convert (which asked for it) is still accepted
    parser.add_argument("--convert", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        s = label_images(
            args.model,
            args.input,
            args.out,
            thresholds=args.thresholds,
            batch_size=args.batch_size,
            ensemble_state=args.ensemble_state,
            reset_ensemble=args.reset_ensemble,
            threads=args.threads,
        )
    except EdgeInputError as exc:
        print(f"edge_label: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an output that cannot be written (a full disk), a file that cannot be read
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        fix = "free disk space, or pass --out another folder" if full else "check the path and its permissions"
        print(f"edge_label: error: {exc.filename or ''}: {exc.strerror or exc}; {fix}", file=sys.stderr)
        return 1
    print(
        f"labeled {s['images']} images in {s['seconds']:.3f} s: {s['images_per_second']:.0f} images/s "
        f"({s['precision']} model, batch {s['batch_size']}); {s['passed_threshold']} pass the threshold "
        f"({100 * s['mask_rate']:.1f}%){', self-ensemble' if s['ensemble'] else ''}"
    )
    if s["prepared"]:
        c, h, w = s["image_shape"]
        done = ", ".join(f"{n} {step}" for step, n in sorted(s["prepared"].items()))
        print(f"image rule ({w}x{h}, {channel_order(c)}): {done}")
    print(f"wrote {', '.join(s['outputs'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
