"""What an algorithm needs to know about a model beyond "images in, class logits out": its head.

Any :class:`torch.nn.Module` that maps normalised float images ``(N, C, H, W)`` to logits
``(N, num_classes)`` can be trained here, registered (:func:`~fedml_ssfl.models.register_model`) or
handed over by a FedML script. Nothing depends on layer names:

* the **classifier head** is found by running the model once on a small batch of zeros (eval
  mode, no gradient, torch's random streams untouched) and recording which modules with
  parameters of their own produce a tensor of the logits' shape: the last of them is the head,
  whatever it is called (:func:`find_classifier`). Zhang et al.'s weight diversity of the
  classifier layer is measured over its parameters;
* FedSiam's layers are the model's state-dict keys grouped by module, and FedMatch splits every
  trainable parameter into ``sigma + psi``: both hold for any module with parameters.

:func:`check_classifier` refuses, with one line naming what is missing, a module that does not
return logits of the expected shape or has no trainable parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError

PROBE_BATCH = 2
"""Samples in the batch of zeros a model is probed with (2: BatchNorm in train mode needs more than one)."""


def _probe_input(model: nn.Module, in_channels: int, image_size: int) -> torch.Tensor:
    ref = next((p for p in model.parameters()), None)
    device = ref.device if ref is not None else torch.device("cpu")
    return torch.zeros(PROBE_BATCH, in_channels, image_size, image_size, device=device)


def probe(model: nn.Module, in_channels: int, image_size: int) -> tuple[torch.Tensor, list[tuple[str, torch.Size]]]:
    """Run ``model`` once on zeros ``(2, C, s, s)``: its output, and (name, output shape) of every module
    with parameters of its own, in the order they ran.

    The model runs in eval mode without gradient under a forked random stream, so neither its
    BatchNorm statistics nor torch's global generator change; its training flag is restored.

    Raises
    ------
    Exception
        Whatever the model's forward raises on such a batch.
    """
    calls: list[tuple[str, torch.Size]] = []
    handles = []
    for name, module in model.named_modules():
        if name and any(True for _ in module.parameters(recurse=False)):

            def record(_m, _inputs, output, name=name):
                if isinstance(output, torch.Tensor):
                    calls.append((name, output.shape))

            handles.append(module.register_forward_hook(record))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = model(_probe_input(model, in_channels, image_size))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return out, calls


def find_classifier(model: nn.Module, in_channels: int, image_size: int) -> str | None:
    """State-dict prefix of the layer that produces ``model``'s logits, found by running it (no naming rule).

    The head is the last module with parameters of its own whose output has the shape of the
    model's output ``(N, num_classes)``: ``"fc"`` for ``cnn28``, ``"head.2"`` for a head written as
    ``self.head = nn.Sequential(nn.ReLU(), nn.Dropout(), nn.Linear(...))``. Its keys are those
    starting with ``prefix + "."``.

    Returns
    -------
    str or None
        The prefix, or None when the output is not a 2-D tensor or no such module ran.
    """
    out, calls = probe(model, in_channels, image_size)
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        return None
    heads = [name for name, shape in calls if shape == out.shape]
    return heads[-1] if heads else None


def check_classifier(model: nn.Module, num_classes: int, in_channels: int, image_size: int, what: str) -> str:
    """Refuse a model an algorithm cannot train; return its head's prefix (:func:`find_classifier`).

    Parameters
    ----------
    model : nn.Module
        The model.
    num_classes, in_channels, image_size : int
        What the data holds.
    what : str
        How the model is named in messages (``"model 'cnn28'"``, ``"the script's model MyNet"``).

    Raises
    ------
    ConfigError
        One line naming what is missing: the forward fails on images of the data's shape, the
        output is not ``(N, num_classes)`` logits, no layer with parameters produces them, or the
        model has no trainable parameter.
    """
    shape = f"({PROBE_BATCH}, {in_channels}, {image_size}, {image_size})"
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{what} has no trainable parameter: the algorithms train a model's parameters")
    try:
        out, calls = probe(model, in_channels, image_size)
    except Exception as exc:  # the model's own error, on the data's shape
        raise ConfigError(
            f"{what} fails on a batch of images shaped like the data {shape}: {type(exc).__name__}: {exc}; "
            "it must take normalised float images (N, C, H, W)"
        ) from exc
    want = (PROBE_BATCH, num_classes)
    if isinstance(out, (tuple, list, dict)):
        name = "a dict" if isinstance(out, dict) else f"a {type(out).__name__} of {len(out)}"
        keys = f" (keys: {', '.join(map(repr, out))})" if isinstance(out, dict) else ""
        raise ConfigError(
            f"{what} returns {name}{keys} for images {shape}; the algorithms need class logits {want}: say which "
            "output they are with model_args.logits (their position in the tuple, e.g. 0, or their key in the dict, "
            "e.g. logits)"
        )
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or not out.is_floating_point():
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"{what} returns {got} for images {shape}; the algorithms need class logits {want}: one float "
            f"per class of the data's {num_classes}, before any softmax"
        )
    heads = [name for name, s in calls if s == out.shape]
    if not heads:
        raise ConfigError(
            f"{what}: no layer with parameters of its own produces its {want} logits, so its classifier head "
            "cannot be found; end the forward with the head layer (e.g. nn.Linear(features, num_classes))"
        )
    return heads[-1]


def head_keys(state_keys, prefix: str | None) -> list[str]:
    """The state-dict keys of the head ``prefix`` (none when ``prefix`` is None)."""
    if prefix is None:
        return []
    return [k for k in state_keys if k.startswith(prefix + ".")]
