"""Data layer: in-memory image datasets, server/client splits and batched augmentation."""

from fedml_ssfl.data.augment import normalize, strong_augment, to_float, weak_augment
from fedml_ssfl.data.datasets import ImageDataset, available_datasets, load_dataset, register_dataset
from fedml_ssfl.data.local_files import (
    DataFormatError,
    LocalImages,
    read_image_folder,
    read_local_images,
    read_npz,
    write_npz,
)
from fedml_ssfl.data.partition import Split, build_split, non_iid_level

__all__ = [
    "DataFormatError",
    "ImageDataset",
    "LocalImages",
    "Split",
    "available_datasets",
    "build_split",
    "load_dataset",
    "non_iid_level",
    "normalize",
    "read_image_folder",
    "read_local_images",
    "read_npz",
    "register_dataset",
    "strong_augment",
    "to_float",
    "weak_augment",
    "write_npz",
]
