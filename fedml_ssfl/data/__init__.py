"""Data layer: in-memory image datasets, server/client splits and batched augmentation."""

from fedml_ssfl.data.augment import normalize, strong_augment, to_float, weak_augment
from fedml_ssfl.data.datasets import ImageDataset, available_datasets, load_dataset
from fedml_ssfl.data.partition import Split, build_split, non_iid_level

__all__ = [
    "ImageDataset",
    "Split",
    "available_datasets",
    "build_split",
    "load_dataset",
    "non_iid_level",
    "normalize",
    "strong_augment",
    "to_float",
    "weak_augment",
]
