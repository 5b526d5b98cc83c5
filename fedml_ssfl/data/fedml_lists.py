"""FedML's dataset list: what ``fedml.data.load(args)`` returns and a FedML script hands to ``FedMLRunner``.

FedML's loaders return eight entries (FedML 0.9.6, ``fedml/data/data_loader.py``; the cross-silo
``FedMLCrossSiloServer`` / ``FedMLCrossSiloClient`` unpack them in this order)::

    [train_data_num, test_data_num, train_data_global, test_data_global,
     train_data_local_num_dict, train_data_local_dict, test_data_local_dict, class_num]

``train_data_global`` / ``test_data_global`` are loaders of the whole training / test set,
``train_data_local_dict[k]`` (a dict, or a list, indexed by silo) silo k's training loader. A
loader is a ``torch.utils.data.DataLoader``, a list of ``(x, y)`` batches (FedML's own MNIST
loader) or any iterable of them. This module reads them into the package's uint8 images:

* :func:`read_loader`: every sample of a loader, in the order of its dataset (a ``DataLoader``'s
  ``dataset`` is read by index, so a shuffling loader gives the same order every time), without
  touching torch's random streams. ``x`` may be uint8 pixels, or floats in ``[0, 1]`` (what
  ``ToTensor`` gives: ``round(255 x)`` restores the bytes exactly); normalised floats are refused,
  since the algorithms normalise and augment images themselves. Images are ``(C, H, W)``, ``(H, W)``
  or flat vectors of ``s * s`` or ``3 * s * s`` values (FedML's MNIST ``lr`` data: 784 values per
  image), square;
* :func:`server_dataset`: the server's own data. Its labeled set is ``data_args.num_server_labels``
  samples of ``train_data_global`` drawn balanced over the classes with the run seed
  (:func:`~fedml_ssfl.data.partition.server_sets`, the simulator's first step), then
  ``num_server_val`` more as its validation set; the test set is ``test_data_global``;
* :func:`silo_data`: silo k's own data, ``train_data_local_dict[k]``, with the labels the algorithm
  may see. Labels-at-server: every label is hidden (set to -1) before the algorithm gets the data,
  so nothing of them is read or sent. Labels-at-client: a sample whose label is -1 in the list is
  unlabeled; when the list labels every sample, the silo keeps the labels of
  ``data_args.client_label_ratio`` of its samples (stratified by class; else
  ``labels_per_class_client`` per class), drawn with ``numpy_rng(seed, "silo", k)``, and hides the
  rest.

No FedML import: the lists are plain Python and torch objects.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..seeding import numpy_rng
from .datasets import ImageDataset, _channel_stats
from .local_files import LocalImages
from .partition import client_label_share, server_sets

FIELDS = (
    "train_data_num",
    "test_data_num",
    "train_data_global",
    "test_data_global",
    "train_data_local_num_dict",
    "train_data_local_dict",
    "test_data_local_dict",
    "class_num",
)
"""The eight entries of FedML's dataset list, in order."""

SCRIPT_DATASET_NAME = "script_data"
"""``data_args.dataset`` of a run on a script's list when the config names none (never a shipped dataset's name)."""


def fields(dataset: Any) -> dict[str, Any]:
    """FedML's dataset list as a dict of its eight named entries.

    Raises
    ------
    ConfigError
        ``dataset`` is not a list or tuple of eight entries (names the layout).
    """
    if not isinstance(dataset, (list, tuple)) or len(dataset) != len(FIELDS):
        got = f"a {type(dataset).__name__} of {len(dataset)}" if isinstance(dataset, (list, tuple)) else repr(dataset)
        raise ConfigError(
            f"the dataset passed to FedMLRunner must be FedML's list of 8 entries [{', '.join(FIELDS)}] (what "
            f"fedml.data.load returns), got {got}"
        )
    return dict(zip(FIELDS, dataset))


@dataclass
class LoaderImages:
    """Every sample of one loader: uint8 images ``(N, C, s, s)``, int64 labels, the shape ``x`` had."""

    images: torch.Tensor
    labels: torch.Tensor
    sample_shape: tuple[int, ...]
    class_names: list[str] | None


