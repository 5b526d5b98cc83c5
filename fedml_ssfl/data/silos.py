"""Deployment mode's data: each process reads only its own files.

In a real cross-silo deployment silo k's data exists only on silo k's machine and the server has
only its own labeled set. This module reads those files and writes them from a simulation split:

* :func:`silo_path` resolves ``data_args.local_data`` for a rank (``{rank}`` / ``{silo}``
  placeholders, so one YAML serves every rank under mpirun);
* :func:`load_server_dataset` reads the server's labeled set, its validation set and the test set
  (never a silo's file) into an :class:`~fedml_ssfl.data.ImageDataset` whose training part is the
  server's labeled samples followed by its validation samples, and :func:`server_split` the
  matching :class:`~fedml_ssfl.data.Split` (no client holds anything on the server);
* :func:`load_silo` reads one silo's file and :func:`check_silo` checks it against the server's
  metadata (class count, channels, image size), naming the silo on any mismatch;
* :func:`export_split` materialises a simulation split as one npz file per silo plus the server's
  files, in exactly the order the simulator indexes them, so that a deployment run on them ends
  with the simulator's model.

A silo's file is an npz or an image folder (:mod:`fedml_ssfl.data.local_files`): label -1 marks an
unlabeled sample; labeled samples (labels-at-client) carry their class index.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fedml_ssfl.data.datasets import ImageDataset, _channel_stats
from fedml_ssfl.data.local_files import LocalImages, class_count, read_local_images, write_npz
from fedml_ssfl.data.partition import Split


class SiloDataError(ValueError):
    """A silo's or the server's data does not fit the run (names the file and the fix)."""


def silo_path(template: str, rank: int) -> Path:
    """``data_args.local_data`` for ``rank`` (1..K): ``{rank}`` becomes the rank, ``{silo}`` rank - 1.

    Raises
    ------
    SiloDataError
        An empty template, or a placeholder other than ``{rank}`` / ``{silo}``.
    """
    if not template:
        raise SiloDataError(
            "data_args.local_data is empty: in deployment mode every silo reads its own data from it "
            "(an npz file or an image folder; {rank} / {silo} placeholders allowed)"
        )
    try:
        return Path(template.format(rank=rank, silo=rank - 1)).expanduser()
    except (KeyError, IndexError, ValueError) as exc:
        raise SiloDataError(
            f"data_args.local_data {template!r}: only the placeholders {{rank}} and {{silo}} are allowed ({exc})"
        ) from exc


@dataclass
class SiloMeta:
    """What the server tells every silo at start-up, and what a silo's data must agree with."""

    num_classes: int
    class_names: list[str]
    in_channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    flip: bool

    @classmethod
    def of(cls, dataset: ImageDataset) -> SiloMeta:
        return cls(
            num_classes=dataset.num_classes,
            class_names=list(dataset.class_names),
            in_channels=dataset.in_channels,
            image_size=dataset.image_size,
            mean=tuple(float(v) for v in dataset.mean),
            std=tuple(float(v) for v in dataset.std),
            flip=bool(dataset.flip),
        )


def _read(path: str, what: str, key: str, class_names: list[str] | None = None, num_classes: int | None = None):
    if not path:
        raise SiloDataError(f"data_args.{key} is empty: deployment mode reads {what} from it (an npz or a folder)")
    try:
        return read_local_images(Path(path).expanduser(), class_names=class_names, num_classes=num_classes)
    except (OSError, ValueError) as exc:
        raise SiloDataError(f"data_args.{key} ({what}): {exc}") from exc


def _all_labeled(data: LocalImages, key: str) -> None:
    if bool((data.labels < 0).any()):
        n = int((data.labels < 0).sum())
        raise SiloDataError(
            f"data_args.{key} {data.source}: {n} sample(s) carry no label (-1); the server's labeled, validation "
            "and test sets must all be labeled"
        )


