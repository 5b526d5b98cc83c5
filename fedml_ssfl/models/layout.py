"""The memory layout a model computes in: its weights' and its inputs' (``device_args.memory_format``).

PyTorch's CPU kernels differ a lot by layout. Measured on the project's 2-core CPU with one thread
(docs/performance.md): max-pooling runs ~8x faster in channels_last (NHWC) than in NCHW, which makes a
cnn28 training step with BatchNorm ~1.5x faster in NHWC; at CIFAR's 32x32 ResNet-18 and WRN-28-2 with
BatchNorm train 3 to 11% faster in NHWC (ResNet-18 on 16x16 images, 14% slower); GroupNorm runs slower
in NHWC (cnn28 5%, ResNet-18 2%). A convolution picks its layout from its
input's strides as much as from its weights', and a one-channel image can carry either strides while
looking contiguous to :meth:`torch.Tensor.is_contiguous`, so the layout is set on both: the model's
weights, and a forward pre-hook that gives every input the model's strides.

Choices: ``auto`` (on CPU: channels_last for a model without GroupNorm, contiguous for one with it;
on other devices: contiguous), ``channels_last``, ``contiguous``, and ``unchanged`` (no
conversion: each input keeps the strides the augmentation gave it, the behaviour before issue 15,
which reproduces earlier runs bit for bit).
The layouts compute the same functions; their results differ in the last bits of float rounding
(the kernels sum in another order).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

MEMORY_FORMATS = ("auto", "channels_last", "contiguous", "unchanged")


def resolve_layout(choice: str, model: nn.Module, device: str = "cpu") -> torch.memory_format | None:
    """The layout ``choice`` means for ``model`` trained on ``device`` (a device type): a
    :class:`torch.memory_format`, or None for ``unchanged``.

    Raises
    ------
    ValueError
        An unknown choice.
    """
    if choice not in MEMORY_FORMATS:
        raise ValueError(f"device_args.memory_format: {choice!r} is not one of {', '.join(MEMORY_FORMATS)}")
    if choice == "unchanged":
        return None
    if choice == "auto":
        group_norm = any(isinstance(m, nn.GroupNorm) for m in model.modules())
        choice = "channels_last" if device == "cpu" and not group_norm else "contiguous"
    return torch.channels_last if choice == "channels_last" else torch.contiguous_format


def as_layout(x: torch.Tensor, layout: torch.memory_format) -> torch.Tensor:
    """``x`` (N, C, H, W) with exactly ``layout``'s strides: itself when it has them, else a copy.

    Other tensors pass through.
    """
    if x.dim() != 4:
        return x
    _, c, h, w = x.shape
    want = (c * h * w, 1, w * c, c) if layout == torch.channels_last else (c * h * w, h * w, w, 1)
    return x if x.stride() == want else x.clone(memory_format=layout)


_LAYOUTS = {"channels_last": torch.channels_last, "contiguous": torch.contiguous_format}
_OFF = threading.local()


@contextmanager
def inputs_keep_strides() -> Iterator[None]:
    """Within this block the layout hook leaves inputs as they are (this thread only).

    For :func:`torch.func.vmap`, which cannot restride a batched tensor to channels_last; a vmapped
    model computes on stacked weights, whose layout is the stack's anyway.
    """
    before = getattr(_OFF, "on", False)
    _OFF.on = True
    try:
        yield
    finally:
        _OFF.on = before


def _input_to_layout(name: str, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if args and isinstance(args[0], torch.Tensor) and not getattr(_OFF, "on", False):
        return (as_layout(args[0], _LAYOUTS[name]), *args[1:])
    return None


def apply_layout(model: nn.Module, choice: str, device: str = "cpu") -> nn.Module:
    """Put ``model`` in the layout ``choice`` means for it on ``device`` (a device type; in place; returned).

    Its 4-d weights are converted and a forward pre-hook restrides its input (a module-level partial:
    the model still deep-copies and pickles). ``unchanged`` leaves the model as it is.
    """
    layout = resolve_layout(choice, model, device)
    if layout is None:
        return model
    name = "channels_last" if layout == torch.channels_last else "contiguous"
    if name == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    model.register_forward_pre_hook(partial(_input_to_layout, name))
    model.memory_layout = name  # type: ignore[assignment]
    return model


def model_layout(model: nn.Module) -> torch.memory_format | None:
    """The layout :func:`apply_layout` gave ``model`` (None: unchanged, or never applied)."""
    name = getattr(model, "memory_layout", None)
    return _LAYOUTS[name] if name is not None else None