def _batches(loader: Any, where: str) -> Iterable[tuple[Any, Any]]:
    dataset = getattr(loader, "dataset", None)
    if isinstance(loader, torch.utils.data.DataLoader) and isinstance(dataset, torch.utils.data.TensorDataset):
        if len(dataset.tensors) != 2:
            raise ConfigError(f"{where}: its TensorDataset holds {len(dataset.tensors)} tensors; expected (x, y)")
        return [tuple(dataset.tensors)]
    if (
        isinstance(loader, torch.utils.data.DataLoader)
        and hasattr(dataset, "__getitem__")
        and hasattr(dataset, "__len__")
    ):
        return (([item[0] for item in chunk], [item[1] for item in chunk]) for chunk in _chunks(dataset))
    if isinstance(loader, (str, bytes, Mapping)) or not isinstance(loader, Iterable):
        raise ConfigError(
            f"{where}: expected a loader of (x, y) batches (a torch DataLoader or a list of (x, y) pairs), "
            f"got {type(loader).__name__}"
        )
    return loader


def _chunks(dataset: Any, size: int = 512):
    n = len(dataset)
    for start in range(0, n, size):
        yield [dataset[i] for i in range(start, min(n, start + size))]


def _as_tensor(value: Any, where: str, what: str) -> torch.Tensor:
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return torch.stack([torch.as_tensor(v) for v in value])
    try:
        return torch.as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: its {what} are not numbers ({exc})") from None


def _to_uint8(x: torch.Tensor, where: str) -> torch.Tensor:
    """Pixels as uint8: uint8 kept, integers 0..255 cast, floats in [0, 1] scaled by 255 and rounded."""
    if x.dtype == torch.uint8:
        return x
    if x.dtype == torch.bool or x.is_complex():
        raise ConfigError(f"{where}: its images are {x.dtype}; give uint8 pixels or floats in [0, 1]")
    if not x.is_floating_point():
        if x.numel() and (int(x.min()) < 0 or int(x.max()) > 255):
            raise ConfigError(f"{where}: its integer pixels lie outside 0..255; give uint8 pixels or floats in [0, 1]")
        return x.to(torch.uint8)
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ConfigError(f"{where}: its images hold NaN or infinite values")
    low, high = (float(x.min()), float(x.max())) if x.numel() else (0.0, 1.0)
    if low < -1e-6 or high > 1.0 + 1e-6:
        raise ConfigError(
            f"{where}: its float images lie in [{low:.3g}, {high:.3g}], not [0, 1]: they look normalised; give the "
            "images before Normalize (ToTensor's output, or uint8 pixels): the algorithms normalise them themselves "
            "(data_args.norm_mean / norm_std, else measured on the server's data) and augment them"
        )
    return torch.round(x.to(torch.float64) * 255.0).clamp_(0, 255).to(torch.uint8)


