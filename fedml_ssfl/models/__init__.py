"""Model layer: a registry of image classifiers built by name.

Importing this package registers every model (``resnet18``; ``cnn28`` and ``emnist_cnn``;
``wrn28_2`` and ``wrn28_8``; FedMatch's ``resnet9``; FedSiam's ``fedsiam_mnist_cnn`` and
``fedsiam_cifar_cnn``; FedML's ``lr``).

>>> from fedml_ssfl.models import available_models, build_model
>>> {"cnn28", "emnist_cnn", "resnet18"} <= set(available_models())
True
>>> net = build_model("resnet18", num_classes=10, in_channels=3, image_size=32, norm="gn")

Every model takes normalised float images (N, C, H, W) and returns logits (N, num_classes); its
classifier head is whichever layer produces them, found by a forward pass (:func:`classifier_prefix`,
:mod:`~fedml_ssfl.models.head`), whatever its name.
"""

from __future__ import annotations

from . import cnn, fedsiam_cnn, linear, resnet, resnet9, wrn  # noqa: F401  (imported for their @register_model side effects)
from .norm import NORM_KINDS, make_norm
from .registry import (
    ModelSpec,
    available_models,
    build_model,
    classifier_prefix,
    count_parameters,
    model_spec,
    register_model,
)

__all__ = [
    "NORM_KINDS",
    "ModelSpec",
    "available_models",
    "build_model",
    "classifier_prefix",
    "count_parameters",
    "make_norm",
    "model_spec",
    "register_model",
]
