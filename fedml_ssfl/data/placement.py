"""``device_args.data_on_device``: a run's uint8 images kept on the training device (issue 15).

By default the images stay in host memory and every batch is indexed there and copied to the
device (:meth:`fedml_ssfl.training.InputPipeline.raw`), augmentation then running on the device.
With the key set, the training and test images are copied to the device once when the experiment
is built; every batch is then indexed on the device (the index tensors stay on the CPU, where the
seeded batch streams draw them) and no image crosses the bus again. The values are the same uint8
images, so results do not change; on a CPU nothing moves. Labels stay in host memory (a batch's
labels are a few hundred bytes).
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import ConfigError
from .datasets import ImageDataset

MAX_SHARE_OF_FREE = 0.5
"""The most of the device's free memory the images may take: the rest is for the models, their
activations and the augmentation's work tensors."""


def free_device_bytes(device: torch.device) -> int | None:
    """Free bytes on a CUDA device; None for a device whose memory is not counted (CPU, meta)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def check_fits(nbytes: int, free: int | None, device: torch.device) -> None:
    """Refuse images that would take more than :data:`MAX_SHARE_OF_FREE` of ``free`` bytes.

    Raises
    ------
    ConfigError
        Naming the key, the sizes and the fix.
    """
    if free is not None and nbytes > MAX_SHARE_OF_FREE * free:
        raise ConfigError(
            f"device_args.data_on_device: the images take {nbytes / 2**20:.0f} MiB, more than half of the "
            f"{free / 2**20:.0f} MiB free on {device}; set it to false (each batch is then copied to the device "
            "when it is drawn)"
        )


def place_images(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``images`` on ``device`` (the same tensor where it is already there), after :func:`check_fits`."""
    if images.device == device:
        return images
    check_fits(images.numel() * images.element_size(), free_device_bytes(device), device)
    return images.to(device)


def place_dataset(dataset: ImageDataset, device: torch.device) -> ImageDataset:
    """A copy of ``dataset`` whose training and test images live on ``device``.

    ``dataset`` itself is left as it is (a process keeps the shipped datasets it loaded for later
    runs, which may train elsewhere); where the images are already on ``device`` it is returned.
    """
    if dataset.train_images.device == device and dataset.test_images.device == device:
        return dataset
    nbytes = sum(t.numel() * t.element_size() for t in (dataset.train_images, dataset.test_images))
    check_fits(nbytes, free_device_bytes(device), device)
    return dataclasses.replace(
        dataset, train_images=dataset.train_images.to(device), test_images=dataset.test_images.to(device)
    )
