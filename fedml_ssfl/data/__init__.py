"""Data layer: in-memory image datasets, server/client splits and batched augmentation.

The names below load their module on first use (PEP 562), so importing a light submodule such
as :mod:`fedml_ssfl.data.partition_methods` (config.py does) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "normalize": "augment",
    "strong_augment": "augment",
    "to_float": "augment",
    "weak_augment": "augment",
    "ImageDataset": "datasets",
    "available_datasets": "datasets",
    "dataset_description": "datasets",
    "load_dataset": "datasets",
    "register_dataset": "datasets",
    "DataFormatError": "local_files",
    "LocalImages": "local_files",
    "read_image_folder": "local_files",
    "read_local_images": "local_files",
    "read_npz": "local_files",
    "write_npz": "local_files",
    "Split": "partition",
    "build_split": "partition",
    "non_iid_level": "partition",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