def _as_images(x: torch.Tensor, where: str) -> torch.Tensor:
    """``(N, ...)`` samples as ``(N, C, s, s)`` images (see the module docstring for the shapes taken)."""
    n = x.shape[0]
    if x.dim() == 2:  # flat vectors: s * s (grey) or 3 * s * s values
        d = x.shape[1]
        for c in (1, 3):
            s = math.isqrt(d // c) if d % c == 0 else 0
            if s and c * s * s == d:
                return x.reshape(n, c, s, s)
        raise ConfigError(
            f"{where}: its samples are vectors of {d} values, which is not an image of s x s (or 3 x s x s) pixels; "
            "give images (C, H, W)"
        )
    if x.dim() == 3:
        x = x.unsqueeze(1)
    if x.dim() != 4:
        raise ConfigError(f"{where}: its samples have shape {tuple(x.shape[1:])}; expected images (C, H, W)")
    if x.shape[1] not in (1, 3) and x.shape[3] in (1, 3):
        x = x.permute(0, 3, 1, 2)  # (N, H, W, C)
    if x.shape[1] not in (1, 3):
        raise ConfigError(f"{where}: its images have {x.shape[1]} channels; expected 1 (grey) or 3 (RGB)")
    if x.shape[2] != x.shape[3]:
        raise ConfigError(f"{where}: its images are {x.shape[2]}x{x.shape[3]}; the models here take square images")
    return x


def read_loader(loader: Any, where: str) -> LoaderImages:
    """Every ``(x, y)`` sample of ``loader`` as uint8 images and int64 labels (-1: unlabeled).

    Parameters
    ----------
    loader : DataLoader, list of (x, y) batches, or an iterable of them
        One entry of FedML's list.
    where : str
        How to name it in errors (``"train_data_local_dict[1]"``).

    Raises
    ------
    ConfigError
        Empty, not a loader, samples that are not images, normalised floats, labels that are not
        one integer per sample (names ``where`` and the fix).
    """
    images, labels, shape = [], [], None
    with torch.random.fork_rng(devices=[]):  # a dataset's transforms must not move the run's streams
        for batch in _batches(loader, where):
            if not isinstance(batch, (list, tuple)) or len(batch) != 2:
                raise ConfigError(f"{where}: expected (x, y) batches, got {type(batch).__name__}")
            x, y = _as_tensor(batch[0], where, "images"), _as_tensor(batch[1], where, "labels")
            if y.dim() == 0:  # a dataset of single samples read by index
                x, y = x.unsqueeze(0), y.unsqueeze(0)
            if y.dim() != 1 or y.shape[0] != x.shape[0] or y.is_floating_point() or y.dtype == torch.bool:
                raise ConfigError(f"{where}: expected one integer class label per sample, got labels {tuple(y.shape)}")
            if shape is None:
                shape = tuple(x.shape[1:])
            elif tuple(x.shape[1:]) != shape:
                raise ConfigError(
                    f"{where}: its samples have shapes {shape} and {tuple(x.shape[1:])}; give them one shape"
                )
            images.append(_as_images(_to_uint8(x, where), where))
            labels.append(y.to(torch.int64))
    if not images or sum(len(y) for y in labels) == 0:
        raise ConfigError(f"{where}: it holds no samples")
    names = getattr(getattr(loader, "dataset", None), "classes", None)
    names = list(names) if isinstance(names, (list, tuple)) and all(isinstance(c, str) for c in names) else None
    return LoaderImages(torch.cat(images).contiguous(), torch.cat(labels), shape, names)


def class_count(data: dict[str, Any], seen: list[LoaderImages]) -> int:
    """The class count: the list's ``class_num`` when given, else one more than the largest label seen.

    Raises
    ------
    ConfigError
        ``class_num`` is not a positive integer, or a label lies outside ``-1 .. class_num - 1``.
    """
    num = data["class_num"]
    top = max((int(d.labels.max()) for d in seen if d.labels.numel()), default=-1)
    if num is None or num == 0:
        num = top + 1
    if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or num < 1:
        raise ConfigError(f"class_num (the list's last entry) must be a positive number of classes, got {num!r}")
    low = min((int(d.labels.min()) for d in seen if d.labels.numel()), default=0)
    if top >= num or low < -1:
        raise ConfigError(
            f"the dataset list's labels lie in {low}..{top}, outside 0..{num - 1} for class_num {num} (-1 marks an "
            "unlabeled sample)"
        )
    return int(num)


def server_dataset(
    dataset: Any,
    *,
    num_server_labels: int,
    num_server_val: int,
    seed: int,
    mean: list[float] | tuple[float, ...] = (),
    std: list[float] | tuple[float, ...] = (),
    flip: bool = False,
    name: str = SCRIPT_DATASET_NAME,
) -> tuple[ImageDataset, tuple[int, ...]]:
    """The server's data from FedML's list: labeled (+ validation) samples of ``train_data_global``, the test set.

    Returns
    -------
    tuple
        The :class:`ImageDataset` (train = the labeled samples, then the validation samples; test =
        ``test_data_global``; mean / std as given, else measured on every image of
        ``train_data_global``, or of the test set when there is none) and the shape of one sample
        as the list gives it.

    Raises
    ------
    ConfigError
        A malformed list or loader, no test set, no global training set while the server needs
        labels, or too few samples of a class for the server's share.
    """
    data = fields(dataset)
    if data["test_data_global"] is None:
        raise ConfigError(
            "test_data_global (entry 4 of the dataset list) is None: the server evaluates the model on it"
        )
    test = read_loader(data["test_data_global"], "test_data_global")
    need = num_server_labels + num_server_val
    train = None
    if data["train_data_global"] is not None:
        train = read_loader(data["train_data_global"], "train_data_global")
    elif need:
        raise ConfigError(
            "train_data_global (entry 3 of the dataset list) is None, but the server draws data_args."
            f"num_server_labels ({num_server_labels}) + num_server_val ({num_server_val}) labeled samples from it; "
            "pass the server's training data there, or set both to 0 (labels-at-client)"
        )
    parts = [d for d in (train, test) if d is not None]
    if train is not None and train.images.shape[1:] != test.images.shape[1:]:
        raise ConfigError(
            f"train_data_global holds images {tuple(train.images.shape[1:])}, test_data_global "
            f"{tuple(test.images.shape[1:])}: every loader of a run needs the same shape"
        )
    num_classes = class_count(data, parts)
    if (test.labels < 0).any():
        raise ConfigError("test_data_global: every test sample needs its label (some are -1)")
    labeled = val = np.zeros(0, dtype=np.int64)
    if need:
        y = train.labels.numpy()
        known = np.flatnonzero(y >= 0)
        try:
            rng = numpy_rng(seed, "partition")
            labeled, val, _ = server_sets(y[known], num_classes, num_server_labels, num_server_val, rng)
        except ValueError as exc:
            raise ConfigError(f"train_data_global: {exc}") from None
        labeled, val = known[np.sort(labeled)], known[np.sort(val)]
    chosen = torch.from_numpy(np.concatenate([labeled, val]).astype(np.int64))
    source = train if train is not None else test
    if not mean or not std:
        mean, std = _channel_stats(source.images)
    channels = int(source.images.shape[1])
    if len(mean) != channels or len(std) != channels:
        raise ConfigError(
            f"data_args.norm_mean / norm_std need one value per channel of the script's images ({channels}), got "
            f"{list(mean)} / {list(std)}; give {channels} value(s) each, or leave both out to measure them"
        )
    names = next((d.class_names for d in parts if d.class_names and len(d.class_names) == num_classes), None)
    empty = test.images[:0]
    server = ImageDataset(
        name=name,
        train_images=train.images[chosen].contiguous() if train is not None else empty,
        train_labels=train.labels[chosen] if train is not None else test.labels[:0],
        test_images=test.images,
        test_labels=test.labels,
        num_classes=num_classes,
        class_names=names or [str(c) for c in range(num_classes)],
        mean=tuple(float(v) for v in mean),
        std=tuple(float(v) for v in std),
        flip=flip,
        num_server_val=len(val),
    )
    return server, test.sample_shape


def silo_data(
    dataset: Any,
    silo: int,
    *,
    scenario: str,
    num_classes: int,
    seed: int,
    client_label_ratio: float = 0.0,
    labels_per_class_client: int = 0,
) -> tuple[LocalImages, tuple[int, ...]]:
    """Silo ``silo``'s own data from FedML's list, its labels hidden as the scenario says (module docstring).

    Returns
    -------
    tuple
        The silo's :class:`~fedml_ssfl.data.local_files.LocalImages` (labels -1 where hidden) and the
        shape of one sample as the list gives it.

    Raises
    ------
    ConfigError
        No entry for ``silo`` in ``train_data_local_dict``, a malformed loader, labels outside the
        classes.
    """
    data = fields(dataset)
    local = data["train_data_local_dict"]
    where = f"train_data_local_dict[{silo}]"
    try:
        loader = local[silo]
    except (KeyError, IndexError, TypeError):
        have = sorted(local) if isinstance(local, Mapping) else f"{len(local)} entries" if local is not None else "None"
        raise ConfigError(
            f"{where} is missing (the list has {have}): under FedMLRunner rank k + 1 trains silo k, the entry k of "
            "train_data_local_dict (entry 6 of the dataset list) in its own process"
        ) from None
    read = read_loader(loader, where)
    labels = read.labels.clone()
    if labels.numel() and (int(labels.max()) >= num_classes or int(labels.min()) < -1):
        raise ConfigError(f"{where}: labels outside -1..{num_classes - 1} (the server's {num_classes} classes)")
    if scenario == "server":
        labels.fill_(-1)  # labels-at-server: the silo's labels never reach the algorithm
    elif not bool((labels < 0).any()):  # labels-at-client, every sample labeled: keep the configured share
        y = labels.numpy()
        _, hidden = client_label_share(
            y, num_classes, client_label_ratio, labels_per_class_client, numpy_rng(seed, "silo", silo)
        )
        labels[torch.from_numpy(np.sort(hidden))] = -1
    images = LocalImages(images=read.images, labels=labels, ids=None, class_names=read.class_names, source=where)
    return images, read.sample_shape