def load_server_dataset(
    server_data: str,
    test_data: str,
    server_val_data: str = "",
    num_classes: int = 0,
    mean: list[float] | tuple[float, ...] = (),
    std: list[float] | tuple[float, ...] = (),
    flip: bool = False,
    name: str = "deployment",
) -> ImageDataset:
    """The server's own data: its labeled set (+ validation set) as the training part, and the test set.

    Parameters
    ----------
    server_data, test_data, server_val_data : str
        Paths (npz or image folder) of ``data_args.server_data``, ``test_data`` and the optional
        ``server_val_data``.
    num_classes : int
        The class count; 0 takes it from the data: its class names, else the number of distinct labels
        (which must then number the classes ``0..d-1``; a label of 10**9 is refused, not made 10**9 classes).
    mean, std : sequence of float
        Per-channel normalisation; empty computes it from the server's labeled images.
    flip : bool
        Whether horizontal flips suit the data (``data_args.flip``).

    Returns
    -------
    ImageDataset
        Train = the labeled samples followed by the ``num_server_val`` validation samples.
    """
    labeled = _read(server_data, "the server's labeled set", "server_data", num_classes=num_classes or None)
    _all_labeled(labeled, "server_data")
    names = labeled.class_names
    if num_classes == 0:
        try:
            num_classes = len(names) if names else class_count(labeled.labels, labeled.source)
        except ValueError as exc:
            raise SiloDataError(f"data_args.server_data: {exc}; or set data_args.num_classes") from exc
    names = list(names) if names else [str(c) for c in range(num_classes)]
    if len(names) != num_classes:
        raise SiloDataError(
            f"data_args.num_classes {num_classes} disagrees with the {len(names)} class names of {labeled.source}"
        )
    parts = [labeled]
    if server_val_data:
        val = _read(server_val_data, "the server's validation set", "server_val_data", names, num_classes)
        _all_labeled(val, "server_val_data")
        parts.append(val)
    test = _read(test_data, "the test set", "test_data", names, num_classes)
    _all_labeled(test, "test_data")
    for part in [*parts[1:], test]:
        if part.images.shape[1:] != labeled.images.shape[1:]:
            raise SiloDataError(
                f"{part.source} holds images of shape {tuple(part.images.shape[1:])}, but {labeled.source} "
                f"{tuple(labeled.images.shape[1:])}: every file of a run needs the same channels and size"
            )
    if labeled.images.shape[2] != labeled.images.shape[3]:
        raise SiloDataError(f"{labeled.source}: images must be square, got {tuple(labeled.images.shape[2:])}")
    train_images = torch.cat([p.images for p in parts])
    if not mean or not std:
        mean, std = _channel_stats(labeled.images)
    channels = int(labeled.images.shape[1])
    if len(mean) != channels or len(std) != channels:
        raise SiloDataError(
            f"data_args.norm_mean / norm_std need one value per channel ({channels}), got {list(mean)} / {list(std)}"
        )
    dataset = ImageDataset(
        name=name,
        train_images=train_images.contiguous(),
        train_labels=torch.cat([p.labels for p in parts]),
        test_images=test.images,
        test_labels=test.labels,
        num_classes=num_classes,
        class_names=names,
        mean=tuple(float(v) for v in mean),
        std=tuple(float(v) for v in std),
        flip=flip,
        num_server_val=len(parts[1].labels) if len(parts) > 1 else 0,
    )
    return dataset


def server_split(dataset: ImageDataset, num_clients: int, scenario: str) -> Split:
    """The split the server sees in deployment mode: its labeled and validation samples, no client data."""
    n_val = dataset.num_server_val
    n_labeled = len(dataset.train_labels) - n_val
    empty = torch.zeros(0, dtype=torch.long)
    return Split(
        server_labeled=torch.arange(n_labeled),
        server_val=torch.arange(n_labeled, n_labeled + n_val),
        client_unlabeled=[empty] * num_clients,
        client_labeled=[empty] * num_clients,
        num_classes=dataset.num_classes,
        method="deployment",
        scenario=scenario,
    )


def load_silo(path: Path, meta: SiloMeta) -> LocalImages:
    """One silo's own data, checked against the server's metadata (see :func:`check_silo`)."""
    try:
        data = read_local_images(path, class_names=meta.class_names, num_classes=meta.num_classes)
    except (OSError, ValueError) as exc:
        raise SiloDataError(f"data_args.local_data: {exc}") from exc
    check_silo(data, meta)
    return data


def check_silo(data: LocalImages, meta: SiloMeta) -> None:
    """Refuse a silo's data that does not fit the server's metadata, naming the file and what differs."""
    _, c, h, w = data.images.shape
    if c != meta.in_channels or h != meta.image_size or w != meta.image_size:
        raise SiloDataError(
            f"{data.source} holds {c}x{h}x{w} images, but the server's data is "
            f"{meta.in_channels}x{meta.image_size}x{meta.image_size} (channels x height x width): convert this "
            "silo's images to the server's shape"
        )
    labels = data.labels
    if labels.numel() and (int(labels.max()) >= meta.num_classes or int(labels.min()) < -1):
        raise SiloDataError(
            f"{data.source} has labels outside -1..{meta.num_classes - 1} (the server's {meta.num_classes} classes; "
            "-1 marks an unlabeled sample)"
        )


def silo_indices(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unlabeled, labeled) positions of a silo's samples: label -1 is unlabeled."""
    unlabeled = torch.nonzero(labels < 0).reshape(-1)
    labeled = torch.nonzero(labels >= 0).reshape(-1)
    return unlabeled, labeled


def export_split(dataset: ImageDataset, split: Split, out_dir: str | Path) -> dict[str, Path | list[Path]]:
    """Write a simulation split as deployment files: one npz per silo plus the server's and the test set.

    Silo k's file (``silo_{k}.npz``) holds its unlabeled samples (label -1, in the order of
    ``split.client_unlabeled[k]``) followed by its labeled ones (labels-at-client), with each
    sample's index in the training set as its id; ``server.npz`` the server's labeled samples in
    the order of ``split.server_labeled``, ``server_val.npz`` its validation samples (when there
    are any) and ``test.npz`` the test set, each with the class names. A deployment run on these
    files sees exactly the batches the simulator draws for the same seed.

    Raises
    ------
    SiloDataError
        For a streaming split (its stages are not part of the file format).
    """
    if split.streaming:
        raise SiloDataError(
            "data_args.partition_method streaming_noniid: a streaming split cannot be exported for deployment (the "
            "silo files carry no stages); export a batch split"
        )
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    names = list(dataset.class_names)
    images, labels = dataset.train_images, dataset.train_labels
    silos = []
    for k in range(split.num_clients):
        unl, lab = split.client_unlabeled[k], split.client_labeled[k]
        idx = torch.cat([unl, lab])
        silo_labels = torch.cat([torch.full((unl.numel(),), -1, dtype=torch.long), labels[lab]])
        path = out / f"silo_{k}.npz"
        write_npz(path, images[idx], silo_labels, ids=[str(int(i)) for i in idx], class_names=names)
        silos.append(path)
    files: dict[str, Path | list[Path]] = {"silos": silos}
    files["server_data"] = out / "server.npz"
    srv = split.server_labeled
    write_npz(files["server_data"], images[srv], labels[srv], ids=[str(int(i)) for i in srv], class_names=names)
    if split.server_val.numel():
        files["server_val_data"] = out / "server_val.npz"
        val = split.server_val
        write_npz(files["server_val_data"], images[val], labels[val], ids=[str(int(i)) for i in val], class_names=names)
    files["test_data"] = out / "test.npz"
    write_npz(files["test_data"], dataset.test_images, dataset.test_labels, class_names=names)
    return files
